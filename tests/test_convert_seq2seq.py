"""BERT encoder-decoders -> VanillaSeq2SeqForConditionalGeneration: `warm-start` on the real MiniLM weights, and
`bert2bert` on a random transformers `EncoderDecoderModel` (BERT encoder, BERT decoder with cross-attention) that
uses the real bert-base-uncased vocabulary, so that the tokenizer and the pipeline see real text."""

import json
import shutil
from contextlib import redirect_stdout
from functools import partial
from io import StringIO
from pathlib import Path

import pytest
import torch
from numerics import assert_close
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertModel,
    EncoderDecoderConfig,
    EncoderDecoderModel,
)

import hf_vanilla  # noqa: F401  (registers the Auto classes)
from hf_vanilla.conversion import flow
from hf_vanilla.conversion.cli import main as cli
from hf_vanilla.conversion.errors import ConversionError
from hf_vanilla.conversion.formats.bert2bert import BERT2BERT, WARM_START

convert_bert2bert = partial(flow.convert, BERT2BERT)
convert_warm_start = partial(flow.convert, WARM_START)

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is all you need.",
    "A short one.",
]


def quiet(function, *args, **kwargs):
    with redirect_stdout(StringIO()) as printed:
        result = function(*args, **kwargs)
    return result, printed.getvalue()


def make_bert2bert(directory: Path, tokenizer_dir: Path, seed: int = 0, tie_encoder_decoder: bool = False) -> Path:
    """A small random bert2bert with the bert-base-uncased vocabulary; encoder and decoder differ in depth, heads
    and feed-forward width, as `decoder_*` allows."""
    common = dict(vocab_size=30522, hidden_size=32, initializer_range=0.1)
    encoder = BertConfig(**common, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    decoder = BertConfig(**common, num_hidden_layers=3, num_attention_heads=2, intermediate_size=45)
    if tie_encoder_decoder:  # transformers 4 tied every encoder module to the decoder: the sizes must agree
        decoder = BertConfig(**common, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        encoder, decoder, decoder_start_token_id=101, pad_token_id=0, eos_token_id=102)
    torch.manual_seed(seed)
    model = EncoderDecoderModel(config=config).eval()
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy2(Path(tokenizer_dir) / name, directory / name)
    return directory


def padded_inputs(tokenizer_dir, with_targets: bool = True) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    inputs = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    if with_targets:
        targets = tokenizer(["Ein Fuchs.", "Aufmerksamkeit ist alles, was man braucht.", "Kurz."], padding=True,
                            return_tensors="pt")
        inputs["decoder_input_ids"] = targets["input_ids"]  # starts with [CLS] = decoder_start_token_id
        inputs["decoder_attention_mask"] = targets["attention_mask"]
    assert (inputs["attention_mask"] == 0).any()  # padded
    assert not with_targets or (inputs["decoder_attention_mask"] == 0).any()
    return inputs


def assert_matches_at(mask, ours, expected, what="logits"):
    """`ours` within the float32 rule of `expected` (tests/numerics.py) at the positions where `mask` is 1."""
    assert_close(ours[mask.bool()], expected[mask.bool()], msg=what)


@pytest.fixture(scope="module")
def bert2bert(tmp_path_factory, minilm_path):
    """(reference dir, converted dir) for a random bert2bert."""
    root = tmp_path_factory.mktemp("bert2bert")
    source = make_bert2bert(root / "reference", minilm_path)
    _, printed = quiet(convert_bert2bert, str(source), str(root / "converted"))
    assert "OK:" in printed
    return source, root / "converted"


@pytest.fixture(scope="module")
def bert2bert_models(bert2bert):
    """(transformers' reference, our conversion reloaded from disk), loaded once for the module."""
    source, converted = bert2bert
    reference = EncoderDecoderModel.from_pretrained(source, attn_implementation="eager").eval()
    return reference, AutoModelForSeq2SeqLM.from_pretrained(converted).eval()


# ---- bert2bert --------------------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_bert2bert_logits_match_after_reload(bert2bert, bert2bert_models):
    source, _ = bert2bert
    reference, ours = bert2bert_models
    assert type(ours).__name__ == "VanillaSeq2SeqForConditionalGeneration"
    inputs = padded_inputs(source)
    inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    inputs["token_type_ids"][0, 5:] = 1  # a second segment: the encoder's token types are carried over
    with torch.no_grad():
        expected = reference(**inputs, output_hidden_states=True)
        got = ours(**inputs, output_hidden_states=True)
    mask, target_mask = inputs["attention_mask"], inputs["decoder_attention_mask"]
    for layer, (e, o) in enumerate(zip(expected.encoder_hidden_states, got.encoder_hidden_states, strict=True)):
        assert_matches_at(mask, o, e, f"encoder layer {layer}")
    for layer, (e, o) in enumerate(zip(expected.decoder_hidden_states, got.decoder_hidden_states, strict=True)):
        assert_matches_at(target_mask, o, e, f"decoder layer {layer}")
    assert_matches_at(target_mask, got.logits, expected.logits)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_bert2bert_generate_is_identical(bert2bert, bert2bert_models, num_beams):
    source, _ = bert2bert
    reference, ours = bert2bert_models
    inputs = padded_inputs(source, with_targets=False)
    kwargs = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=12,
                  num_beams=num_beams, do_sample=False)
    with torch.no_grad():
        expected = reference.generate(**kwargs)
        got = ours.generate(**kwargs)
    assert torch.equal(expected, got)
    assert (got[:, 0] == 101).all()  # started from [CLS]
    assert got.shape[1] > 2  # something was generated


def test_bert2bert_config_and_files(bert2bert):
    source, converted = bert2bert
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "vanilla_seq2seq"
    expected = {
        "position_embedding_type": "learned", "hidden_act": "gelu", "type_vocab_size": 2,
        "embedding_layer_norm": True, "layer_norm_eps": 1e-12, "scale_embeddings": False,
        "lm_head_transform": True, "share_encoder_decoder_embeddings": False, "pre_norm": False,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37,
        "decoder_layers": 3, "decoder_attention_heads": 2, "decoder_intermediate_size": 45,
        "decoder_start_token_id": 101, "eos_token_id": 102, "pad_token_id": 0,
    }
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((converted / "generation_config.json").read_text())
    special = ("decoder_start_token_id", "eos_token_id", "pad_token_id")
    assert tuple(generation[k] for k in special) == (101, 102, 0)
    for name in TOKENIZER_FILES:
        assert (converted / name).read_bytes() == (source / name).read_bytes()
    tensors = load_file(converted / "model.safetensors")
    assert not any("pooler" in k for k in tensors)  # dropped with a reason: the decoder never reads it


def test_bert2bert_pipeline_matches_reference(bert2bert, bert2bert_models):
    source, converted = bert2bert
    pytest.importorskip("hf_vanilla.pipelines", reason="the seq2seq-generation pipeline is not in hf_vanilla yet")
    from transformers import pipeline

    tokenizer = AutoTokenizer.from_pretrained(source)
    reference, _ = bert2bert_models
    generator = pipeline("seq2seq-generation", model=str(converted))
    for sentence in SENTENCES[:2]:
        inputs = tokenizer(sentence, return_tensors="pt")
        with torch.no_grad():
            ids = reference.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                     max_new_tokens=8, num_beams=1, do_sample=False)
        expected = tokenizer.decode(ids[0], skip_special_tokens=True)
        output = generator(sentence, max_new_tokens=8, num_beams=1, do_sample=False)
        output = output[0] if isinstance(output, list) else output
        assert output["generated_text"] == expected


@pytest.mark.parametrize("tie_output", [True, False], ids=["tied-output", "untied-output"])
def test_bert2bert_legacy_tie_encoder_decoder(tmp_path, minilm_path, tie_output):
    """transformers 4's `tie_encoder_decoder=True` stored the shared modules once, under `encoder.`: the decoder
    gets its own copies, and its word embeddings stay shared with the encoder's (as equal copies when the output
    projection is untied: one shared matrix would tie it)."""
    source = make_bert2bert(tmp_path / "tied", minilm_path, seed=1, tie_encoder_decoder=True)
    config = json.loads((source / "config.json").read_text())
    config["tie_encoder_decoder"] = True
    config["decoder"]["tie_word_embeddings"] = tie_output
    (source / "config.json").write_text(json.dumps(config))
    tensors = load_file(source / "model.safetensors")
    for key in [k for k in tensors if k.startswith("decoder.bert.") and "crossattention" not in k]:
        tensors[key] = tensors["encoder." + key.removeprefix("decoder.bert.")]
    if not tie_output:  # an output projection of its own
        embeddings = tensors["encoder.embeddings.word_embeddings.weight"]
        tensors["decoder.cls.predictions.decoder.weight"] = embeddings + 0.01 * torch.randn_like(embeddings)
    save_file({k: v for k, v in tensors.items()
               if not (k.startswith("decoder.bert.") and "crossattention" not in k)}, source / "model.safetensors")
    _, printed = quiet(convert_bert2bert, str(source), str(tmp_path / "converted"))
    assert "copied" in printed and "OK:" in printed
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "converted").eval()
    assert ours.config.share_encoder_decoder_embeddings is tie_output
    assert torch.equal(ours.model.encoder.embeddings.word_embeddings.weight,
                       ours.model.decoder.embeddings.word_embeddings.weight)
    reference = EncoderDecoderModel.from_pretrained(source).eval()
    reference.load_state_dict(tensors, strict=False)  # the tie transformers 5 no longer makes
    inputs = padded_inputs(source)
    with torch.no_grad():
        expected, got = reference(**inputs).logits, ours(**inputs).logits
    assert_matches_at(inputs["decoder_attention_mask"], got, expected)


# ---- warm-start -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_started(tmp_path_factory, minilm_path):
    output = tmp_path_factory.mktemp("warm") / "minilm2minilm"
    _, printed = quiet(convert_warm_start, str(minilm_path), str(output))
    assert "OK:" in printed and "no masked-LM head" in printed
    return output


@pytest.fixture(scope="module")
def warm_model(warm_started):
    return AutoModelForSeq2SeqLM.from_pretrained(warm_started).eval()


@pytest.mark.numerics
def test_warm_start_encoder_reproduces_minilm(warm_model, minilm_path):
    bert = BertModel.from_pretrained(minilm_path, attn_implementation="eager").eval()
    ours = warm_model
    inputs = padded_inputs(minilm_path, with_targets=False)
    with torch.no_grad():
        expected = bert(**inputs, output_hidden_states=True).hidden_states
        got = ours.get_encoder()(**inputs, output_hidden_states=True).hidden_states
    assert len(expected) == len(got) == 7
    for layer, (e, o) in enumerate(zip(expected, got, strict=True)):
        assert_matches_at(inputs["attention_mask"], o, e, f"layer {layer}")


def test_warm_start_decoder_holds_its_own_copy_of_bert(warm_model, minilm_path):
    bert = load_file(Path(minilm_path) / "model.safetensors")
    ours = warm_model
    state = ours.state_dict()
    pairs = {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
        "encoder.layer.5.attention.self.query.weight": "layers.5.self_attn.q_proj.weight",
        "encoder.layer.3.output.dense.bias": "layers.3.ffn.down_proj.bias",
    }
    for bert_key, ours_key in pairs.items():
        encoder, decoder = state[f"model.encoder.{ours_key}"], state[f"model.decoder.{ours_key}"]
        assert torch.equal(encoder, bert[bert_key]) and torch.equal(decoder, bert[bert_key])
        assert encoder.data_ptr() != decoder.data_ptr()  # copies, not shared storage
    # Cross-attention is new: N(0, 0.02) weights, zero biases, unit LayerNorm, different in every layer.
    q0 = state["model.decoder.layers.0.cross_attn.q_proj.weight"]
    q1 = state["model.decoder.layers.1.cross_attn.q_proj.weight"]
    assert abs(q0.std().item() - 0.02) < 0.002 and not torch.equal(q0, q1)
    assert not state["model.decoder.layers.0.cross_attn.o_proj.bias"].any()
    assert torch.equal(state["model.decoder.layers.0.cross_attn_norm.weight"], torch.ones(384))
    # No MLM head in MiniLM: the output projection is the decoder's embedding matrix, with a zero bias.
    assert ours.lm_head.decoder.weight.data_ptr() == ours.model.decoder.embeddings.word_embeddings.weight.data_ptr()
    assert not ours.lm_head.decoder.bias.any()


def test_warm_start_config_generation_and_files(warm_started, warm_model, minilm_path):
    config = json.loads((warm_started / "config.json").read_text())
    assert (config["decoder_start_token_id"], config["eos_token_id"], config["pad_token_id"]) == (101, 102, 0)
    assert config["share_encoder_decoder_embeddings"] is False and config["lm_head_transform"] is True
    generation = json.loads((warm_started / "generation_config.json").read_text())
    special = ("decoder_start_token_id", "eos_token_id", "pad_token_id")
    assert tuple(generation[k] for k in special) == (101, 102, 0)
    assert (warm_started / "vocab.txt").is_file()
    # An encoder-decoder is not a sentence embedder: sentence-transformers' files stay behind.
    assert not (warm_started / "modules.json").exists() and not (warm_started / "1_Pooling").exists()
    inputs = padded_inputs(minilm_path, with_targets=False)
    with torch.no_grad():
        ids = warm_model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert (ids[:, 0] == 101).all()


def test_warm_start_takes_the_mlm_head(tmp_path):
    """A BERT with its MLM head: the decoder's LM head is BERT's (transform and output bias)."""
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48)
    torch.manual_seed(0)
    bert = BertForMaskedLM(config).eval()
    with torch.no_grad():
        bert.cls.predictions.bias.normal_()
    bert.save_pretrained(tmp_path / "mlm")
    with pytest.raises(ConversionError, match="no tokenizer"):  # nothing to read [CLS] and [SEP] from
        quiet(convert_warm_start, str(tmp_path / "mlm"), str(tmp_path / "no_ids"))
    assert not (tmp_path / "no_ids").exists()
    _, printed = quiet(convert_warm_start, str(tmp_path / "mlm"), str(tmp_path / "out"),
                       decoder_start_token_id=3, eos_token_id=4)
    assert "BERT's masked-LM head" in printed and "OK:" in printed
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out")
    assert torch.equal(ours.lm_head.dense.weight, bert.cls.predictions.transform.dense.weight)
    assert torch.equal(ours.lm_head.norm.bias, bert.cls.predictions.transform.LayerNorm.bias)
    assert torch.equal(ours.lm_head.decoder.bias, bert.cls.predictions.bias)
    assert ours.generation_config.decoder_start_token_id == 3 and ours.generation_config.eos_token_id == 4


# ---- refusals and the command line -----------------------------------------------------------------------------


def test_refuses_wrong_source_types(bert2bert, minilm_path, tmp_path):
    source, _ = bert2bert
    with pytest.raises(ConversionError, match="holds a 'bert' model"):
        convert_bert2bert(str(minilm_path), str(tmp_path / "a"))
    with pytest.raises(ConversionError, match="holds a 'encoder-decoder' model"):
        convert_warm_start(str(source), str(tmp_path / "b"))
    gpt2_decoder = tmp_path / "bert2gpt2"
    gpt2_decoder.mkdir()
    (gpt2_decoder / "config.json").write_text(json.dumps(
        {"model_type": "encoder-decoder", "encoder": {"model_type": "bert"}, "decoder": {"model_type": "gpt2"}}))
    with pytest.raises(ConversionError, match="decoder is 'gpt2'"):
        convert_bert2bert(str(gpt2_decoder), str(tmp_path / "c"))
    assert not any((tmp_path / name).exists() for name in "abc")


def test_cli_exit_codes(bert2bert, minilm_path, tmp_path, capsys):
    source, converted = bert2bert
    assert cli(["bert2bert", "--source", str(minilm_path), "--output", str(tmp_path / "x")]) == 2
    assert "'bert' model" in capsys.readouterr().err
    assert cli(["bert2bert", "--source", str(source), "--output", str(converted)]) == 2  # exists, no --force
    assert "--force" in capsys.readouterr().err
    assert cli(["bert2bert", "--source", str(source), "--output", str(tmp_path / "y"), "--no-verify",
                "--dtype", "bfloat16"]) == 0
    assert "Not verified" in (tmp_path / "y" / "README.md").read_text()
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "y").dtype == torch.bfloat16
