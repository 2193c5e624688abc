"""BART <-> vanilla, for every BART class: `python -m conversion bart` then `to-bart` (called in-process).

Each BART class is built tiny with transformers, saved, converted with `--head` read from its `architectures`, and
loaded back with the Auto class a user would use. Ours must give transformers' outputs on a padded batch (the
suite's float32 rule, tests/numerics.py) and, for the generating classes, the same greedy and beam tokens; the
round trip must return every tensor bit for bit.
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    BartConfig,
)

import hf_vanilla  # noqa: F401  (registers the Auto classes)
from hf_vanilla.conversion.cli import main
from hf_vanilla.conversion.formats.seq2seq import source_batch
from numerics import assert_close

CASES = {  # BART class -> (our Auto class, our class)
    "BartModel": (AutoModel, "VanillaSeq2SeqModel"),
    "BartForConditionalGeneration": (AutoModelForSeq2SeqLM, "VanillaSeq2SeqForConditionalGeneration"),
    "BartForSequenceClassification": (AutoModelForSequenceClassification, "VanillaSeq2SeqForSequenceClassification"),
    "BartForQuestionAnswering": (AutoModelForQuestionAnswering, "VanillaSeq2SeqForQuestionAnswering"),
    "BartForCausalLM": (AutoModelForCausalLM, "VanillaDecoderForCausalLM"),
}
OUTPUTS = ("last_hidden_state", "logits", "start_logits", "end_logits", "encoder_last_hidden_state")


def tiny_bart(directory, class_name, **more):
    fields = dict(vocab_size=60, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32,
                  num_labels=3) | more
    if class_name == "BartForCausalLM":
        fields |= dict(is_decoder=True, is_encoder_decoder=False)
    torch.manual_seed(0)
    getattr(transformers, class_name)(BartConfig(**fields)).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("bart_class", list(CASES))
def test_every_bart_class_converts_both_ways(bart_class, tmp_path, capsys):
    auto, our_class = CASES[bart_class]
    tiny_bart(tmp_path / "bart", bart_class)
    assert main(["bart", "--source", str(tmp_path / "bart"), "--output", str(tmp_path / "vanilla")]) == 0
    reference = getattr(transformers, bart_class).from_pretrained(tmp_path / "bart").eval()
    ours = auto.from_pretrained(tmp_path / "vanilla").eval()
    assert type(ours).__name__ == our_class
    # trust_remote_code: every module the auto_map names is saved next to the weights, and still is after a
    # save_pretrained (which keeps the map it loaded and copies the saved class's module and its imports alone).
    ours.save_pretrained(tmp_path / "resaved")
    for folder in (tmp_path / "vanilla", tmp_path / "resaved"):
        auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
        missing = [name for name in auto_map.values() if not (folder / f"{name.partition('.')[0]}.py").is_file()]
        assert not missing, (folder.name, missing)

    inputs = source_batch(ours.config)  # right-padded rows, each ending in eos (what the classifier reads)
    if bart_class in ("BartModel", "BartForConditionalGeneration"):
        target = source_batch(ours.config, seed=1, length=9)
        inputs |= {"decoder_input_ids": target["input_ids"], "decoder_attention_mask": target["attention_mask"]}
    real = inputs.get("decoder_attention_mask", inputs["attention_mask"]).bool()
    with torch.no_grad():
        expected, got = reference(**inputs), ours(**inputs)
    compared = [name for name in OUTPUTS if getattr(expected, name, None) is not None]
    assert compared
    for name in compared:
        want, have = getattr(expected, name), getattr(got, name)
        mask = inputs["attention_mask"].bool() if name == "encoder_last_hidden_state" else real
        if want.shape[:2] == mask.shape:  # per-token outputs: real tokens only
            want, have = want[mask], have[mask]
        assert_close(have, want, msg=name)
    if bart_class in ("BartForConditionalGeneration", "BartForCausalLM"):
        prompt = {k: inputs[k] for k in ("input_ids", "attention_mask")}
        if bart_class == "BartForCausalLM":
            # BartForCausalLM counts positions from a row's left edge, padding included; ours take the positions
            # `generate` derives from the mask (GPT-2's convention). They agree on the row without padding.
            prompt = {k: v[:1] for k, v in prompt.items()}
        for num_beams in (1, 3):
            options = dict(prompt, max_new_tokens=8, do_sample=False, num_beams=num_beams)
            with torch.no_grad():
                assert torch.equal(ours.generate(**options), reference.generate(**options)), num_beams

    assert main(["to-bart", "--source", str(tmp_path / "vanilla"), "--output", str(tmp_path / "back")]) == 0
    source, back = load_file(tmp_path / "bart" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    unused_cross_attention = [key for key in source if bart_class == "BartForCausalLM" and "encoder_attn" in key]
    assert set(back) == set(source)
    for key in set(source) - set(unused_cross_attention):
        assert torch.equal(back[key], source[key]), key
    assert "written as zeros" in capsys.readouterr().out if unused_cross_attention else True


def test_pre_ln_bart_variants_are_refused(tmp_path, capsys):
    tiny_bart(tmp_path / "bart", "BartModel")
    config = tmp_path / "bart" / "config.json"
    config.write_text(config.read_text().replace('"d_model"', '"normalize_before": true, "d_model"'))
    assert main(["bart", "--source", str(tmp_path / "bart"), "--output", str(tmp_path / "vanilla")]) == 2
    assert "mBART" in capsys.readouterr().err and not (tmp_path / "vanilla").exists()


def test_a_bart_decoder_whose_encoder_layers_differ_is_refused_as_transformers_failure(tmp_path, capsys):
    """BartForCausalLM sizes its cache from num_hidden_layers, which BartConfig reads from encoder_layers: with
    encoder_layers=1 and decoder_layers=2 transformers' own model fails (IndexError) while verification runs it. The
    refusal says the reference failed, why, and the fix, where it said "a bug in the converter"; the fix converts."""
    source = tiny_bart(tmp_path / "bart", "BartForCausalLM", encoder_layers=1)
    assert main(["bart", "--source", str(source), "--output", str(tmp_path / "vanilla")]) == 2
    err = capsys.readouterr().err
    assert "transformers' own BartForCausalLM, the reference the conversion is verified against, failed" in err
    assert "(IndexError: " in err and "bug in the converter" not in err
    assert "num_hidden_layers=1 layers (encoder_layers" in err and "decoder_layers=2" in err
    assert "set encoder_layers to 2 in the source's config.json" in err and not (tmp_path / "vanilla").exists()
    config = source / "config.json"
    config.write_text(config.read_text().replace('"encoder_layers": 1', '"encoder_layers": 2'))
    assert main(["bart", "--source", str(source), "--output", str(tmp_path / "vanilla")]) == 0


def test_to_bart_never_replaces_its_source(tmp_path, capsys):
    """to-bart ends like every reverse converter (write_source_format): --force cannot reach the folder it reads."""
    tiny_bart(tmp_path / "bart", "BartModel")
    assert main(["bart", "--source", str(tmp_path / "bart"), "--output", str(tmp_path / "vanilla")]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "vanilla").iterdir()}
    assert main(["to-bart", "--source", str(tmp_path / "vanilla"), "--output", str(tmp_path / "vanilla"),
                 "--force"]) == 2
    assert "error:" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "vanilla").iterdir()} == before
