"""ONNX export (`python -m conversion onnx`): an encoder head and the encoder-decoder, run on ONNX Runtime.

Small random models keep it quick (an export takes a few seconds on a 2-core CPU); the classifier and the
encoder-decoder are exported once per module and shared. What is checked:
- text-classification: the CLI writes the graph, config and tokenizer; the graph's inputs are named as the
  tokenizer names them, so tokenizer output feeds it directly; outputs match PyTorch on padded batches of shapes
  other than the traced one (batch 1 included); a graph that does not match the model is refused, leaving nothing.
- feature-extraction (pre-LN, sinusoids, no token types), fill-mask, token-classification, question-answering: the
  task follows `architectures`, and every graph output matches PyTorch at the real tokens of a padded batch.
- seq2seq: the encoder and decoder-step graphs have the documented signature, and the greedy loop of
  examples/onnx_greedy_decode.py on ONNX Runtime produces exactly `generate()`'s tokens, rows ending early included.
"""

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnxruntime  # noqa: E402
from numerics import assert_close  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import hf_vanilla  # noqa: E402, F401  (registers the Auto classes)
from hf_vanilla.conversion import onnx_export  # noqa: E402
from hf_vanilla.conversion.cli import main  # noqa: E402
from hf_vanilla import (  # noqa: E402
    VanillaEncoderConfig,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForQuestionAnswering,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TEXTS = ["A short one.", "ONNX Runtime runs the exported graph on padded batches of any shape, like this one.",
         "Third sentence, of medium length."]


def session(path: Path):
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def load_example():
    spec = importlib.util.spec_from_file_location("onnx_greedy_decode", ROOT / "examples" / "onnx_greedy_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- an encoder head: text-classification -----------------------------------------------------------------------


def make_encoder(directory: Path, minilm_path, seed: int, model_class=VanillaEncoderForSequenceClassification,
                 **overrides):
    """A small random `model_class` (a 3-label classifier unless told otherwise) with the bert-base-uncased
    vocabulary, saved in `directory`; larger weights so that outputs spread. Returns the model."""
    torch.manual_seed(seed)
    config = VanillaEncoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  initializer_range=0.3, **({"num_labels": 3} | overrides))
    model = model_class(config).eval()
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy2(Path(minilm_path) / name, directory / name)
    return model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_path):
    """(source checkpoint, ONNX directory, CLI exit status, CLI output), exported once through the CLI."""
    root = tmp_path_factory.mktemp("onnx_classifier")
    source = root / "vanilla"
    make_encoder(source, minilm_path, seed=0)
    output = root / "onnx"
    status = main(["onnx", "--source", str(source), "--output", str(output)])  # --task auto: text-classification
    return source, output, status


def test_classifier_export_writes_graph_config_and_tokenizer(classifier):
    source, output, status = classifier
    assert status == 0
    assert {p.name for p in output.iterdir()} >= {"model.onnx", "config.json", *TOKENIZER_FILES}
    graph = session(output / "model.onnx")
    assert [i.name for i in graph.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [o.name for o in graph.get_outputs()] == ["logits"]
    # batch and sequence are symbolic (dynamic) axes, named after the torch.export.Dim objects
    assert [i.shape for i in graph.get_inputs()] == [["batch", "sequence"]] * 3
    assert graph.get_outputs()[0].shape == ["batch", 3]
    assert not any(p.name.startswith(".") for p in output.parent.iterdir())  # no staging directory left behind


@pytest.mark.parametrize("texts", [TEXTS, TEXTS[1:2]], ids=["batch3", "batch1"])
def test_classifier_onnx_matches_pytorch_on_tokenizer_output(classifier, texts):
    source, output, _ = classifier
    tokenizer = AutoTokenizer.from_pretrained(output)  # the tokenizer written next to the graph
    encoded = dict(tokenizer(texts, ["and a second segment"] * len(texts), padding=True, return_tensors="np"))
    assert encoded["token_type_ids"].any() and (len(texts) == 1 or not encoded["attention_mask"].all())
    (logits,) = session(output / "model.onnx").run(None, encoded)  # tokenizer output as is: same names

    model = VanillaEncoderForSequenceClassification.from_pretrained(source).eval()
    with torch.no_grad():
        reference = model(**{k: torch.from_numpy(v) for k, v in encoded.items()}).logits
    assert logits.shape == tuple(reference.shape)
    assert reference.std() > 0.5  # the logits spread: a comparison of real answers, not of near-zeros
    assert_close(logits, reference)


def test_onnx_refuses_a_graph_that_does_not_match_the_model(classifier, tmp_path, minilm_path, monkeypatch, capsys):
    """The verification is real: a graph traced from other weights is caught by the parity rule (named in the error),
    exit status 2, nothing written."""
    _, exported, _ = classifier
    other = tmp_path / "other"
    make_encoder(other, minilm_path, seed=1)
    monkeypatch.setattr(onnx_export, "export_encoder",
                        lambda model, path, *args: shutil.copy2(exported / "model.onnx", path))
    output = tmp_path / "onnx"
    assert main(["onnx", "--source", str(other), "--output", str(output)]) == 2
    assert not output.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["other"]  # no partial output either
    error = capsys.readouterr().err
    assert "Parity check failed: ONNX Runtime against PyTorch" in error
    assert "tolerance 1e-05 x max(1, |output|)" in error  # the rule, named


def test_export_tasks_are_those_heads_py_declares():
    """Which class exports as which task is declared once (hf_vanilla/heads.py); the command's --task choices and
    the export's graph outputs cover exactly those tasks."""
    from hf_vanilla.conversion.cli import ONNX_TASKS
    from hf_vanilla.heads import export_tasks

    assert onnx_export.ARCHITECTURE_TASKS == export_tasks()
    assert set(ONNX_TASKS) == set(onnx_export.OUTPUTS) == set(export_tasks().values())


def test_onnx_refuses_existing_output_and_missing_head(classifier, tmp_path, capsys):
    source, exported, _ = classifier
    assert main(["onnx", "--source", str(source), "--output", str(exported)]) == 2
    assert "--force" in capsys.readouterr().err
    # transformers would load the sequence classifier's `classifier` into a token classifier without a word
    for task in ("token-classification", "fill-mask"):
        assert main(["onnx", "--source", str(source), "--output", str(tmp_path / "x"), "--task", task]) == 2
        assert f"no {task!r} head" in capsys.readouterr().err
    assert main(["onnx", "--source", str(source), "--output", str(tmp_path / "x"), "--task", "seq2seq"]) == 2
    assert not (tmp_path / "x").exists()


# ---- every other encoder task --------------------------------------------------------------------------------------

# task -> (model class, config overrides); feature extraction also covers pre-LN, sinusoids and no token types.
ENCODER_TASKS = {
    "feature-extraction": (VanillaEncoderModel, {"pre_norm": True, "position_embedding_type": "sinusoidal",
                                                 "type_vocab_size": 0}),
    "fill-mask": (VanillaEncoderForMaskedLM, {}),
    "token-classification": (VanillaEncoderForTokenClassification, {"num_labels": 5}),
    "question-answering": (VanillaEncoderForQuestionAnswering, {}),
}


@pytest.mark.parametrize("task", ENCODER_TASKS)
def test_every_encoder_task_matches_pytorch_at_real_tokens(task, tmp_path, minilm_path):
    """The task follows the checkpoint's `architectures`; each graph output equals PyTorch's at the real tokens of a
    padded tokenizer batch, within the float32 rule of tests/numerics.py (padding positions carry no meaning in
    either)."""
    model_class, overrides = ENCODER_TASKS[task]
    model = make_encoder(tmp_path / "vanilla", minilm_path, 0, model_class, **overrides)
    assert main(["onnx", "--source", str(tmp_path / "vanilla"), "--output", str(tmp_path / "onnx")]) == 0

    graph = session(tmp_path / "onnx" / "model.onnx")
    input_names = [i.name for i in graph.get_inputs()]
    assert input_names == ["input_ids", "attention_mask"] + (["token_type_ids"] if model.config.type_vocab_size else [])
    encoded = AutoTokenizer.from_pretrained(tmp_path / "onnx")(TEXTS, padding=True, return_tensors="np")
    inputs = {name: encoded[name] for name in input_names}
    real = inputs["attention_mask"].astype(bool)  # (B, T)
    assert not real.all()
    with torch.no_grad():
        reference = model(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    outputs = graph.run(None, inputs)
    assert [o.name for o in graph.get_outputs()] == list(onnx_export.OUTPUTS[task])
    for name, ours in zip(onnx_export.OUTPUTS[task], outputs, strict=True):
        expected = reference[name].numpy()
        assert ours.shape == expected.shape
        assert_close(ours[real], expected[real], msg=name)


# ---- the encoder-decoder ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory):
    """(model, ONNX directory), exported once.

    A random model with small weights and a tied output projection repeats one token forever (the residual stream
    mostly carries the input token's embedding). Wide weights, an untied projection and pre-LN make its greedy
    output vary with source and step, so that the comparison with generate() means something."""
    root = tmp_path_factory.mktemp("onnx_seq2seq")
    torch.manual_seed(0)
    config = VanillaSeq2SeqConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, decoder_layers=3, max_position_embeddings=64,
                                  initializer_range=0.5, tie_word_embeddings=False,
                                  share_encoder_decoder_embeddings=False, pre_norm=True)
    model = VanillaSeq2SeqForConditionalGeneration(config).eval()
    model.save_pretrained(root / "vanilla")
    assert main(["onnx", "--source", str(root / "vanilla"), "--output", str(root / "onnx")]) == 0
    return model, root / "onnx"


def test_seq2seq_graphs_have_the_documented_signature(seq2seq):
    model, output = seq2seq
    assert {p.name for p in output.iterdir()} >= {"encoder_model.onnx", "decoder_model.onnx", "config.json",
                                                   "generation_config.json"}
    encoder = session(output / "encoder_model.onnx")
    assert [(i.name, i.shape) for i in encoder.get_inputs()] == [("input_ids", ["batch", "sequence"]),
                                                                  ("attention_mask", ["batch", "sequence"])]
    assert [(o.name, o.shape) for o in encoder.get_outputs()] == [("last_hidden_state", ["batch", "sequence", 32])]
    decoder = session(output / "decoder_model.onnx")
    past = [f"past_key_values.{i}.{kind}" for i in range(3) for kind in ("key", "value")]
    assert [i.name for i in decoder.get_inputs()] == ["input_ids", "encoder_hidden_states",
                                                      "encoder_attention_mask", *past]
    assert [i.shape for i in decoder.get_inputs()[3:]] == [["batch", 4, "past_sequence", 8]] * 6
    assert [o.name for o in decoder.get_outputs()] == ["logits", *(p.replace("past_key_values", "present")
                                                                   for p in past)]
    assert decoder.get_outputs()[0].shape == ["batch", 1, 128]
    assert decoder.get_outputs()[1].shape == ["batch", 4, "past_sequence + 1", 8]


def test_onnx_greedy_loop_equals_generate(seq2seq):
    """Greedy decoding on ONNX Runtime (the example's loop) = generate(), token for token, on a padded batch where
    one row ends early (then gets padding) and the others run to max_new_tokens, and on a single sentence."""
    model, output = seq2seq
    example = load_example()
    encoder, decoder = example.load_sessions(output)
    inputs = onnx_export.sample_inputs(model.config, ["input_ids", "attention_mask"], batch_size=3, length=12, seed=3)
    pad, max_new = model.generation_config.pad_token_id, 12

    with torch.no_grad():
        free_run = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new)
    rows = free_run[:, 1:].tolist()
    assert all(len(set(row)) > 2 for row in rows)  # the tokens vary from step to step
    # Make the end token one that row 1 emits mid-way and the others never do: row 1 ends early, they run on.
    eos = next(t for t in rows[1][2:] if t not in rows[0] and t not in rows[2])
    with torch.no_grad():
        expected = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new, eos_token_id=eos)
    ended = int((expected[1] == eos).nonzero()[0])  # row 1 ends here; then padding to the batch's length
    assert ended < max_new and (expected[1, ended + 1:] == pad).all() and expected.shape[1] == 1 + max_new

    def onnx_decode(batch):
        return example.greedy_decode(encoder, decoder, {k: v.numpy() for k, v in batch.items()},
                                     decoder_start_token_id=model.config.decoder_start_token_id, eos_token_id=eos,
                                     pad_token_id=pad, max_new_tokens=max_new)

    np.testing.assert_array_equal(onnx_decode(inputs), expected.numpy())

    single = {k: v[2:, : int(inputs["attention_mask"][2].sum())] for k, v in inputs.items()}  # batch 1, no padding
    with torch.no_grad():
        expected_single = model.generate(**single, do_sample=False, num_beams=1, max_new_tokens=max_new,
                                         eos_token_id=eos)
    np.testing.assert_array_equal(onnx_decode(single), expected_single.numpy())


def test_greedy_decode_example_runs(seq2seq, tmp_path, capsys):
    """The example end to end on the exported model: exit status 0 means identical tokens."""
    model, output = seq2seq
    model.save_pretrained(tmp_path / "model")
    example = load_example()
    assert example.main(["--model", str(tmp_path / "model"), "--onnx", str(output), "--max-new-tokens", "8"]) == 0
    assert "identical" in capsys.readouterr().out
