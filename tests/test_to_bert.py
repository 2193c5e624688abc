"""vanilla -> BERT: `python -m conversion to-bert` reads the forward key table right to left.

BERT -> vanilla -> BERT returns every tensor bit for bit, the config and the tokenizer, and transformers loads the
result with its own classes and gives identical outputs. A model built or fine-tuned with hf_vanilla converts too;
what BERT cannot express is refused with the reason.
"""

import contextlib
import io
import json
import re

import pytest
import torch
import transformers
from numerics import assert_close
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer, BertConfig

from hf_vanilla.conversion.cli import main
from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)
LABELS = dict(id2label={0: "negative", 1: "neutral", 2: "positive"},
              label2id={"negative": 0, "neutral": 1, "positive": 2})
AUTO = {
    "BertModel": transformers.AutoModel,
    "BertForMaskedLM": transformers.AutoModelForMaskedLM,
    "BertForSequenceClassification": transformers.AutoModelForSequenceClassification,
    "BertForTokenClassification": transformers.AutoModelForTokenClassification,
    "BertForQuestionAnswering": transformers.AutoModelForQuestionAnswering,
    "BertLMHeadModel": transformers.AutoModelForCausalLM,
    "BertForNextSentencePrediction": transformers.AutoModelForNextSentencePrediction,
}


def cli(*argv):
    """Run the CLI in-process; returns (status, stdout)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main([str(a) for a in argv])
    return status, stdout.getvalue()


def round_trip(source, root):
    status, forward = cli("bert", "--source", source, "--output", root / "vanilla")
    assert status == 0, forward
    status, reverse = cli("to-bert", "--source", root / "vanilla", "--output", root / "bert")
    assert status == 0, reverse
    assert "OK: max |diff|" in reverse  # the written BERT was loaded and compared with the vanilla source
    return root / "bert", reverse


def batch_for(vocab_size, lengths=(12, 7, 4)):
    generator = torch.Generator().manual_seed(0)
    T = max(lengths)
    input_ids = torch.randint(5, vocab_size, (len(lengths), T), generator=generator)
    attention_mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    token_type_ids = (torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None] // 2).long() * attention_mask
    return {"input_ids": input_ids * attention_mask, "attention_mask": attention_mask, "token_type_ids": token_type_ids}


def assert_same_checkpoint(original_dir, written_dir):
    """Every tensor of the original, bit for bit, and nothing else; every config field."""
    original, written = load_file(original_dir / "model.safetensors"), load_file(written_dir / "model.safetensors")
    # Checkpoints saved by transformers 4 (MiniLM) also hold the index buffer 0..511, which transformers 5 neither
    # saves nor loads (it is recomputed); it is the only thing not carried back.
    buffer = original.pop("embeddings.position_ids", None)
    assert buffer is None or torch.equal(buffer.flatten(), torch.arange(buffer.numel()))
    assert sorted(written) == sorted(original)
    for key, tensor in original.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key
    original_config = json.loads((original_dir / "config.json").read_text())
    written_config = json.loads((written_dir / "config.json").read_text())
    # Every BertConfig field the original sets. transformers_version, dtype and _name_or_path describe the saver,
    # the weights and where they came from; keys transformers 5 no longer knows (MiniLM's `gradient_checkpointing`)
    # are not carried.
    fields = set(BertConfig().to_dict()) - {"transformers_version", "dtype", "_name_or_path"}
    for field in fields & set(original_config):
        assert written_config.get(field) == original_config[field], field
    assert "auto_map" not in written_config and not list(written_dir.glob("modeling_*.py"))


def assert_identical_outputs(original_dir, written_dir, bert_class):
    """transformers loads the result with its own Auto class (no hf_vanilla code involved) and computes exactly
    what the original computes."""
    auto = AUTO[bert_class]
    original = auto.from_pretrained(original_dir).eval()
    written = auto.from_pretrained(written_dir).eval()
    assert type(written).__name__ == bert_class
    batch = batch_for(original.config.vocab_size)
    if original.config.is_decoder:
        batch["use_cache"] = False  # the outputs, not a key/value cache object
    with torch.no_grad():
        expected, got = original(**batch), written(**batch)
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name


@pytest.mark.parametrize("bert_class", list(AUTO))
def test_round_trip_is_bit_exact(bert_class, tmp_path):
    torch.manual_seed(0)
    labels = LABELS if "Classification" in bert_class else {}
    causal = {"is_decoder": True} if bert_class == "BertLMHeadModel" else {}  # BERT's causal LM needs it said
    getattr(transformers, bert_class)(BertConfig(**TINY, **labels, **causal)).save_pretrained(tmp_path / "original")
    written, _ = round_trip(tmp_path / "original", tmp_path)
    assert_same_checkpoint(tmp_path / "original", written)
    assert_identical_outputs(tmp_path / "original", written, bert_class)


def test_round_trip_of_a_base_model_without_pooler(tmp_path):
    torch.manual_seed(0)
    transformers.BertModel(BertConfig(**TINY), add_pooling_layer=False).save_pretrained(tmp_path / "original")
    written, _ = round_trip(tmp_path / "original", tmp_path)
    assert not any("pooler" in key for key in load_file(tmp_path / "vanilla" / "model.safetensors"))
    assert_same_checkpoint(tmp_path / "original", written)


def test_round_trip_of_real_minilm_with_tokenizer(minilm_path, tmp_path):
    written, _ = round_trip(minilm_path, tmp_path)
    assert_same_checkpoint(minilm_path, written)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "modules.json",
                 "sentence_bert_config.json", "1_Pooling/config.json"):
        assert (written / name).read_bytes() == (minilm_path / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(written)
    batch = tokenizer(["A man is playing a guitar.", "Hi"], ["Someone plays music.", "Hello there"], padding=True,
                      return_tensors="pt")
    original, result = AutoModel.from_pretrained(minilm_path).eval(), AutoModel.from_pretrained(written).eval()
    assert type(result).__name__ == "BertModel"
    with torch.no_grad():
        expected, got = original(**batch), result(**batch)
    assert torch.equal(expected.last_hidden_state, got.last_hidden_state)
    assert torch.equal(expected.pooler_output, got.pooler_output)


def test_pretraining_round_trip_keeps_everything(tmp_path):
    """BertForPreTraining -> VanillaEncoderForPreTraining -> BertForPreTraining: pooler and NSP head included."""
    torch.manual_seed(0)
    transformers.BertForPreTraining(BertConfig(**TINY)).save_pretrained(tmp_path / "original")
    written, _ = round_trip(tmp_path / "original", tmp_path)
    original, result = load_file(tmp_path / "original" / "model.safetensors"), load_file(written / "model.safetensors")
    assert sorted(result) == sorted(original) and any("seq_relationship" in k for k in result)
    assert all(torch.equal(result[k], original[k]) for k in result)


# ---- models built with hf_vanilla ----------------------------------------------------------------------------


def test_fine_tuned_vanilla_classifier_converts(tmp_path):
    """A classifier created and trained with our package (never a BERT checkpoint) becomes a BERT."""
    torch.manual_seed(0)
    config = VanillaEncoderConfig(**TINY, num_labels=3, **LABELS)
    model = VanillaEncoderForSequenceClassification(config)
    batch = batch_for(TINY["vocab_size"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        loss = model(**batch, labels=torch.tensor([0, 2, 1])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().save_pretrained(tmp_path / "vanilla")

    status, printed = cli("to-bert", "--source", tmp_path / "vanilla", "--output", tmp_path / "bert")
    assert status == 0, printed
    bert = AutoModelForSequenceClassification.from_pretrained(tmp_path / "bert").eval()
    assert type(bert).__name__ == "BertForSequenceClassification"
    assert bert.config.id2label == LABELS["id2label"]
    with torch.no_grad():
        expected, got = model(**batch).logits, bert(**batch).logits
    assert_close(got, expected)
    assert expected.argmax(-1).tolist() == got.argmax(-1).tolist()
    source = load_file(tmp_path / "vanilla" / "model.safetensors")
    written = load_file(tmp_path / "bert" / "model.safetensors")
    assert torch.equal(written["bert.encoder.layer.1.attention.self.query.weight"],
                       source["model.encoder.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(written["classifier.weight"], source["classifier.weight"])


@pytest.mark.parametrize("model_class", [VanillaEncoderForMaskedLM, VanillaEncoderForTokenClassification])
def test_heads_bert_builds_without_a_pooler_have_none(model_class, tmp_path):
    """Built as BERT builds them: no pooler nobody reads (it would never train), so to-bert maps every tensor."""
    torch.manual_seed(0)
    model = model_class(VanillaEncoderConfig(**TINY)).eval()  # use_pooler=True by default: the config's, not theirs
    assert model.model.pooler is None
    model.save_pretrained(tmp_path / "vanilla")
    status, printed = cli("to-bert", "--source", tmp_path / "vanilla", "--output", tmp_path / "bert")
    assert status == 0
    bert = AUTO[model_class.__name__.replace("VanillaEncoder", "Bert")].from_pretrained(tmp_path / "bert").eval()
    batch = batch_for(TINY["vocab_size"])
    with torch.no_grad():
        real = batch["attention_mask"].bool()
        assert_close(bert(**batch).logits[real], model(**batch).logits[real])


def test_dtype_is_kept_unless_asked(tmp_path):
    torch.manual_seed(0)
    transformers.BertForMaskedLM(BertConfig(**TINY)).save_pretrained(tmp_path / "original")
    assert cli("bert", "--source", tmp_path / "original", "--output", tmp_path / "vanilla", "--dtype", "bfloat16")[0] == 0
    assert cli("to-bert", "--source", tmp_path / "vanilla", "--output", tmp_path / "bf16")[0] == 0
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    assert cli("to-bert", "--source", tmp_path / "vanilla", "--output", tmp_path / "fp32", "--dtype", "float32")[0] == 0
    tensors = load_file(tmp_path / "fp32" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    original = load_file(tmp_path / "original" / "model.safetensors")
    key = "bert.encoder.layer.0.output.dense.weight"
    assert torch.equal(tensors[key], original[key].bfloat16().float())  # exactly the bf16 values, widened


def test_half_precision_is_verified_as_saved(tmp_path, capsys):
    """The written BERT is loaded in the dtype it was saved in and held to that dtype's rule: loaded in float32 and
    held to float32's, every float16 conversion of a float32 model was refused. Weights the cast makes Inf are
    refused by name."""
    torch.manual_seed(0)
    VanillaEncoderForMaskedLM(VanillaEncoderConfig(**TINY)).save_pretrained(tmp_path / "vanilla")
    status, printed = cli("to-bert", "--source", tmp_path / "vanilla", "--output", tmp_path / "fp16", "--dtype",
                          "float16")
    assert status == 0, capsys.readouterr().err
    assert re.search(r"OK: .*\(fp16, .*tolerance 0\.01 x max\(1, \|output\|\)", printed), printed
    assert {t.dtype for t in load_file(tmp_path / "fp16" / "model.safetensors").values()} == {torch.float16}

    model = VanillaEncoderForMaskedLM.from_pretrained(tmp_path / "vanilla")
    with torch.no_grad():
        model.model.encoder.layers[0].ffn.down_proj.bias[0] = 1e6
    model.save_pretrained(tmp_path / "large")
    assert cli("to-bert", "--source", tmp_path / "large", "--output", tmp_path / "inf", "--dtype", "float16")[0] == 2
    assert ("In float16 1 tensors would hold Inf or NaN (values beyond its range, ±65504): "
            "['bert.encoder.layer.0.output.dense.bias']") in capsys.readouterr().err
    assert not (tmp_path / "inf").exists()


# ---- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"position_embedding_type": "sinusoidal"}, r"position_embedding_type='sinusoidal' \(BERT learns its "
                                                    r"position embeddings; needs 'learned'\)"),
        ({"pre_norm": True}, r"pre_norm=True \(BERT normalises after each residual sum \(post-LN\); needs False\)"),
        ({"scale_embeddings": True}, "scale_embeddings=True"),
        ({"embedding_layer_norm": False}, "embedding_layer_norm=False"),
        ({"position_offset": 2}, r"position_offset=2 \(BERT numbers positions from 0"),
        ({"embedding_size": 16}, r"embedding_size=16 \(BERT embeds at hidden_size=32; needs 32\)"),
        ({"type_vocab_size": 0}, "type_vocab_size=0"),
    ],
)
def test_refuses_what_bert_cannot_express(fields, message, tmp_path, capsys):
    VanillaEncoderModel(VanillaEncoderConfig(**TINY | fields)).save_pretrained(tmp_path / "vanilla")
    assert main(["to-bert", "--source", str(tmp_path / "vanilla"), "--output", str(tmp_path / "bert")]) == 2
    err = capsys.readouterr().err
    assert "error: This model cannot be expressed as BERT" in err and re.search(message, err), err
    assert not (tmp_path / "bert").exists() and not list(tmp_path.glob(".bert.*"))


def test_refuses_every_inexpressible_field_at_once(tmp_path, capsys):
    VanillaEncoderModel(VanillaEncoderConfig(**TINY, pre_norm=True, scale_embeddings=True)).save_pretrained(
        tmp_path / "vanilla")
    assert main(["to-bert", "--source", str(tmp_path / "vanilla"), "--output", str(tmp_path / "bert")]) == 2
    err = capsys.readouterr().err
    assert "pre_norm=True" in err and "scale_embeddings=True" in err


def test_refuses_a_sequence_classifier_without_pooler(tmp_path, capsys):
    VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**TINY, use_pooler=False)).save_pretrained(
        tmp_path / "vanilla")
    assert main(["to-bert", "--source", str(tmp_path / "vanilla"), "--output", str(tmp_path / "bert")]) == 2
    assert "use_pooler=False (BertForSequenceClassification reads its pooler; needs True)" in capsys.readouterr().err


def test_refuses_sources_that_are_not_vanilla_encoders(tmp_path, capsys):
    transformers.BertModel(BertConfig(**TINY)).save_pretrained(tmp_path / "bert_source")
    assert main(["to-bert", "--source", str(tmp_path / "bert_source"), "--output", str(tmp_path / "out")]) == 2
    assert "holds a 'bert' model, but the 'to-bert' converter reads 'vanilla_encoder'" in capsys.readouterr().err
    config = VanillaSeq2SeqConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    VanillaSeq2SeqForConditionalGeneration(config).save_pretrained(tmp_path / "seq2seq")
    assert main(["to-bert", "--source", str(tmp_path / "seq2seq"), "--output", str(tmp_path / "out")]) == 2
    assert "holds a 'vanilla_seq2seq' model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_refuses_existing_output_without_force(tmp_path, capsys):
    VanillaEncoderModel(VanillaEncoderConfig(**TINY)).save_pretrained(tmp_path / "vanilla")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "keep.txt").write_text("mine")
    assert main(["to-bert", "--source", str(tmp_path / "vanilla"), "--output", str(tmp_path / "bert")]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "bert").iterdir()] == ["keep.txt"]
    # --force replaces only an earlier output of the converter, never a folder holding anything else.
    assert main(["to-bert", "--source", str(tmp_path / "vanilla"), "--output", str(tmp_path / "bert"), "--force"]) == 2
    assert "--force refuses to replace" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "bert").iterdir()] == ["keep.txt"]
    assert cli("to-bert", "--source", tmp_path / "vanilla", "--output", tmp_path / "converted")[0] == 0
    assert cli("to-bert", "--source", tmp_path / "vanilla", "--output", tmp_path / "converted", "--force")[0] == 0
    assert (tmp_path / "converted" / "model.safetensors").exists()
