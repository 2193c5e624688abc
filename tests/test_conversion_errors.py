"""Bad configs and bad checkpoints fail clearly.

Every conversion error is a message on stderr and exit status 2 from the command line, and leaves no output
behind: no output directory, no `.OUT.partial-*` staging directory, and an existing output untouched.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertTokenizer,
    DistilBertConfig,
    DistilBertModel,
    EncoderDecoderConfig,
    EncoderDecoderModel,
    GPT2Config,
    GPT2Model,
)

from hf_vanilla.conversion import flow
from hf_vanilla.conversion.cli import main
from hf_vanilla.conversion.formats import bert
from hf_vanilla.conversion.formats.encoder import EncoderFormat
from hf_vanilla import VanillaEncoderConfig, VanillaSeq2SeqConfig
from test_convert_bart import tiny_bart
from test_convert_marian import make_marian

# ---- config validation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_size": 30, "num_attention_heads": 4}, r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"intermediate_size": 0}, "intermediate_size must be a positive integer, got 0"),
        ({"vocab_size": -5}, "vocab_size must be a positive integer, got -5"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
        ({"hidden_act": "gelu_fancy"}, r"Unknown hidden_act 'gelu_fancy'; choose one of \[.*'gelu'.*'relu'"),
        ({"position_embedding_type": "rotary"}, r"Unknown position_embedding_type 'rotary'; choose one of .*learned"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps must be > 0"),
        ({"hidden_dropout_prob": 1.5}, r"hidden_dropout_prob must be in \[0, 1\)"),
        ({"vocab_size": 99, "pad_token_id": 99}, r"pad_token_id \(99\) is not a row of the embedding table \(ids 0 to "
                                                 r"vocab_size-1=98\)"),
    ],
)
def test_invalid_encoder_config(fields, message):
    # Each field is checked at construction; how fields agree (heads dividing the width), before a model is built.
    with pytest.raises(ValueError, match=message):
        VanillaEncoderConfig(**fields).check_architecture()


def test_invalid_seq2seq_config():
    with pytest.raises(ValueError, match=r"hidden_size \(512\) must be divisible by decoder_attention_heads \(7\)"):
        VanillaSeq2SeqConfig(decoder_attention_heads=7).check_architecture()
    with pytest.raises(ValueError, match="decoder_layers must be a positive integer, got 0"):
        VanillaSeq2SeqConfig(decoder_layers=0)


def test_valid_config_suggests_head_counts():
    with pytest.raises(ValueError, match=r"Try num_attention_heads in \[1, 2, 3, 5, 6, 10, 15, 30\]"):
        VanillaEncoderConfig(hidden_size=30, num_attention_heads=4).check_architecture()


# ---- conversion errors -----------------------------------------------------------------------------------------------

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)


def tiny_bert(directory):
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**TINY)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    return tiny_bert(tmp_path_factory.mktemp("tiny") / "bert")


@pytest.fixture
def source(tiny_bert_dir, tmp_path):
    """A private copy of the tiny BERT, for a test to damage."""
    return shutil.copytree(tiny_bert_dir, tmp_path / "source")


def edit_config(directory, **fields):
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def edit_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def leftovers(output):
    return sorted(p.name for p in output.parent.glob(f".{output.name}.*"))


def assert_refused(capsys, output, message, *argv):
    """The CLI exits with 2, prints `message` (a regex) on stderr, creates no output and leaves no staging
    directory. Returns what it printed."""
    existed = output.exists()
    status = main([str(a) for a in argv])
    printed = capsys.readouterr()
    assert status == 2, printed.err
    error = printed.err[printed.err.find("error: "):]  # after any progress bars
    assert printed.err.count("error: ") == 1 and re.search(message, error), printed.err
    assert output.exists() == existed
    assert leftovers(output) == []
    return printed


def test_unknown_source(tmp_path, capsys):
    output = tmp_path / "out"
    assert_refused(capsys, output, r"'no-such-org/no-such-bert' is not a local directory and could not be fetched",
                   "bert", "--source", "no-such-org/no-such-bert", "--output", output)
    assert_refused(capsys, output, "is not a local directory", "bert", "--source", tmp_path / "missing", "--output",
                   output)


def test_source_is_a_file_or_not_a_checkpoint(tmp_path, source, capsys):
    output = tmp_path / "out"
    assert_refused(capsys, output, "is a file; pass the checkpoint's directory",
                   "bert", "--source", source / "config.json", "--output", output)
    (source / "config.json").unlink()
    assert_refused(capsys, output, "has no config.json", "bert", "--source", source, "--output", output)


def test_no_weights(tmp_path, source, capsys):
    (source / "model.safetensors").unlink()
    output = tmp_path / "out"
    assert_refused(capsys, output, r"has no weights \(model.safetensors.*found \['config.json'",
                   "bert", "--source", source, "--output", output)


def test_missing_tensor(tmp_path, source, capsys):
    edit_tensors(source, lambda t: t.pop("bert.encoder.layer.1.attention.self.key.weight"))
    output = tmp_path / "out"
    assert_refused(capsys, output,
                   r"target tensors the source does not fill: \['model.encoder.layers.1.self_attn.k_proj.weight "
                   r"\(from encoder.layer.1.attention.self.key.weight\)'\]",
                   "bert", "--source", source, "--output", output)


def test_unexpected_tensor(tmp_path, source, capsys):
    edit_tensors(source, lambda t: t.update({"bert.encoder.layer.0.adapter.weight": torch.zeros(2)}))
    output = tmp_path / "out"
    assert_refused(capsys, output, r"source tensors with no mapping: \['bert.encoder.layer.0.adapter.weight'\]",
                   "bert", "--source", source, "--output", output)


def test_wrong_shape(tmp_path, source, capsys):
    edit_config(source, intermediate_size=40)
    output = tmp_path / "out"
    printed = assert_refused(capsys, output, r"shape mismatches: .*'model.encoder.layers.0.ffn.up_proj.weight \(from "
                                             r"bert.encoder.layer.0.intermediate.dense.weight\): source \(37, 32\) vs "
                                             r"target \(40, 32\)'", "bert", "--source", source, "--output", output)
    assert "layers.1.ffn.down_proj.weight" in printed.err  # every mismatch is listed, not just the first


def test_config_no_model_can_be_built_from(tmp_path, source, capsys):
    edit_config(source, hidden_size=30)
    output = tmp_path / "out"
    assert_refused(capsys, output, r"config.json describes no valid encoder: hidden_size \(30\) must be divisible",
                   "bert", "--source", source, "--output", output)


# warm-start reads [CLS] and [SEP] from a tokenizer, which the tiny BERT has not: given instead.
CONVERTERS = {"bert": [], "warm-start": ["--decoder-start-token-id", "1", "--eos-token-id", "2"]}


@pytest.mark.parametrize("converter", list(CONVERTERS))
def test_pad_token_id_outside_the_vocabulary(tmp_path, source, capsys, converter):
    """A padding id past the embedding table ended in torch's AssertionError, reported as a bug in the converter."""
    edit_config(source, pad_token_id=10**6)
    output = tmp_path / "out"
    assert_refused(capsys, output, r"config.json describes no valid encoder: pad_token_id \(1000000\) is not a row of "
                                   r"the embedding table \(ids 0 to vocab_size-1=98\); set it to the tokenizer's",
                   converter, "--source", source, "--output", output, *CONVERTERS[converter])


@pytest.mark.parametrize(("converter", "depth"), [("bert", 100_000), ("warm-start", 600)])
def test_a_config_nested_too_deep(tmp_path, source, capsys, converter, depth):
    """JSON's parser recurses (a RecursionError near 1000 levels), and so does transformers when it copies a config
    (near 450): both ended as "a bug in the converter". Refused as the damaged input it is, naming the field."""
    text = (source / "config.json").read_text().rstrip().removesuffix("}")
    nested = '{"a": ' * depth + "1" + "}" * depth
    (source / "config.json").write_text(f'{text}, "task_specific_params": {nested}}}')
    output = tmp_path / "out"
    assert_refused(capsys, output, r"config.json nests values more than 64 levels deep \(under "
                                   r"'task_specific_params'\), as no model config does: the file is damaged",
                   converter, "--source", source, "--output", output, *CONVERTERS[converter])


def test_relative_positions_refused(tmp_path, source, capsys):
    edit_config(source, position_embedding_type="relative_key")
    output = tmp_path / "out"
    assert_refused(capsys, output, "position_embedding_type='relative_key' .* has no vanilla equivalent",
                   "bert", "--source", source, "--output", output)


def test_untied_decoder_refused(tmp_path, source, capsys):
    edit_tensors(source, lambda t: t.update({"cls.predictions.decoder.weight": torch.randn(99, 32)}))
    output = tmp_path / "out"
    assert_refused(capsys, output, "cls.predictions.decoder.weight differs from embeddings.word_embeddings.weight, "
                                   "the weight it is tied to.*--head base",
                   "bert", "--source", source, "--output", output)



def test_a_tied_copy_stands_in_for_its_missing_original(tmp_path, source, capsys):
    """Some writers keep BERT's MLM bias only as the decoder's (`cls.predictions.decoder.bias`): transformers loads
    it as the head's bias, and so does the converter (the parity check confirms it)."""
    edit_tensors(source, lambda t: t.update({"cls.predictions.decoder.bias": t.pop("cls.predictions.bias")}))
    assert main(["bert", "--source", str(source), "--output", str(tmp_path / "out")]) == 0
    assert "OK: max |diff|" in capsys.readouterr().out

@pytest.mark.parametrize(
    ("model", "model_type"),
    [
        (lambda: GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)), "gpt2"),
        (lambda: DistilBertModel(DistilBertConfig(dim=16, n_layers=1, n_heads=2, hidden_dim=32, vocab_size=50)),
         "distilbert"),
    ],
)
def test_not_a_bert(tmp_path, capsys, model, model_type):
    model().save_pretrained(tmp_path / "source")
    output = tmp_path / "out"
    assert_refused(capsys, output, f"holds a '{model_type}' model, but the 'bert' converter reads 'bert'. "
                                   f"Pick the converter for '{model_type}'",
                   "bert", "--source", tmp_path / "source", "--output", output)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_weights(tmp_path, source, capsys, value):
    def poison(tensors):
        tensors["bert.encoder.layer.0.output.dense.weight"][3, 5] = value

    edit_tensors(source, poison)
    output = tmp_path / "out"
    assert_refused(capsys, output, r"NaN or Inf in 1 tensors: \['bert.encoder.layer.0.output.dense.weight'\]",
                   "bert", "--source", source, "--output", output)


class RunsCodeWhenUnpickled:
    """What a malicious pickle does: unpickling calls os.mkdir(path)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_pickle_with_code_refused_unopened(tmp_path, source, capsys):
    tensors = load_file(source / "model.safetensors")
    (source / "model.safetensors").unlink()
    evidence = tmp_path / "the-pickle-ran"
    torch.save(tensors | {"extra": RunsCodeWhenUnpickled(evidence)}, source / "pytorch_model.bin")
    output = tmp_path / "out"
    assert_refused(capsys, output, r"Refused to load .*pytorch_model.bin: it is a pickle holding more than tensors",
                   "bert", "--source", source, "--output", output)
    assert not evidence.exists()


def test_pickle_of_tensors_converts(tmp_path, source, capsys):
    tensors = load_file(source / "model.safetensors")
    (source / "model.safetensors").unlink()
    torch.save(tensors, source / "pytorch_model.bin")
    assert main(["bert", "--source", str(source), "--output", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_parity_failure_writes_nothing(tmp_path, source, capsys, monkeypatch):
    """The converter's own check catches a wrong conversion (here, one weight of ours replaced after mapping by a
    perturbed copy; the source tensors, which transformers' reference holds too, are left as they are)."""
    convert = EncoderFormat.to_vanilla

    def wrong(*args):
        model = convert(*args)
        down_proj = model.model.encoder.layers[1].ffn.down_proj
        down_proj.bias = torch.nn.Parameter(down_proj.bias.detach().clone())
        with torch.no_grad():
            down_proj.bias[0] += 1e-3
        return model

    monkeypatch.setattr(EncoderFormat, "to_vanilla", wrong)
    output = tmp_path / "out"
    printed = assert_refused(capsys, output, "Parity check failed: .*Nothing was written",
                             "bert", "--source", source, "--output", output)
    assert re.search(r"layer 1: max \|diff\| = \S+\n", printed.out)  # the first layer still matches
    assert re.search(r"layer 2: max \|diff\| = \S+  > tolerance", printed.out)  # the report points at layer 2



def test_mismapped_key_fails_verification(tmp_path, source, capsys, monkeypatch):
    """A key table that swaps BERT's query and key projections builds (their shapes agree): only the comparison with
    transformers' BERT, which places the same tensors by its own names, catches it."""
    swapped = {"encoder.layers.{i}.self_attn.q_proj": "encoder.layers.{i}.self_attn.k_proj",
               "encoder.layers.{i}.self_attn.k_proj": "encoder.layers.{i}.self_attn.q_proj"}
    table = tuple((bert, swapped.get(ours, ours)) for bert, ours in bert.ENCODER_TABLE)
    monkeypatch.setattr(bert, "FORMAT", replace(bert.FORMAT, encoder_table=table))
    output = tmp_path / "out"
    printed = assert_refused(capsys, output, "Parity check failed: .*Nothing was written",
                             "bert", "--source", source, "--output", output)
    assert re.search(r"layer 1: max \|diff\| = \S+  > tolerance", printed.out)


# ---- the tokenizer against the embeddings ----------------------------------------------------------------------------


def save_tokenizer(directory, size: int, added: int = 0) -> None:
    """A WordPiece tokenizer of `size` entries and `added` added tokens, saved next to the weights."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"tok{i}" for i in range(size - 5)]
    (directory / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = BertTokenizer.from_pretrained(directory)
    tokenizer.add_tokens([f"<new{i}>" for i in range(added)])
    tokenizer.save_pretrained(directory)


@pytest.mark.parametrize("converter", ["bert", "warm-start"])
def test_tokenizer_larger_than_embeddings_refused(tmp_path, source, capsys, converter):
    save_tokenizer(source, TINY["vocab_size"], added=3)
    output = tmp_path / "out"
    assert_refused(capsys, output, r"has 102 tokens \(added tokens included\) but the embeddings have 99 rows: ids 99 "
                                   r"to 101 would index past the table\. .*model\.resize_token_embeddings",
                   converter, "--source", source, "--output", output)


def test_tokenizer_smaller_than_embeddings_noted(tmp_path, source, capsys):
    save_tokenizer(source, 90)
    assert main(["bert", "--source", str(source), "--output", str(tmp_path / "out")]) == 0
    assert "Note: the tokenizer has 90 tokens for 99 embedding rows; the last 9 rows" in capsys.readouterr().out


@pytest.mark.parametrize("damaged", ["tokenizer.json", "tokenizer_config.json"])
def test_a_truncated_tokenizer_file_is_refused_naming_it(tmp_path, source, capsys, damaged):
    """A tokenizer JSON file cut short (a download that stopped) was copied into the output with only a note that
    the tokenizer could not be loaded: the converted model's tokenizer then failed too. Refused, naming the file."""
    save_tokenizer(source, TINY["vocab_size"])
    path = source / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    output = tmp_path / "out"
    assert_refused(capsys, output, rf"{re.escape(str(path))} is not valid JSON \(.*\): it is damaged, perhaps cut "
                                   rf"short .*Fetch it again .*or remove it from {re.escape(str(source))}",
                   "bert", "--source", source, "--output", output)


def test_real_tokenizer_matching_its_embeddings_converts_silently(tmp_path, minilm_path, capsys):
    assert main(["bert", "--source", str(minilm_path), "--output", str(tmp_path / "out"), "--no-verify"]) == 0
    assert "Note" not in capsys.readouterr().out  # all-MiniLM-L6-v2: 30522 tokens for 30522 rows


# ---- the output directory --------------------------------------------------------------------------------------------
# (what --force may replace, concurrent conversions and signals: tests/test_conversion_safety.py)


@pytest.fixture
def existing_output(tiny_bert_dir, tmp_path):
    """An earlier output of the converter: what --force may replace."""
    output = tmp_path / "out"
    assert main(["bert", "--source", str(tiny_bert_dir), "--output", str(output), "--no-verify"]) == 0
    return output


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_existing_output_refused_without_force(source, existing_output, capsys):
    before = snapshot(existing_output)
    assert_refused(capsys, existing_output, "already exists; pass --force to replace an earlier output",
                   "bert", "--source", source, "--output", existing_output)
    assert snapshot(existing_output) == before


def test_force_keeps_the_old_output_when_conversion_fails(source, existing_output, capsys):
    before = snapshot(existing_output)
    edit_tensors(source, lambda t: t.pop("cls.predictions.transform.dense.weight"))
    assert_refused(capsys, existing_output, "does not fit the target model",
                   "bert", "--source", source, "--output", existing_output, "--force")
    assert snapshot(existing_output) == before


def test_force_keeps_the_old_output_when_interrupted(source, existing_output, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    before = snapshot(existing_output)
    monkeypatch.setattr(flow, "save_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["bert", "--source", str(source), "--output", str(existing_output), "--force", "--no-verify"])
    assert snapshot(existing_output) == before
    assert leftovers(existing_output) == []


def test_force_replaces_after_success(source, existing_output, capsys):
    edit_config(source, id2label={"0": "old", "1": "new"})  # a visibly different conversion
    assert main(["bert", "--source", str(source), "--output", str(existing_output), "--force"]) == 0
    assert json.loads((existing_output / "config.json").read_text())["id2label"] == {"0": "old", "1": "new"}
    assert (existing_output / "model.safetensors").is_file() and (existing_output / "README.md").is_file()
    assert leftovers(existing_output) == []  # no staging and no retired copy left behind


# ---- the real command line -------------------------------------------------------------------------------------------


def test_cli_exit_status_and_stderr(tmp_path, source):
    edit_config(source, model_type="gpt2")
    result = subprocess.run(
        [sys.executable, "-m", "conversion", "bert", "--source", str(source), "--output", str(tmp_path / "out")],
        capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2
    assert "error: " in result.stderr and "holds a 'gpt2' model" in result.stderr
    assert "Traceback" not in result.stderr and "Wrote" not in result.stdout
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


def test_a_head_the_source_never_trained_names_the_way_out(source, tmp_path, capsys):
    """Asking for a task head the checkpoint does not have: the error says how to get one, and nothing is written."""
    assert main(["bert", "--source", str(source), "--output", str(tmp_path / "out"),
                 "--head", "sequence-classification"]) == 2
    err = capsys.readouterr().err
    assert "classifier.weight" in err and "--head base" in err and "fine-tune" in err
    assert not (tmp_path / "out").exists()


# ---- the saved dtype -------------------------------------------------------------------------------------------------
# Parity was checked in float32, before the weights were cast to --dtype: a float16 output holding Inf, or computing
# Inf, was written with a model card claiming a float32 difference. Now what is saved is checked: its weights
# finite, and its outputs, run in its dtype, within that dtype's rule of transformers' float32 outputs.


def tiny_bert2bert(directory):
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(**TINY), BertConfig(**TINY), decoder_start_token_id=1, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    EncoderDecoderModel(config=config).save_pretrained(directory)
    return directory


BERT_FFN = ("bert.encoder.layer.0.intermediate.dense.bias", "bert.encoder.layer.0.output.dense.weight")
FAIRSEQ_FFN = ("encoder.layers.0.fc1.bias", "encoder.layers.0.fc2.weight")
# One small source per way a conversion is verified: converter -> (make it in a folder, its first feed-forward
# block's up-projection bias and down-projection weight).
HALF_PRECISION_SOURCES = {
    "bert": (tiny_bert, BERT_FFN),
    "warm-start": (tiny_bert, BERT_FFN),
    "bert2bert": (tiny_bert2bert, tuple(key.replace("bert.", "encoder.", 1) for key in BERT_FFN)),
    "marian": (make_marian, tuple("model." + key for key in FAIRSEQ_FFN)),
    "bart": (partial(tiny_bart, class_name="BartModel"), FAIRSEQ_FFN),
}


@pytest.mark.parametrize("converter", ["marian", "bart", "bert2bert"])
@pytest.mark.parametrize(("content", "message"), [
    ("{not json", r"generation_config\.json is not valid JSON .*the generation config is damaged"),
    ("[1, 2]", r"generation_config\.json holds list, not the JSON object a generation config is"),
    ('{"max_new_tokens": -5, "decoder_start_token_id": 0}',
     r"generation_config\.json holds settings transformers refuses .*fix or delete"),
    ('{"num_beams": 2}', r"generation_config\.json sets neither decoder_start_token_id nor bos_token_id: .*Add"),
])
def test_a_damaged_generation_config(tmp_path, capsys, converter, content, message):
    """The encoder-decoder converters read the source's generation_config.json: damaged, it is a one-line error
    naming the file, not a traceback."""
    make = HALF_PRECISION_SOURCES[converter][0]
    source = make(tmp_path / "source")
    (source / "generation_config.json").write_text(content)
    assert_refused(capsys, tmp_path / "out", message, converter, "--source", source, "--output", tmp_path / "out",
                   *CONVERTERS.get(converter, []))


@pytest.mark.parametrize("converter", list(HALF_PRECISION_SOURCES))
def test_half_precision_is_verified_as_saved(tmp_path, capsys, converter):
    """Every converter that takes --dtype: a float16 conversion passes the check of what it saves (the rule is not too
    strict for half precision); one whose weights are finite in float16 but whose first feed-forward block computes
    past float16's range (65504), as float32 does not, is refused."""
    make, (up_bias, down_weight) = HALF_PRECISION_SOURCES[converter]
    source = make(tmp_path / "source")
    argv = [converter, "--source", source, "--dtype", "float16", *CONVERTERS.get(converter, [])]
    assert main([str(a) for a in [*argv, "--output", tmp_path / "good"]]) == 0, capsys.readouterr().err
    card = (tmp_path / "good" / "README.md").read_text()
    assert re.search(r"As saved \(float16\): .*\(fp16, .*tolerance 0\.01 x max\(1, \|", card), card
    assert {t.dtype for t in load_file(tmp_path / "good" / "model.safetensors").values()} == {torch.float16}

    def overflow(tensors):
        tensors[up_bias][0] = 6e4  # GELU/swish keep it: 6e4, finite in float16
        tensors[down_weight][:, 0] = 10.0  # 6e5 in every output: Inf in float16, and then NaN

    edit_tensors(source, overflow)
    output = tmp_path / "bad"
    printed = assert_refused(capsys, output, r"Parity check failed: .*\(fp16, .*Nothing was written",
                             *argv, "--output", output)
    assert "  OK: " in printed.out  # float32 parity held: the conversion is right, its float16 copy is not


def test_outputs_that_overflow_are_reported_as_nan_not_as_a_difference_of_zero(tmp_path, source, capsys):
    """A feed-forward block that computes past float32's (and bfloat16's) range gives Inf on both sides, whose
    difference is NaN: the refusal says nan where it said "max |diff| 0.0e+00" (Python's max(0.0, nan) is 0.0)."""
    def overflow(tensors):
        tensors[BERT_FFN[0]][0] = 3e38  # finite in float32 and bfloat16
        tensors[BERT_FFN[1]][:, 0] = 10.0  # 3e39 in every output: Inf, and NaN after the LayerNorm

    edit_tensors(source, overflow)
    output = tmp_path / "out"
    printed = assert_refused(capsys, output, r"Parity check failed: max \|diff\| against BertForMaskedLM: hidden "
                                             r"states \(every layer\) nan, logits nan \(",
                             "bert", "--source", source, "--output", output, "--dtype", "bfloat16")
    assert "0.0e+00" not in printed.err


def test_weights_that_overflow_the_saved_dtype_are_refused(tmp_path, source, capsys):
    """A bias of 1e6 is Inf in float16: refused whether or not parity is checked; bfloat16 keeps float32's range."""
    def poison(tensors):
        tensors["bert.encoder.layer.0.output.dense.bias"][0] = 1e6

    edit_tensors(source, poison)
    output = tmp_path / "out"
    for verify in ([], ["--no-verify"]):
        assert_refused(capsys, output, r"In float16 1 tensors would hold Inf or NaN \(values beyond its range, "
                                       r"±65504\): \['model.encoder.layers.0.ffn.down_proj.bias'\]\. Convert with "
                                       r"--dtype float32 or bfloat16",
                       "bert", "--source", source, "--output", output, "--dtype", "float16", *verify)
    assert main(["bert", "--source", str(source), "--output", str(output), "--dtype", "bfloat16", "--no-verify"]) == 0


def test_bfloat16_is_verified_as_saved(tiny_bert_dir, tmp_path, capsys):
    assert main(["bert", "--source", str(tiny_bert_dir), "--output", str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert re.search(r"As saved \(bfloat16\): .*\(bf16, .*tolerance 0\.05 x max\(1, \|output\|\)", card), card


# ---- a config.json whose layer count is not the weights' -------------------------------------------------------------
# A 2-layer BERT whose config.json said 10**6 layers ran for minutes (10**4: 37 s) and then listed every missing
# tensor: the key table and the model were built for the declared count before anything was compared. The count is
# now checked against the layers the weights hold first. (Marian's decoder has 3 layers.)


def tiny_distilbert(directory):
    torch.manual_seed(0)
    DistilBertModel(DistilBertConfig(dim=16, n_layers=2, n_heads=2, hidden_dim=32, vocab_size=50)).save_pretrained(
        directory)
    return directory


def set_field(directory, path, value, file="config.json"):
    """Set `path` (a field, or [section, field]) in `directory`'s `file`."""
    location = directory / file
    fields = json.loads(location.read_text())
    *sections, name = path
    target = fields
    for section in sections:
        target = target[section]
    target[name] = value
    location.write_text(json.dumps(fields))


# converter -> (make a source, the field (a path into config.json) that counts the layers of one stack, its layers)
LAYER_COUNTS = {
    "bert": (tiny_bert, ["num_hidden_layers"], 2),
    "distilbert": (tiny_distilbert, ["n_layers"], 2),
    "warm-start": (tiny_bert, ["num_hidden_layers"], 2),
    "bert2bert": (tiny_bert2bert, ["decoder", "num_hidden_layers"], 2),
    "marian": (make_marian, ["decoder_layers"], 3),
    "bart": (partial(tiny_bart, class_name="BartForConditionalGeneration"), ["encoder_layers"], 2),
    "bart decoder alone": (partial(tiny_bart, class_name="BartForCausalLM"), ["decoder_layers"], 2),
}


@pytest.mark.parametrize("declared", ["one more", "one fewer"])
@pytest.mark.parametrize("case", list(LAYER_COUNTS))
def test_a_layer_count_the_weights_do_not_hold_is_refused_naming_the_field(tmp_path, capsys, case, declared):
    make, field, held = LAYER_COUNTS[case]
    source = make(tmp_path / "source")
    value = held + 1 if declared == "one more" else held - 1
    set_field(source, field, value)
    converter = case.split()[0]
    output = tmp_path / "out"
    assert_refused(capsys, output, rf"source/config\.json sets {re.escape('.'.join(field))}={value}, but the weights "
                                   rf"hold {held} layers \(.*layers?\.0 to .*layers?\.{held - 1}\): set "
                                   rf"{re.escape('.'.join(field))} to {held} there",
                   converter, "--source", source, "--output", output, *CONVERTERS.get(converter, []))


@pytest.mark.parametrize("case", ["bert", "warm-start", "marian", "bert2bert"])
def test_an_inflated_layer_count_is_refused_before_any_layer_is_built(tmp_path, capsys, monkeypatch, case):
    """10**4 layers: what took 37 s to refuse (10**6 took minutes), now refused before a layer is built."""
    make, field, held = LAYER_COUNTS[case]
    source = make(tmp_path / "source")
    set_field(source, field, 10**4)

    def no_layer(*args, **kwargs):
        raise AssertionError("a layer was built for a layer count the weights do not hold")

    monkeypatch.setattr("hf_vanilla.transformer.VanillaEncoderLayer.__init__", no_layer)  # the decoder's too
    output = tmp_path / "out"
    assert_refused(capsys, output, rf"config\.json sets {re.escape('.'.join(field))}=10000, but the weights hold "
                                   rf"{held} layers", case, "--source", source, "--output", output,
                   *CONVERTERS.get(case, []))


@pytest.fixture(scope="module")
def vanilla_checkpoints(tmp_path_factory):
    """Vanilla checkpoints converted from the tiny sources: reverse converter -> (folder, layer field, layers)."""
    root = tmp_path_factory.mktemp("vanilla")
    checkpoints = {}
    for reverse, (forward, make, field, held) in {
        "to-bert": ("bert", tiny_bert, "num_hidden_layers", 2),
        "to-marian": ("marian", make_marian, "decoder_layers", 3),
        "to-bart": ("bart", partial(tiny_bart, class_name="BartForCausalLM"), "decoder_layers", 2),
    }.items():
        source = make(root / f"{forward}-source")
        assert main([forward, "--source", str(source), "--output", str(root / reverse), "--no-verify"]) == 0
        checkpoints[reverse] = (root / reverse, field, held)
    return checkpoints


@pytest.mark.parametrize("converter", ["to-bert", "to-marian", "to-bart", "onnx"])
def test_a_vanilla_checkpoint_whose_layer_count_is_not_its_weights_is_refused(tmp_path, capsys, vanilla_checkpoints,
                                                                             converter):
    folder, field, held = vanilla_checkpoints["to-bert" if converter == "onnx" else converter]
    source = shutil.copytree(folder, tmp_path / "source")
    set_field(source, [field], held + 1)
    output = tmp_path / "out"
    assert_refused(capsys, output, rf"source/config\.json sets {field}={held + 1}, but the weights hold {held} layers "
                                   rf"\(.*layers\.0 to .*layers\.{held - 1}\)",
                   converter, "--source", source, "--output", output)


# ---- generation settings generate() would fail on or misread ---------------------------------------------------------
# The encoder-decoder converters copy the source's generation_config.json whole. A token id outside the vocabulary
# ended in an IndexError reported as "a bug in the converter" (or, for pad and bos ids, was copied into the output);
# num_beams "four" or 0 was copied as it was.

GENERATION_SOURCES = {
    "marian": (make_marian, 320),
    "bart": (partial(tiny_bart, class_name="BartForConditionalGeneration"), 60),
    "bert2bert": (tiny_bert2bert, 99),
}
TOKEN_ID_FIELDS = ("decoder_start_token_id", "forced_eos_token_id", "forced_bos_token_id", "bos_token_id",
                   "eos_token_id", "pad_token_id")


@pytest.mark.parametrize("field", TOKEN_ID_FIELDS)
@pytest.mark.parametrize("converter", list(GENERATION_SOURCES))
def test_a_token_id_outside_the_vocabulary_in_generation_config_is_refused(tmp_path, capsys, converter, field):
    make, vocab_size = GENERATION_SOURCES[converter]
    source = make(tmp_path / "source")
    set_field(source, [field], vocab_size, file="generation_config.json")  # one past the last row
    output = tmp_path / "out"
    assert_refused(capsys, output, rf"source/generation_config\.json sets {field}={vocab_size}, but it must be a token "
                                   rf"id \(from 0 to {vocab_size - 1}: the vocabulary has {vocab_size} tokens\)",
                   converter, "--source", source, "--output", output)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_beams", "four", r"num_beams='four', but it must be a whole number from 1 up"),
    ("num_beams", 0, r"num_beams=0, but it must be a whole number from 1 up"),
    ("max_length", 0, r"max_length=0, but it must be a whole number from 1 up"),
    ("do_sample", "yes", r"do_sample='yes', but it must be true or false"),
    ("temperature", 2, r"temperature=2, but it must be a number above 0 written with a decimal point"),
    ("top_p", 1.5, r"top_p=1\.5, but it must be a number in \[0, 1\]"),
    ("eos_token_id", [], r"eos_token_id=\[\], but it must be a token id \(from 0 to 319.*\) or a list of such ids"),
    ("bad_words_ids", [[]], r"bad_words_ids=\[\[\]\], but it must be a list of token id sequences, each a non-empty"),
])
def test_a_generation_setting_generate_cannot_use_is_refused(tmp_path, capsys, field, value, message):
    source = make_marian(tmp_path / "source")
    set_field(source, [field], value, file="generation_config.json")
    output = tmp_path / "out"
    assert_refused(capsys, output, r"source/generation_config\.json sets " + message,
                   "marian", "--source", source, "--output", output)


def test_special_ids_outside_the_vocabulary_in_config_json_are_refused_without_a_generation_config(tmp_path, capsys):
    """Without a generation_config.json, the special ids are read from config.json: checked the same way."""
    source = tiny_bart(tmp_path / "source", "BartForConditionalGeneration")
    (source / "generation_config.json").unlink()
    set_field(source, ["decoder_start_token_id"], 60)
    output = tmp_path / "out"
    assert_refused(capsys, output, r"source/config\.json sets decoder_start_token_id=60, but it must be a token id "
                                   r"\(from 0 to 59: the vocabulary has 60 tokens\)",
                   "bart", "--source", source, "--output", output)


@pytest.mark.parametrize("converter", ["to-marian", "to-bart"])
def test_a_vanilla_checkpoint_with_a_bad_generation_config_is_refused(tmp_path, capsys, vanilla_checkpoints,
                                                                      converter):
    folder, _, _ = vanilla_checkpoints[converter]
    source = shutil.copytree(folder, tmp_path / "source")
    set_field(source, ["num_beams"], 0, file="generation_config.json")
    output = tmp_path / "out"
    assert_refused(capsys, output, r"source/generation_config\.json sets num_beams=0, but it must be a whole number "
                                   r"from 1 up", converter, "--source", source, "--output", output)
