"""`runtime="onnxruntime"` (hf_vanilla/runtimes/onnxruntime/): the encoder on ONNX Runtime behind the unchanged
Hugging Face API.

Against transformers' own models on the same weights (small random BERTs with the real vocabulary, a tiny Marian):
- hidden states and the pooler (which runs in the graph) at real tokens within the tests/numerics.py rule, for
  right-padded batches (run as groups of similar length), left padding (run whole), a dense batch and one row;
  padding positions are zeros, as on PyTorch's packed path; and ONNX Runtime did run;
- a classifier head and the text-classification pipeline give transformers' answers;
- generate() with the encoder on ONNX Runtime gives transformers' tokens;
- what ONNX Runtime cannot answer runs in PyTorch, with PyTorch's results: hidden states asked for, autograd, bad
  input (PyTorch's error);
- the weights the model holds are the ones computed with: after each of ten edits that once left
  the graph serving the old weights, and a forward hook inside the encoder, the answer is PyTorch's on the edited
  model; writes into the weights' memory and tensors replaced by others of the same shape still run on ONNX
  Runtime; changes of structure or config run PyTorch, with a warning naming the fix; a deep copy runs its own
  weights;
- the cache: a second attach reuses the graph without exporting; a truncated, emptied, replaced
  or forged entry is exported again; a directory in its place is left alone (the cache removes only files
  it can tell it wrote) and the graph runs from memory; the folder comes from `runtime_options`, then
  $HF_VANILLA_ONNX_CACHE; a cache that cannot be written gives one warning and still runs ONNX Runtime; leftovers
  of dead exports are removed, and nothing of the user's beside them;
- the registry: an unknown name or a missing extra is a one-line error (where the engines sit in the import graph:
  tests/test_architecture.py);
- the grouping of rows by length covers every row once, trimmed to each group's longest row.
"""

import copy
import hashlib
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
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
from hf_vanilla import runtime_registry  # noqa: E402
from hf_vanilla.conversion.formats.marian import marian_to_vanilla  # noqa: E402
from hf_vanilla.runtimes import batches, choice  # noqa: E402
from hf_vanilla.runtimes import cache as graph_cache  # noqa: E402
from hf_vanilla.runtimes.onnxruntime import engine  # noqa: E402
from hf_vanilla.runtimes.onnxruntime import (  # noqa: E402
    length_groups,
    remove_onnx_runtime,
    use_onnx_runtime,
)

PACKAGE = Path(hf_vanilla.__file__).parent


def padded_batch(lengths, left=False, seed=0, low=1000, vocab=30522):
    generator = torch.Generator().manual_seed(seed)
    T = max(lengths)
    positions = torch.arange(T)[None, :]
    lengths = torch.tensor(lengths)[:, None]
    mask = (positions >= T - lengths) if left else (positions < lengths)
    input_ids = torch.randint(low, vocab, (len(lengths), T), generator=generator).masked_fill(~mask, 0)
    return input_ids, mask.long()


def engines(model) -> list:
    return [vars(m)["forward"] for m in model.modules() if isinstance(vars(m).get("forward"), engine.OnnxEncoder)]


class Calls:
    """Counts the ONNX Runtime session calls of every encoder of a model that runs on the engine."""

    def __init__(self, model):
        self.count = 0
        for runner in engines(model):
            runner.session = _Counted(runner.session, self)


class _Counted:
    def __init__(self, session, calls):
        self.session, self.calls = session, calls

    def run(self, *args, **kwargs):
        self.calls.count += 1
        return self.session.run(*args, **kwargs)


_EXPORTED = {}


@pytest.fixture(autouse=True)
def engine_answers(monkeypatch):
    """Every call ONNX Runtime can answer goes to it: what these tests test is the engine. (By default a padded
    request size runs whichever of ONNX Runtime and PyTorch measured faster: tests/test_runtime_choice.py.)"""
    monkeypatch.setattr(choice, "CHOICE", "engine")


@pytest.fixture
def exports(monkeypatch):
    """The keys exported during a test. Each key is exported for real once per session (seconds each), then
    replayed: what is tested is when the cache asks for an export, not the exporter."""
    keys, export = [], engine.export_graph

    def replay(unit, inputs, outputs, key):
        keys.append(key)
        if key not in _EXPORTED:
            _EXPORTED[key] = export(unit, inputs, outputs, key)
        return _EXPORTED[key]

    monkeypatch.setattr(engine, "export_graph", replay)
    return keys


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
    """Reached as a user would: the Auto class's from_pretrained with runtime="onnxruntime", the graph cache in
    $HF_VANILLA_ONNX_CACHE."""
    reference_dir, vanilla_dir = converted(tmp_path_factory, minilm_path, "sentiment")
    reference = BertForSequenceClassification.from_pretrained(reference_dir).eval()
    monkeypatch.setenv(graph_cache.CACHE_ENV, str(tmp_path))
    ours = AutoModelForSequenceClassification.from_pretrained(vanilla_dir, runtime="onnxruntime").eval()
    assert len(list(tmp_path.glob("encoder-*.onnx"))) == 1
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
    """The engine reads its inputs in numpy: every form PyTorch's path accepts runs on ONNX Runtime, with PyTorch's
    answer."""
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
    for bad in (input_ids + runtime.config.vocab_size, input_ids - 2000):  # PyTorch's check and message
        with pytest.raises(ValueError, match="input_ids contains"), torch.inference_mode():
            runtime(input_ids=bad, attention_mask=mask)
    for bad in (mask * 2, mask.masked_fill(mask == 0, -1), mask * 0.5):
        with pytest.raises(ValueError, match="attention_mask must hold 1"), torch.inference_mode():
            runtime(input_ids=input_ids, attention_mask=bad)
    assert calls.count == 0


# ---- the weights the model holds -------------------------------------------------------------------------------------


class LowRank(torch.nn.Module):
    """What LoRA injects in place of a projection: the projection plus a low-rank update."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.down = torch.nn.Linear(base.in_features, 2, bias=False)
        self.up = torch.nn.Linear(2, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def scale_by_vector(model):
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vector * 1.5, model.parameters())


def assign_new_tensor(model):
    weight = model.encoder.layers[0].ffn.up_proj.weight
    weight.data = weight.data * 1.5


def through_numpy(model):
    view = model.encoder.layers[0].ffn.up_proj.weight.detach().numpy()
    view *= 1.5


# edit -> (what it does to the model, who answers after it: ONNX Runtime where only memory changed; PyTorch with a
# warning where the graph no longer matches the model; PyTorch, silently, while a hook inside must run)
EDITS = {
    "p.data.mul_": (lambda m: m.encoder.layers[0].ffn.up_proj.weight.data.mul_(1.5), "onnx"),
    "p.data = ...": (assign_new_tensor, "onnx"),
    "a numpy view": (through_numpy, "onnx"),
    "vector_to_parameters": (scale_by_vector, "onnx"),
    "half().float()": (lambda m: m.half().float(), "onnx"),
    "layers = layers[:1]": (lambda m: setattr(m.encoder, "layers", m.encoder.layers[:1]), "warned"),
    "del layers[1]": (lambda m: m.encoder.layers.__delitem__(1), "warned"),
    "LoRA replaces a Linear": (lambda m: setattr(m.encoder.layers[0].self_attn, "q_proj",
                                                 LowRank(m.encoder.layers[0].self_attn.q_proj)), "warned"),
    "another activation": (lambda m: setattr(m.encoder.layers[0].ffn, "act", torch.nn.ReLU()), "warned"),
    "config.position_offset": (lambda m: setattr(m.config, "position_offset", 2), "warned"),
    "a forward hook inside": (lambda m: m.encoder.layers[0].register_forward_hook(
        lambda module, inputs, output: (output[0] * 2, *output[1:])), "pytorch"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_model_gets_pytorchs_answer_on_the_edited_model(base, edit):
    """Each edit once left ONNX Runtime serving the old model (stale by 0.005-4.7 here). Edits of the weights'
    memory run on ONNX Runtime; the others run PyTorch, with a warning that names the fix where calling
    use_onnx_runtime again would trace the new model."""
    _, _, eager, cache = base
    model = use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    input_ids, mask = padded_batch([6, 10])
    with torch.inference_mode():
        before = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    change, answered_by = EDITS[edit]
    torch.manual_seed(0)
    with torch.no_grad():
        change(model)
    calls = Calls(model)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        model(input_ids=input_ids, attention_mask=mask)
        expected = remove_onnx_runtime(copy.deepcopy(model))(input_ids=input_ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert (before[real] - expected[real]).abs().max() > 100 * 1e-5 * expected.abs().max()  # visible, by far
    assert_close(got[real], expected[real])
    messages = [str(w.message) for w in caught]
    assert calls.count == (2 if answered_by == "onnx" else 0)
    assert len(messages) == (answered_by == "warned")
    assert all("use_onnx_runtime(model) again" in message for message in messages)


def test_a_call_on_onnx_runtime_checks_the_model_without_reading_its_modules(base, monkeypatch):
    """While nothing changes, a request ONNX Runtime answers compares none of the model's module dicts (only the
    weights' layout, which `.data =` changes unseen by any module: hf_vanilla/runtimes/watch.py); a weight's memory
    replaced is still fed at the next call."""
    from hf_vanilla.runtimes import watch

    _, _, eager, cache = base
    model = use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    input_ids, mask = padded_batch([6, 6])
    compared, everything = [], watch.Watch._unchanged_everywhere
    with torch.inference_mode():
        model(input_ids=input_ids, attention_mask=mask)  # warm: the check made once after the attach's own reads
        monkeypatch.setattr(watch.Watch, "_unchanged_everywhere", lambda self: compared.append(self) or everything(self))
        calls, before = Calls(model), watch.CHANGES
        for _ in range(3):
            model(input_ids=input_ids, attention_mask=mask)
        assert calls.count == 3 and watch.CHANGES == before and not compared
        weight = model.encoder.layers[0].ffn.up_proj.weight
        weight.data = weight.data * 1.5
        got = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        expected = remove_onnx_runtime(copy.deepcopy(model))(input_ids=input_ids, attention_mask=mask)
    assert calls.count == 4
    assert_close(got, expected.last_hidden_state)


def test_forward_hooks_inside_the_encoder_run_in_pytorch_while_they_are_set(base):
    _, _, eager, cache = base
    model, seen = copy.deepcopy(eager), []
    handle = model.encoder.layers[1].register_forward_hook(lambda module, inputs, output: seen.append(module))
    use_onnx_runtime(model, cache_dir=cache)
    input_ids, mask = padded_batch([6, 10])
    calls, ran = Calls(model), len(seen)
    with torch.inference_mode():
        model(input_ids=input_ids, attention_mask=mask)
        assert calls.count == 0 and len(seen) == ran + 1
        handle.remove()
        model(input_ids=input_ids, attention_mask=mask)
    assert calls.count == 1 and len(seen) == ran + 1


def test_a_changed_model_runs_on_onnx_runtime_again_once_retraced(base, exports):
    _, _, eager, cache = base
    model = use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    del model.encoder.layers[1]
    input_ids, mask = padded_batch([6, 10])
    with pytest.warns(UserWarning, match=r"encoder\.layers: children"), torch.inference_mode():
        model(input_ids=input_ids, attention_mask=mask)
    use_onnx_runtime(model, cache_dir=cache)
    calls = Calls(model)
    with torch.inference_mode():
        got = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        expected = remove_onnx_runtime(copy.deepcopy(model))(input_ids=input_ids, attention_mask=mask)
    assert calls.count == 1 and len(exports) == 1
    assert_close(got[mask.bool()], expected.last_hidden_state[mask.bool()])


def test_a_deep_copy_runs_its_own_weights(base):
    _, _, eager, cache = base
    model = use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.encoder.layers[1].self_attn.v_proj.weight.mul_(-1)
    input_ids, mask = padded_batch([6, 10])
    calls = Calls(copied), Calls(model)
    with torch.inference_mode():
        for ours in (copied, model):
            expected = remove_onnx_runtime(copy.deepcopy(ours))(input_ids=input_ids, attention_mask=mask)
            got = ours(input_ids=input_ids, attention_mask=mask)
            assert_close(got.last_hidden_state[mask.bool()], expected.last_hidden_state[mask.bool()])
            assert_close(got.pooler_output, expected.pooler_output)
    assert [c.count for c in calls] == [1, 1]


# ---- the graph cache -------------------------------------------------------------------------------------------------


def forged(graph: bytes, key: str, directory: Path) -> None:
    """`graph` rewritten to claim `key`, stored under the name its bytes' digest gives: it passes every file check."""
    model = onnx.load_from_string(graph)
    for prop in model.metadata_props:
        if prop.key == graph_cache.KEY_METADATA:
            prop.value = key
    data = model.SerializeToString()
    (directory / f"encoder-{key}-{hashlib.sha256(data).hexdigest()[:16]}.onnx").write_bytes(data)


def other_graph(eager, directory: Path, **config) -> bytes:
    """The graph of `eager` with `config` changed, exported into `directory`."""
    other = copy.deepcopy(eager)
    for name, value in config.items():
        setattr(other.config, name, value)
    del other.encoder.layers[other.config.num_hidden_layers:]
    use_onnx_runtime(other, cache_dir=directory)
    (path,) = directory.glob("encoder-*.onnx")
    return path.read_bytes()


def assert_answers_on_onnx_runtime(model, eager):
    """One call of `model` on a padded batch runs ONNX Runtime once and gives `eager`'s hidden states."""
    input_ids, mask = padded_batch([6, 10])
    calls = Calls(model)
    with torch.inference_mode():
        assert_close(model(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()],
                     eager(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()])
    assert calls.count == 1


@pytest.mark.parametrize("damage", ["truncated", "empty", "another model's graph",
                                    "another model's graph, with our key", "a forged graph of the same signature"])
def test_a_damaged_cache_entry_is_exported_again(base, tmp_path, exports, damage):
    _, _, eager, _ = base
    cache = tmp_path / "cache"
    use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    (entry,) = cache.glob("encoder-*.onnx")
    key = entry.name.split("-")[1]
    graph = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(graph[: len(graph) // 2])
    elif damage == "empty":
        entry.write_bytes(b"")
    else:
        # One layer fewer, or the same layers reading positions from 2 on: the same inputs and outputs.
        change = {"position_offset": 2} if damage.startswith("a forged") else {"num_hidden_layers": 1}
        other = other_graph(eager, tmp_path / "other", **change)
        if damage == "another model's graph":
            entry.write_bytes(other)
        else:
            entry.unlink()
            forged(other, key, cache)
    model = use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    assert exports.count(key) == 2  # once at first, once again to repair
    (repaired,) = cache.glob("encoder-*.onnx")
    assert repaired.read_bytes() == graph
    assert_answers_on_onnx_runtime(model, eager)


def test_a_directory_in_a_graphs_place_is_not_the_caches_to_remove(base, tmp_path, exports):
    """The cache writes regular files only: a folder under a graph's name is somebody else's. It stays, whole; the
    graph is exported again and runs from memory, with the one warning of a cache that cannot be written."""
    _, _, eager, _ = base
    cache = tmp_path / "cache"
    use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    (entry,) = cache.glob("encoder-*.onnx")
    entry.unlink()
    entry.mkdir()
    (entry / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match="cannot be written"):
        model = use_onnx_runtime(copy.deepcopy(eager), cache_dir=cache)
    assert (entry / "notes.txt").read_text() == "mine" and len(exports) == 2
    assert_answers_on_onnx_runtime(model, eager)


def test_cached_graph_is_reused_without_exporting(base, exports):
    _, runtime, _, cache = base
    before = sorted(cache.iterdir())
    use_onnx_runtime(runtime, cache_dir=cache)
    assert not exports and sorted(cache.iterdir()) == before  # nothing written, no temporary file left


def test_the_cache_folder_comes_from_the_call_then_the_environment(base, tmp_path, monkeypatch, exports):
    _, _, eager, _ = base
    monkeypatch.setenv(graph_cache.CACHE_ENV, str(tmp_path / "from-env"))
    use_onnx_runtime(copy.deepcopy(eager))
    use_onnx_runtime(copy.deepcopy(eager), cache_dir=tmp_path / "given")
    assert [len(list((tmp_path / name).glob("encoder-*.onnx"))) for name in ("from-env", "given")] == [1, 1]


@pytest.mark.parametrize("where", ["cache_dir", "home"])
def test_a_cache_that_cannot_be_written_warns_once_and_still_runs(base, tmp_path, monkeypatch, exports, where,
                                                                 minilm_path, tmp_path_factory):
    """A folder below a file cannot be made, even by root (which a read-only mode would not stop)."""
    _, _, eager, _ = base
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    if where == "cache_dir":
        model = copy.deepcopy(eager)
        with pytest.warns(UserWarning) as caught:
            use_onnx_runtime(model, cache_dir=blocked / "cache")
    else:  # from_pretrained with no cache_dir, no environment variable, and a home folder it cannot write in
        for name in (graph_cache.CACHE_ENV, "XDG_CACHE_HOME"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HOME", str(blocked))
        with pytest.warns(UserWarning) as caught:
            model = AutoModel.from_pretrained(converted(tmp_path_factory, minilm_path, "base")[1],
                                              runtime="onnxruntime")
    messages = [str(w.message) for w in caught if "cache" in str(w.message)]
    assert len(messages) == 1 and "cannot be written" in messages[0] and graph_cache.CACHE_ENV in messages[0]
    assert "\n" not in messages[0]
    assert_answers_on_onnx_runtime(model, eager)


def test_leftovers_of_dead_exports_are_removed_and_nothing_else(base, tmp_path, exports):
    """Only the cache's own staging files (`.export-<host>-<pid>-<8 hex>.onnx`, regular files) of dead processes go;
    a user's files and folders whose names merely start with `.export-`, however old, stay (a
    user's `.export-notes.txt` and `.export-photos/` were removed)."""
    _, _, eager, _ = base
    host = socket.gethostname()
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    old = time.time() - 2 * graph_cache.STALE_SECONDS
    entries = {
        f".export-{host}-{finished.pid}-0123abcd.onnx": False,  # its process is gone
        f".export-{host}-{os.getpid()}-0123abcd.onnx": True,  # a live process's write
        ".export-otherhost-12-0123abcd.onnx": False,  # another host's, two days old
        ".export-notes.txt": True,  # the user's, two days old
        ".export-photos": True,  # the user's folder, two days old
        f".export-{host}-{finished.pid}-0123abcd.onnx.keep": True,  # not a name the cache writes
        ".export-k3j4h5g6": True,  # a folder: the cache writes none
    }
    for name in entries:
        path = tmp_path / name
        if "." in name[1:]:
            path.write_bytes(b"partial")
        else:
            path.mkdir()
            (path / "model.onnx").write_bytes(b"partial")
        os.utime(path, (old, old))
    os.utime(tmp_path / f".export-{host}-{os.getpid()}-0123abcd.onnx")  # being written now
    use_onnx_runtime(copy.deepcopy(eager), cache_dir=tmp_path)
    assert {name for name in entries if (tmp_path / name).exists()} == {n for n, kept in entries.items() if kept}
    assert (tmp_path / ".export-photos" / "model.onnx").exists()


def test_export_prints_nothing(base, tmp_path, capfd):
    """The BERT optimizer of onnxruntime.transformers printed `failed in shape inference <class 'TypeError'>` (its
    symbolic shape inference cannot follow the attention mask's ops) and fused nothing ONNX Runtime's own session
    optimizer does not: it is no longer run."""
    _, _, eager, _ = base
    use_onnx_runtime(copy.deepcopy(eager), cache_dir=tmp_path)
    captured = capfd.readouterr()
    assert captured.out == "" and "shape inference" not in captured.err


# ---- the registry, and where the engines sit -------------------------------------------------------------------


def test_registry_errors_are_one_line(tmp_path_factory, minilm_path, monkeypatch, tmp_path):
    _, vanilla_dir = converted(tmp_path_factory, minilm_path, "base")
    with pytest.raises(ValueError, match=r"Unknown runtime 'tensorrt': pass one of \['auto', 'onnxruntime', 'openvino'\]"):
        AutoModel.from_pretrained(vanilla_dir, runtime="tensorrt")
    monkeypatch.setattr(runtime_registry, "_RUNTIMES", dict(runtime_registry._RUNTIMES))
    (tmp_path / "engine_with_extra.py").write_text("import onnxruntime_absent\n")  # an engine, its extra missing
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "onnxruntime_absent", None)  # its import raises ModuleNotFoundError
    runtime_registry.register_runtime("needs-an-extra", "engine_with_extra:apply", install="pip install x")
    # What a checkpoint's own copy of the registry meets where hf_vanilla is not installed:
    runtime_registry.register_runtime("not-installed", "hf_vanilla.runtimes.absent:apply", install="pip install y")
    model = AutoModel.from_pretrained(vanilla_dir)
    for name, message in (("needs-an-extra", "needs onnxruntime_absent, which is not installed: pip install x."),
                          ("not-installed", "comes with the hf_vanilla package, which is not installed here: "
                                            "pip install y.")):
        with pytest.raises(ImportError) as caught:
            runtime_registry.apply_runtime(model, name)
        assert str(caught.value) == f"runtime={name!r} {message}"


@pytest.mark.parametrize("lengths", [[1], [5, 5, 5], [3, 500, 4, 7, 480, 6, 2], [16] * 3 + [300]])
def test_length_groups_cover_every_row_once(lengths):
    groups = length_groups(lengths)
    rows = sorted(r for group, _ in groups for r in group)
    assert rows == list(range(len(lengths)))
    for group, length in groups:
        assert length == max(lengths[r] for r in group)
    # Never worse than one call on the whole padded batch, by the cost it minimises.
    cost = sum(batches.CALL_COST_TOKENS + len(g) * n for g, n in groups)
    assert cost <= batches.CALL_COST_TOKENS + len(lengths) * max(lengths)
    if len(set(lengths)) == 1:
        assert len(groups) == 1


def test_a_model_without_an_encoder_is_refused():
    with pytest.raises(ValueError, match="no vanilla encoder"):
        use_onnx_runtime(torch.nn.Linear(2, 2))
