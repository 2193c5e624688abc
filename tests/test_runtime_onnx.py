"""`hf_vanilla.runtime_onnx.use_onnx_runtime`: the encoder on ONNX Runtime behind the unchanged Hugging Face API.

Against transformers' own models on the same weights (small random BERTs with the real vocabulary, a tiny Marian):
- hidden states and the pooler (which runs in the graph) at real tokens within the tests/numerics.py rule, for
  right-padded batches (run as groups of
  similar length), left padding (run whole), a dense batch and one row; padding positions are zeros, as on
  PyTorch's packed path; and ONNX Runtime did run;
- a classifier head and the text-classification pipeline give transformers' answers;
- generate() with the encoder on ONNX Runtime gives transformers' tokens;
- what ONNX Runtime cannot answer runs in PyTorch, with PyTorch's results: hidden states asked for, autograd,
  weights changed after the export (with a warning naming the fix), a deep copy; bad input gets PyTorch's error;
- the cache: a second call reuses the graphs without exporting; other weights get their own graphs;
- of the plain and the BERT-optimized graph, the one measured faster here runs;
- the grouping of rows by length covers every row once, trimmed to each group's longest row.
"""

import copy
import warnings

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from hf_references import converted  # noqa: E402
from numerics import assert_close  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForSequenceClassification,
    BertModel,
    MarianConfig,
    MarianMTModel,
    pipeline,
)

import hf_vanilla  # noqa: E402, F401  (registers the Auto classes)
from hf_vanilla.conversion.marian import marian_to_vanilla  # noqa: E402
from hf_vanilla import runtime_onnx  # noqa: E402
from hf_vanilla.runtime_onnx import length_groups, remove_onnx_runtime, use_onnx_runtime  # noqa: E402


def padded_batch(lengths, left=False, seed=0, low=1000, vocab=30522):
    generator = torch.Generator().manual_seed(seed)
    T = max(lengths)
    positions = torch.arange(T)[None, :]
    lengths = torch.tensor(lengths)[:, None]
    mask = (positions >= T - lengths) if left else (positions < lengths)
    input_ids = torch.randint(low, vocab, (len(lengths), T), generator=generator).masked_fill(~mask, 0)
    return input_ids, mask.long()


class Calls:
    """Counts the ONNX Runtime session calls of every runtime-backed stack in a model."""

    def __init__(self, model):
        self.count = 0
        for module in model.modules():
            runner = module.__dict__.get("_onnx_runner")
            if runner is not None:
                run = runner._session_run
                runner._session_run = lambda feeds, run=run: self._count(run, feeds)

    def _count(self, run, feeds):
        self.count += 1
        return run(feeds)


@pytest.fixture(scope="module")
def base(tmp_path_factory, minilm_path):
    """(transformers BertModel, ours on ONNX Runtime, ours in PyTorch, cache directory)."""
    reference_dir, vanilla_dir = converted(tmp_path_factory, minilm_path, "base")
    cache = tmp_path_factory.mktemp("onnx-cache")
    reference = BertModel.from_pretrained(reference_dir).eval()
    eager = AutoModel.from_pretrained(vanilla_dir).eval()
    runtime = use_onnx_runtime(AutoModel.from_pretrained(vanilla_dir).eval(), cache_dir=cache)
    return reference, runtime, eager, cache


@pytest.mark.parametrize("lengths,left", [
    ([3, 17, 5, 40, 4, 9], False),  # right padding: groups of similar length, each trimmed
    ([3, 17, 5, 40], True),  # left padding: one call with the mask
    ([12, 12], False),  # dense
    ([7], False),  # one row
])
def test_hidden_states_match_transformers(base, lengths, left):
    reference, runtime, _, _ = base
    input_ids, mask = padded_batch(lengths, left)
    calls = Calls(runtime)
    with torch.inference_mode():
        expected = reference(input_ids=input_ids, attention_mask=mask)
        got = runtime(input_ids=input_ids, attention_mask=mask)
        as_tuple = runtime(input_ids=input_ids, attention_mask=mask, return_dict=False)
    real = mask.bool()
    assert calls.count >= 2 and len(as_tuple) == 2  # the pooler is in the graph: one engine call per request
    assert torch.equal(as_tuple[1], got.pooler_output)
    assert_close(got.last_hidden_state[real], expected.last_hidden_state[real])
    assert_close(got.pooler_output, expected.pooler_output)
    if not left:
        assert torch.all(got.last_hidden_state[~real] == 0)


def test_classifier_and_pipeline_match_transformers(tmp_path_factory, minilm_path, tmp_path, monkeypatch):
    """Reached as a user would: the Auto class's from_pretrained with runtime="onnxruntime"."""
    reference_dir, vanilla_dir = converted(tmp_path_factory, minilm_path, "sentiment")
    reference = BertForSequenceClassification.from_pretrained(reference_dir).eval()
    monkeypatch.setattr(runtime_onnx, "default_cache_dir", lambda: tmp_path)
    ours = AutoModelForSequenceClassification.from_pretrained(vanilla_dir, runtime="onnxruntime").eval()
    with pytest.raises(ValueError, match="Unknown runtime 'tensorrt'"):
        AutoModelForSequenceClassification.from_pretrained(vanilla_dir, runtime="tensorrt")
    tokenizer = AutoTokenizer.from_pretrained(vanilla_dir)
    texts = ["a quiet evening by the river", "no", "the results were nothing like what the paper promised at all"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    calls = Calls(ours)
    with torch.inference_mode():
        assert_close(ours(**batch).logits, reference(**batch).logits)
        expected = pipeline("text-classification", model=reference, tokenizer=tokenizer)(texts, top_k=None)
        got = pipeline("text-classification", model=ours, tokenizer=tokenizer)(texts, top_k=None)
    assert calls.count >= 2
    for want, have in zip(expected, got):
        assert [d["label"] for d in want] == [d["label"] for d in have]
        assert_close(torch.tensor([d["score"] for d in have]), torch.tensor([d["score"] for d in want]))


def test_generate_matches_transformers_with_encoder_on_onnx_runtime(tmp_path):
    pad, eos = 99, 0
    config = MarianConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=64, pad_token_id=pad, decoder_start_token_id=pad,
                          eos_token_id=eos, init_std=0.3)
    torch.manual_seed(0)
    reference = MarianMTModel(config).eval()
    ours = use_onnx_runtime(marian_to_vanilla(reference.state_dict(), config.to_dict()).eval(), cache_dir=tmp_path)
    input_ids, mask = padded_batch([9, 4, 13], low=2, vocab=pad)
    input_ids = input_ids.masked_fill(mask == 0, pad)
    calls = Calls(ours)
    settings = dict(max_new_tokens=12, num_beams=1, do_sample=False, decoder_start_token_id=pad, pad_token_id=pad,
                    eos_token_id=eos, forced_eos_token_id=eos)
    with torch.inference_mode():
        expected = reference.generate(input_ids=input_ids, attention_mask=mask, **settings)
        got = ours.generate(input_ids=input_ids, attention_mask=mask, **settings)
    assert calls.count >= 1
    assert torch.equal(got, expected)


@pytest.mark.parametrize("form", ["int32 ids", "bool mask", "float mask", "uint8 mask", "one row of segments",
                                  "no mask", "transposed ids"])
def test_every_input_form_pytorch_takes_runs_on_onnx_runtime(base, form):
    """The runtime reads its inputs in numpy and asks `check_inputs` only when that quick look refuses them: every
    form PyTorch's path accepts still runs on ONNX Runtime, with PyTorch's answer."""
    _, runtime, eager, _ = base
    input_ids, mask = padded_batch([9, 4, 13])
    kwargs = {"input_ids": input_ids, "attention_mask": mask}
    if form == "int32 ids":
        kwargs["input_ids"] = input_ids.int()
    elif form.endswith("mask") and form != "no mask":
        kwargs["attention_mask"] = mask.to({"bool": torch.bool, "float": torch.float32, "uint8": torch.uint8}[
            form.split()[0]])
    elif form == "one row of segments":
        kwargs["token_type_ids"] = (torch.arange(13) > 5).long()[None, :]
    elif form == "no mask":
        kwargs["attention_mask"] = mask = torch.ones_like(input_ids)
        del kwargs["attention_mask"]
    elif form == "transposed ids":
        kwargs["input_ids"] = input_ids.t().contiguous().t()
    calls = Calls(runtime)
    with torch.inference_mode():
        got = runtime(**kwargs).last_hidden_state
        expected = eager(**kwargs).last_hidden_state
    assert calls.count >= 1
    assert_close(got[mask.bool()], expected[mask.bool()])


def test_what_onnx_runtime_cannot_answer_runs_in_pytorch(base):
    reference, runtime, eager, _ = base
    input_ids, mask = padded_batch([5, 11])
    calls = Calls(runtime)
    with torch.inference_mode():
        hidden = runtime(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
        assert len(hidden) == runtime.config.num_hidden_layers + 1
        assert_close(runtime(inputs_embeds=runtime.get_input_embeddings()(input_ids), attention_mask=mask)
                     .last_hidden_state[mask.bool()],
                     eager(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()])
    out = runtime(input_ids=input_ids, attention_mask=mask)  # autograd on
    out.last_hidden_state.sum().backward()
    assert runtime.encoder.embeddings.word_embeddings.weight.grad is not None
    runtime.zero_grad(set_to_none=True)
    assert calls.count == 0
    with pytest.raises(ValueError, match="input_ids"):  # PyTorch's check and message: an id past the vocabulary
        with torch.inference_mode():
            runtime(input_ids=input_ids + runtime.config.vocab_size, attention_mask=mask)


def test_changed_weights_fall_back_with_a_warning_and_reexport(base):
    reference, _, eager, cache = base
    model = use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    input_ids, mask = padded_batch([6, 10])
    copied = copy.deepcopy(model)  # new parameters: the copy runs in PyTorch until use_onnx_runtime is called on it
    with torch.no_grad():
        model.encoder.layers[0].ffn.up_proj.weight.mul_(1.5)
    changed = remove_onnx_runtime(copy.deepcopy(model))  # the changed weights, in PyTorch
    calls = Calls(model)
    with torch.inference_mode():
        with pytest.warns(UserWarning, match="use_onnx_runtime"):
            got = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        expected = changed(input_ids=input_ids, attention_mask=mask).last_hidden_state
        assert calls.count == 0
        assert_close(got[mask.bool()], expected[mask.bool()])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, not on every call
            model(input_ids=input_ids, attention_mask=mask)
        graphs = set(cache.glob("*.onnx"))
        use_onnx_runtime(model, cache_dir=cache)  # the new weights get their own graphs (plain and fused)
        calls = Calls(model)
        assert_close(model(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()],
                     expected[mask.bool()])
        assert calls.count == 1 and len(set(cache.glob("*.onnx")) - graphs) == 2
        with pytest.warns(UserWarning, match="use_onnx_runtime"):
            copied(input_ids=input_ids, attention_mask=mask)


def test_cached_graph_is_reused_without_exporting(base, monkeypatch):
    _, runtime, _, cache = base
    before = sorted(cache.iterdir())

    def no_export(*args, **kwargs):
        raise AssertionError("exported again although the graph was cached")

    monkeypatch.setattr("hf_vanilla.conversion.onnx_export.export_encoder", no_export)  # what the runtime imports
    monkeypatch.setattr("onnxruntime.transformers.optimizer.optimize_model", no_export)
    use_onnx_runtime(runtime, cache_dir=cache)
    assert sorted(cache.iterdir()) == before  # nothing written, no temporary file left


def test_the_faster_graph_is_kept(base, monkeypatch):
    """fuse="auto" times the plain and the BERT-optimized graph against each other and keeps the faster: the one
    `_speedup` (t_plain / t_fused) says, measured for real here, then forced each way. Both answer alike."""
    _, _, eager, cache = base
    input_ids, mask = padded_batch([7, 12])
    with torch.inference_mode():
        expected = eager(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()]
    model = use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    runner = model._onnx_runner
    assert runner.fused_speedup > 0 and runner.graph == ("fused" if runner.fused_speedup > 1 else "plain")
    for speedup, graph in ((2.0, "fused"), (0.5, "plain")):
        monkeypatch.setattr(runtime_onnx, "_speedup", lambda plain, fused, feeds, speedup=speedup: speedup)
        use_onnx_runtime(model, cache_dir=cache)
        runner = model._onnx_runner
        assert runner.graph == graph and runner.path.name.endswith(f"-{graph}.onnx")
        calls = Calls(model)
        with torch.inference_mode():
            assert_close(model(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()], expected)
        assert calls.count == 1
    for fuse, graph in ((True, "fused"), (False, "plain")):  # no measurement
        monkeypatch.setattr(runtime_onnx, "_speedup", None)
        assert use_onnx_runtime(model, cache_dir=cache, fuse=fuse)._onnx_runner.graph == graph
    with pytest.raises(ValueError, match="fuse='yes'"):
        use_onnx_runtime(model, cache_dir=cache, fuse="yes")


def test_a_model_without_an_encoder_is_refused():
    with pytest.raises(ValueError, match="no vanilla encoder"):
        use_onnx_runtime(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("lengths", [[1], [5, 5, 5], [3, 500, 4, 7, 480, 6, 2], [16] * 3 + [300]])
def test_length_groups_cover_every_row_once(lengths):
    groups = length_groups(lengths)
    rows = sorted(r for group, _ in groups for r in group)
    assert rows == list(range(len(lengths)))
    for group, length in groups:
        assert length == max(lengths[r] for r in group)
    # Never worse than one call on the whole padded batch, by the cost it minimises.
    cost = sum(runtime_onnx.CALL_COST_TOKENS + len(g) * n for g, n in groups)
    assert cost <= runtime_onnx.CALL_COST_TOKENS + len(lengths) * max(lengths)
    if len(set(lengths)) == 1:
        assert len(groups) == 1
