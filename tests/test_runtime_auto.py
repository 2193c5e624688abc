"""`runtime="auto"` (hf_vanilla/runtimes/auto.py): the path measured fastest here, on a scripted clock.

- the path whose scripted calls are fastest is the one attached, whichever it is, and the model answers within the
  float32 rule of plain PyTorch; the per-size decisions of the measured requests are kept on its engine;
- the decision is kept in a file under the graph cache folder and a second load measures nothing; another CPU (flags
  scripted), another version, another thread count or dtype measures again, and at "fastest" other weights too; a
  damaged or foreign file, a named pipe, a folder or a huge file in its place is ignored with a warning and measured
  again, never trusted, never blocking; so is a kept path that refuses the model;
- a decision within the noise is measured again once, then settled (the path with fewer restrictions where the two
  disagree); `auto_choice` says the margin;
- paths whose packages are missing are not candidates; bf16 only where the CPU multiplies it natively; int8 and bf16
  only with `precision="fastest"` and at the accuracy floor or above, on the sample's text, not on made-up ids (the
  real-weights case: tests/test_precision.py);
- `from_pretrained(path, runtime="auto")`; bad options refused with a one-line error; a bf16 model refused naming
  the fix.
"""

import copy
import itertools
import json
import os
import pickle
import signal

import pytest
import torch
from numerics import assert_close

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderModel,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqModel,
)
from hf_vanilla.conversion.parity import tolerance
from hf_vanilla.runtime_registry import apply_runtime
from hf_vanilla.runtimes.choice import key_of, runtime_choices

pytest.importorskip("onnxruntime", reason="runtime='auto' chooses among engines: pip install -e '.[onnx]'")
from hf_vanilla.runtimes import auto, decision  # noqa: E402
from hf_vanilla.runtimes.accuracy import sample_batches  # noqa: E402

SATURATED = auto.saturated  # the autouse fixture below scripts it

CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, num_labels=3)
ENGINES = {"pytorch": None, "onnxruntime": "OnnxEncoder", "onnxruntime owned": "OwnedOnnxEncoder",
           "openvino": "OpenVinoEncoder"}


@pytest.fixture(autouse=True)
def one_round(monkeypatch):
    """One timed call per path and request: the clock is scripted, so one is the measurement (and the suite stays
    fast)."""
    monkeypatch.setattr(auto, "ROUNDS", 1)
    monkeypatch.setattr(auto, "BLOCK", 1)
    monkeypatch.setattr(auto, "QUERIES", 1)
    monkeypatch.setattr(auto, "BUDGET_S", 0.0)
    monkeypatch.setattr(auto, "saturated", lambda: None)  # the machine running the tests may be busy


@pytest.fixture(scope="module")
def shared_graphs(tmp_path_factory):
    return tmp_path_factory.mktemp("graphs")


@pytest.fixture
def graphs(shared_graphs):
    """One graph folder for the module (each graph exported once), without the decisions of other tests."""
    for kept in shared_graphs.glob("auto-*.json"):
        kept.rmdir() if kept.is_dir() else kept.unlink()
    return shared_graphs


def use_auto(model, **options):
    """runtime="auto" put on `model` as from_pretrained puts it: through the registry."""
    return apply_runtime(model, "auto", **options)


def model_of(cls=VanillaEncoderModel, seed=0):
    torch.manual_seed(seed)
    return cls(VanillaEncoderConfig(**CONFIG)).eval()


def scripted(monkeypatch, clock, costs, calls=None):
    """Each path's call costs `costs[path]` seconds (or `costs[path][request]`, the large batch as the padded one
    where not named; 1 s where not named; a list: its seconds in turn, call after call) on the scripted clock;
    `calls` (a list) records (path, request) of every call."""
    original = auto.runner

    def runner(model, path, inputs):
        request = {1: "short", len(decision.PADDED): "padded"}.get(inputs["input_ids"].shape[0], "large")
        cost = costs.get(path.name, 1.0)
        cost = cost.get(request, cost.get("padded")) if isinstance(cost, dict) else cost
        turns = itertools.cycle(cost if isinstance(cost, list) else [cost])
        call = original(model, path, inputs)

        def run():
            clock.advance(next(turns))
            if calls is not None:
                calls.append((path.name, request))
            return call()
        return run
    monkeypatch.setattr(auto, "runner", runner)


def engine_of(model):
    return type(vars(model.base_model).get("forward")).__name__ if "forward" in vars(model.base_model) else None


def batch():
    ids = torch.tensor([[5, 8, 13, 21, 34, 55, 89, 3, 7, 9, 11], [4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def sample_of(*rows):
    """A tokenized sample of the tiny model's ids: one batch, rows right-padded with 0."""
    lengths = torch.tensor([len(row) for row in rows])
    ids = torch.tensor([list(row) + [0] * (int(lengths.max()) - len(row)) for row in rows])
    return {"input_ids": ids, "attention_mask": (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()}


PLAIN = sample_of(range(10, 40), range(46, 60), range(60, 90, 2))  # no 45
OUTLIER = 45  # an id the scripted int8 path answers badly


def wrong_at(monkeypatch, name, token):
    """`name`'s answers turned away from the true ones at every `token` (the scripted loss of a reduced path on one
    kind of token, as an outlier channel loses on real text's frequent tokens)."""
    original = auto.runner

    def runner(model, path, inputs):
        call = original(model, path, inputs)
        if path.name != name:
            return call

        def run():
            hidden = call().clone()
            hidden[inputs["input_ids"] == token] *= -1
            return hidden
        return run
    monkeypatch.setattr(auto, "runner", runner)


def answers_as_pytorch(model, plain):
    inputs = batch()
    real = inputs["attention_mask"].bool()
    with torch.inference_mode():
        for rows in (slice(0, 1), slice(0, 2)):
            got = model(**{k: v[rows] for k, v in inputs.items()}).last_hidden_state
            want = plain(**{k: v[rows] for k, v in inputs.items()}).last_hidden_state
            assert_close(got[real[rows]], want[real[rows]])


@pytest.mark.parametrize("winner", list(ENGINES))
def test_the_path_the_clock_favours_is_attached(winner, graphs, scripted_clock, monkeypatch):
    """Every path but one scripted at 300 ms a call, that one at 100 ms: it is the one the model runs on, its
    timings are inspectable, and the model answers within the float32 rule of plain PyTorch."""
    if winner == "openvino":
        pytest.importorskip("openvino")
    scripted(monkeypatch, scripted_clock, {name: 0.1 if name == winner else 0.3 for name in ENGINES})
    model, plain = model_of(), model_of()
    assert use_auto(model, cache_dir=graphs) is model
    chosen = auto.auto_choice(model)
    assert chosen.runtime == winner and not chosen.cached
    assert engine_of(model) == ENGINES[winner]
    assert chosen.times_ms[winner] == pytest.approx({"short": 100.0, "padded": 100.0, "large": 100.0})
    assert set(chosen.times_ms) == {name for name in ENGINES if name not in chosen.left_out}
    answers_as_pytorch(model, plain)


def test_each_measured_size_keeps_its_engine_or_pytorch(graphs, scripted_clock, monkeypatch):
    """ONNX Runtime scripted faster than PyTorch on the short request and the large batch and slower on the padded
    one: chosen (its geometric mean, with PyTorch answering the padded size, is the least), and the three sizes'
    decisions are kept on the engine, as its per-size choice would have made them."""
    scripted(monkeypatch, scripted_clock, {"onnxruntime": {"short": 0.1, "padded": 0.5, "large": 0.1},
                                           "pytorch": {"short": 0.3, "padded": 0.2, "large": 0.3}})
    model = use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "onnxruntime"
    assert auto.auto_choice(model).times_ms["onnxruntime"] == pytest.approx({"short": 100.0, "padded": 200.0,
                                                                             "large": 100.0})
    large = int(auto.requests(model.config)["large"]["attention_mask"].sum())
    short, padded, large = key_of(1, 16), key_of(4, 32 + 24 + 16 + 8), key_of(8, large)
    assert runtime_choices(model) == {short: True, padded: False, large: True}


def test_queries_are_timed_after_an_idle_moment_and_by_their_median(graphs, scripted_clock, monkeypatch):
    """Each timed short query follows IDLE_S of idle; and a path whose queries are fast one time in three and slow
    otherwise (ONNX Runtime's short calls are bimodal on the VMs measured) loses to a steady one between the two: the
    median of its calls decides, not its best."""
    monkeypatch.setattr(auto, "ROUNDS", 2)
    monkeypatch.setattr(auto, "QUERIES", 3)
    events = []
    monkeypatch.setattr(auto.measure, "sleep", lambda seconds: (events.append(("idle", seconds)),
                                                                scripted_clock.advance(seconds)))
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned": {"short": [0.05, 0.3, 0.3], "padded": 0.1},
                                           "onnxruntime": {"short": 0.1, "padded": 0.1}}, events)
    model = use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "onnxruntime"
    assert auto.auto_choice(model).engine_ms["onnxruntime owned"]["short"] == pytest.approx(300.0)
    timed = events[events.index(("idle", auto.IDLE_S)):]  # the untimed first calls of each path come before
    queries = [i for i, event in enumerate(timed) if event[1] == "short"]
    assert len(queries) == 2 * 3 * len(auto.auto_choice(model).times_ms)  # rounds x queries x paths measured
    assert all(timed[i - 1] == ("idle", auto.IDLE_S) for i in queries)


def test_a_tie_goes_to_the_path_with_fewer_restrictions(graphs, scripted_clock, monkeypatch):
    """Within 2% of each other at every request, PyTorch is kept over an engine holding the weights."""
    scripted(monkeypatch, scripted_clock, {"pytorch": 0.101, "onnxruntime owned": 0.1})
    model = use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "pytorch" and engine_of(model) is None


def test_a_tie_is_within_the_rule_at_every_request_not_in_the_mean(graphs, scripted_clock, monkeypatch):
    """ONNX Runtime holding the weights 5% slower than OpenVINO at the short query and level with it at the batches
    (1.6% over the three requests): OpenVINO, not a tie."""
    pytest.importorskip("openvino")
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned": {"short": 0.105, "padded": 0.1},
                                           "openvino": {"short": 0.1, "padded": 0.1}})
    model = use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "openvino"


def test_the_large_batch_is_answered_by_each_engine_itself(graphs, scripted_clock, monkeypatch):
    """The third request is a dense batch, which every engine path answers with its engine, so the engines' order
    at scale is seen even where PyTorch leads both at the padded batches (padding-free): ONNX Runtime holding the
    weights 3% ahead of OpenVINO at the short query, PyTorch ahead of both at the batches, OpenVINO 10% ahead of
    ONNX Runtime at 8x128: OpenVINO (padded, PyTorch would have answered that batch for both, and the short query
    alone would have chosen)."""
    pytest.importorskip("openvino")
    assert bool(auto.requests(model_of().config)["large"]["attention_mask"].all())
    scripted(monkeypatch, scripted_clock, {"pytorch": {"short": 0.3, "padded": 0.1, "large": 0.1},
                                           "onnxruntime owned": {"short": 0.1, "padded": 0.2, "large": 0.22},
                                           "openvino": {"short": 0.103, "padded": 0.2, "large": 0.2}})
    model = use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "openvino"


def test_the_decision_is_kept_and_measured_again_where_it_does_not_apply(graphs, scripted_clock, monkeypatch):
    """The second load reads the kept decision and times nothing; another CPU's flags, another version of a
    library or another thread count is another key, and measures again."""
    calls = []
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned": 0.001}, calls)
    first = use_auto(model_of(VanillaEncoderForSequenceClassification), cache_dir=graphs)
    kept = sorted(graphs.glob("auto-*.json"))
    assert len(kept) == 1 and calls and auto.auto_choice(first).file == str(kept[0])
    calls.clear()
    second = use_auto(model_of(VanillaEncoderForSequenceClassification, seed=1), cache_dir=graphs)
    assert calls == [] and auto.auto_choice(second).cached
    assert auto.auto_choice(second).runtime == "onnxruntime owned" == auto.auto_choice(first).runtime
    assert engine_of(second) == "OwnedOnnxEncoder"
    answers_as_pytorch(second.base_model, model_of(VanillaEncoderForSequenceClassification, seed=1).base_model)

    paths = auto._candidates("f32")[0]
    keys = {decision.decision_key(second, "f32", 2, paths)}
    flags = decision.cpu_flags()
    monkeypatch.setattr(decision, "cpu_flags", lambda: flags ^ {"avx512_vnni"})  # another CPU
    keys.add(decision.decision_key(second, "f32", 2, paths))
    calls.clear()
    again = use_auto(model_of(VanillaEncoderForSequenceClassification), cache_dir=graphs)
    assert calls and not auto.auto_choice(again).cached and len(list(graphs.glob("auto-*.json"))) == 2
    found = decision.versions()
    monkeypatch.setattr(decision, "versions", lambda: dict(found, openvino="0.0.1"))
    keys.add(decision.decision_key(second, "f32", 2, paths))
    keys.add(decision.decision_key(second, "f32", 3, paths))
    keys.add(decision.decision_key(second, "fastest", 3, paths))
    assert len(keys) == 5


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"format": 1}', "wrong path", "foreign key"])
def test_a_damaged_decision_is_ignored_with_a_warning(damage, graphs, scripted_clock, monkeypatch):
    """A kept decision that is empty, not JSON, incomplete, names a path that is not a candidate, or was written for
    another key is never trusted: a warning, a new measurement, a rewritten file."""
    model = model_of()
    kept = decision.decision_file(model, "f32", torch.get_num_threads(), auto._candidates("f32")[0], graphs)
    record = kept_record("onnxruntime")
    if damage == "wrong path":
        damage = json.dumps({"format": decision.FORMAT, "key": kept.stem[5:],
                             "choice": dict(record, runtime="../../etc/passwd")}).encode()
    elif damage == "foreign key":
        damage = json.dumps({"format": decision.FORMAT, "key": "0" * 32, "choice": record}).encode()
    kept.write_bytes(damage)
    calls = []
    scripted(monkeypatch, scripted_clock, {"onnxruntime": 0.001}, calls)
    with pytest.warns(UserWarning, match=r"ignored the kept decision .*auto-.*\.json.*measuring again"):
        use_auto(model, cache_dir=graphs)
    assert calls and auto.auto_choice(model).runtime == "onnxruntime"
    assert json.loads(kept.read_text())["choice"]["runtime"] == "onnxruntime"
    assert decision.read_decision(kept, auto._candidates("f32")[0])["runtime"] == "onnxruntime"


def kept_record(runtime: str) -> dict:
    """The fields of a kept decision naming `runtime`, as use_auto writes them."""
    return {"runtime": runtime, "precision": "f32", "times_ms": {}, "engine_ms": {}, "accuracy": {}, "sample": "",
            "left_out": {}, "measured_s": 1.0, "cpu": {}, "margin": 2.0, "settled": True, "split": None}


def within(seconds: float):
    """Run the block, failing it (not the whole run) where it takes longer than `seconds`: a read that blocks."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    class Limit:
        def __enter__(self):
            self.previous = signal.signal(signal.SIGALRM, expired)
            signal.alarm(seconds)

        def __exit__(self, *exc):
            signal.alarm(0)
            signal.signal(signal.SIGALRM, self.previous)
    return Limit()


@pytest.mark.parametrize("kind, says", [
    ("nested brackets", r"RecursionError"),
    ("oversized", r"OSError: .*bytes"),
    ("named pipe", r"OSError: a named pipe, not a regular file"),
    ("folder", r"OSError: a folder, not a regular file"),
    ("not utf-8", r"UnicodeDecodeError"),
])
def test_a_decision_file_of_another_kind_is_ignored_never_hanging(kind, says, graphs, scripted_clock, monkeypatch):
    """100,000 nested brackets (which json cannot parse without recursing too deep), a file larger than a decision
    is, a named pipe (whose read would wait for a writer forever: it is not opened), a folder, bytes that are not
    text, in the decision's place: each ignored with a warning saying what it is, and measured again; the model
    answers as plain PyTorch. The pipe and the bytes are replaced by the new decision; a folder is left, and the
    decision kept by this process only."""
    model, plain = model_of(), model_of()
    kept = decision.decision_file(model, "f32", torch.get_num_threads(), auto._candidates("f32")[0], graphs)
    if kind == "nested brackets":
        kept.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "oversized":
        kept.write_bytes(b" " * (decision.MAX_DECISION_BYTES + 1))
    elif kind == "named pipe":
        os.mkfifo(kept)
    elif kind == "folder":
        kept.mkdir()
    else:
        kept.write_bytes(b"\xff\xfe\xfd")
    calls = []
    scripted(monkeypatch, scripted_clock, {"onnxruntime": 0.001}, calls)
    with within(120), pytest.warns(UserWarning, match=rf"ignored the kept decision .*\({says}.*measuring again"):
        use_auto(model, cache_dir=graphs)
    chosen = auto.auto_choice(model)
    assert calls and chosen.runtime == "onnxruntime"
    answers_as_pytorch(model, plain)
    if kind == "folder":
        assert kept.is_dir() and chosen.file is None
    else:
        assert decision.read_decision(kept, auto._candidates("f32")[0])["runtime"] == "onnxruntime"


@pytest.mark.parametrize("how", ["refuses the model", "fails to import"])
def test_a_kept_path_that_cannot_run_the_model_is_ignored(how, graphs, scripted_clock, monkeypatch):
    """A kept decision naming OpenVINO for an encoder-decoder, which it refuses (a file written by hand, or by another
    version), or naming an engine whose installation is broken: a warning naming the refusal, a new measurement, a
    rewritten file; the next load reads that, and never fails on the old one."""
    pytest.importorskip("openvino")
    if how == "refuses the model":
        config = VanillaSeq2SeqConfig(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64)
        torch.manual_seed(0)
        make, refusal, engines = lambda: VanillaSeq2SeqModel(config).eval(), r"encoder-decoder", apply_runtime
    else:
        def broken(model, runtime, **options):  # the registry, but for OpenVINO
            if runtime == "openvino":
                raise ImportError("libopenvino.so.2540: cannot open shared object file")
            return apply_runtime(model, runtime, **options)
        make, refusal, engines = model_of, r"libopenvino", broken
    model = make()
    kept = decision.decision_file(model, "f32", torch.get_num_threads(), auto._candidates("f32")[0], graphs)
    kept.write_text(json.dumps({"format": decision.FORMAT, "key": kept.stem[5:], "choice": kept_record("openvino")}))
    calls = []
    scripted(monkeypatch, scripted_clock, {"onnxruntime": 0.1, "pytorch": 0.3}, calls)
    with pytest.warns(UserWarning, match=rf"ignored the kept decision .*\(openvino refused this model: .*{refusal}.*"
                                         rf"measuring again"):
        auto.use_auto(model, cache_dir=graphs, apply_runtime=engines)
    assert calls and auto.auto_choice(model).runtime == "onnxruntime" and "openvino" in auto.auto_choice(model).left_out
    assert json.loads(kept.read_text())["choice"]["runtime"] == "onnxruntime"
    calls.clear()
    again = auto.use_auto(make(), cache_dir=graphs, apply_runtime=engines)
    assert calls == [] and auto.auto_choice(again).cached and auto.auto_choice(again).runtime == "onnxruntime"


def test_a_decision_within_the_noise_is_measured_again_once(graphs, scripted_clock, monkeypatch):
    """ONNX Runtime fed the weights 2.5% faster than holding them: chosen, its margin (1.025) said, not settled. The
    next load measures again and reads the reverse: within the noise both times, so the path with fewer restrictions
    (fed the weights) is kept, settled; the third load measures nothing. A clear winner is settled at once."""
    costs = {"onnxruntime": 0.1, "onnxruntime owned": 0.1025}
    calls = []
    monkeypatch.setattr(auto, "missing", lambda path: ["openvino"] if path.runtime == "openvino" else [])
    scripted(monkeypatch, scripted_clock, costs, calls)
    first = auto.auto_choice(use_auto(model_of(), cache_dir=graphs))
    assert first.runtime == "onnxruntime" and first.margin == pytest.approx(1.025) and not first.settled
    assert not json.loads(open(first.file).read())["choice"]["settled"]

    costs.update({"onnxruntime": 0.1025, "onnxruntime owned": 0.1})
    calls.clear()
    model, plain = use_auto(model_of(), cache_dir=graphs), model_of()
    second = auto.auto_choice(model)
    assert calls and not second.cached and second.settled
    assert second.runtime == "onnxruntime" and engine_of(model) == "OnnxEncoder"
    assert second.margin == pytest.approx(0.1 / 0.1025)
    answers_as_pytorch(model, plain)

    calls.clear()
    third = auto.auto_choice(use_auto(model_of(), cache_dir=graphs))
    assert calls == [] and third.cached and third.runtime == "onnxruntime" and third.settled

    for kept in graphs.glob("auto-*.json"):
        kept.unlink()
    costs.update({"onnxruntime": 0.1, "onnxruntime owned": 0.3})
    clear = auto.auto_choice(use_auto(model_of(), cache_dir=graphs))
    assert clear.runtime == "onnxruntime" and clear.margin == pytest.approx(3.0) and clear.settled


def test_an_encoder_decoder_runs_where_its_encoder_can(graphs, scripted_clock, monkeypatch):
    """The engines holding weights refuse an encoder-decoder (it shares its embeddings with the decoder): left out,
    saying why; ONNX Runtime fed the weights, scripted fastest, runs its encoder, which answers as PyTorch's."""
    scripted(monkeypatch, scripted_clock, {"onnxruntime": 0.1, "pytorch": 0.3})
    config = VanillaSeq2SeqConfig(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64)
    torch.manual_seed(0)
    model = VanillaSeq2SeqModel(config).eval()
    plain = VanillaSeq2SeqModel(config).eval()
    plain.load_state_dict(model.state_dict())
    use_auto(model, cache_dir=graphs)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime" and "encoder-decoder" in chosen.left_out["onnxruntime owned"]
    assert type(vars(model.get_encoder())["forward"]).__name__ == "OnnxEncoder"
    inputs = batch()
    real = inputs["attention_mask"].bool()
    with torch.inference_mode():
        got = model.get_encoder()(**inputs).last_hidden_state
        want = plain.get_encoder()(**inputs).last_hidden_state
    assert_close(got[real], want[real])


def test_a_decision_measured_on_a_saturated_machine_is_not_kept(graphs, scripted_clock, monkeypatch):
    """Measured while the load average exceeds the cores, the choice serves this process and no file is written."""
    monkeypatch.setattr(auto, "saturated", lambda: "load average 9.0 on 2 cores")
    scripted(monkeypatch, scripted_clock, {"onnxruntime": 0.001})
    model = use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "onnxruntime" and auto.auto_choice(model).file is None
    assert list(graphs.glob("auto-*.json")) == []


def test_saturation_is_read_from_the_load_average(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.0, 6.0))
    assert SATURATED() == "load average 7.5 on 2 cores"
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    assert SATURATED() is None


def test_paths_not_installed_are_not_candidates(graphs, scripted_clock, monkeypatch):
    """Without ONNX Runtime and OpenVINO, auto is eager PyTorch, measured nothing, and says why."""
    monkeypatch.setattr(auto, "missing", lambda path: ["onnxruntime"] if path.runtime else [])
    model = use_auto(model_of(), cache_dir=graphs)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "pytorch" and engine_of(model) is None and chosen.times_ms == {}
    assert chosen.left_out["openvino"] == "onnxruntime not installed"
    assert list(graphs.glob("auto-*.json")) == []


def test_reduced_precision_only_when_asked_and_at_the_accuracy_floor(graphs, scripted_clock, monkeypatch):
    """int8 scripted fastest: not a candidate at precision "f32"; at "fastest" chosen when it reaches the floor,
    left out (saying its cosine) when it does not; bf16 left out where the CPU does not multiply it natively."""
    monkeypatch.setattr(auto, "bf16_is_fast", lambda: False)
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned int8": 0.001, "openvino int8": 0.002,
                                           "onnxruntime": 0.003})
    assert all(path.precision == "f32" for path in auto._candidates("f32")[0])

    monkeypatch.setattr(auto, "ACCURACY_FLOOR", -1.0)
    model = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime owned int8" and vars(model)["forward"].precision == "int8"
    assert "bf16_is_fast" in chosen.left_out["openvino bf16"]
    assert 0.9 < chosen.accuracy["onnxruntime owned int8"] <= 1.0
    assert chosen.sample == "1 tokenized batch given (59 tokens)"

    monkeypatch.setattr(auto, "ACCURACY_FLOOR", 1.5)
    for kept in graphs.glob("auto-*.json"):
        kept.unlink()
    model = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime"
    assert chosen.left_out["onnxruntime owned int8"].startswith("lowest token cosine")


SPLIT_COSTS = {"onnxruntime owned int8": {"short": 0.01, "padded": 0.05, "large": 0.2},
               "pytorch bf16": {"short": 0.03, "padded": 0.04, "large": 0.1}}


def rows_of(tokens: int) -> dict:
    """A request of `tokens` real tokens: two rows, the second right-padded when `tokens` is odd."""
    first = (tokens + 1) // 2
    ids = (torch.arange(2 * first).view(2, first) * 7) % (CONFIG["vocab_size"] - 1) + 1
    mask = (torch.arange(first)[None, :] < torch.tensor([first, tokens - first])[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def test_fastest_answers_larger_requests_with_bf16_pytorch_beside_the_engine(graphs, scripted_clock, monkeypatch):
    """Where bf16 is fast, int8 ONNX Runtime scripted fastest on the short query and bf16 PyTorch (padding-free) on
    the batches: the engine is chosen, and from the real tokens where the two times cross between the short query (16
    tokens) and the padded batch (80) the bf16 partner answers, in float32 as the engine does. Each input is
    answered one way from its first call (the split is decided at load, by real tokens); the partner follows the
    weights the engine holds (a load_state_dict); a second load reads the split back without measuring."""
    monkeypatch.setattr(auto, "bf16_is_fast", lambda: True)
    monkeypatch.setattr(auto, "ACCURACY_FLOOR", -1.0)
    monkeypatch.setattr(auto, "missing", lambda path: ["openvino"] if path.runtime == "openvino" else [])
    calls = []
    scripted(monkeypatch, scripted_clock, SPLIT_COSTS, calls)
    model = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime owned int8"
    assert chosen.split == {"tokens": 59, "path": "pytorch bf16"}  # 16 + 64 x 2/3: where 10 -> 50 ms, 30 -> 40 cross
    assert chosen.times_ms["pytorch bf16"]["large"] == pytest.approx(100.0)

    def bf16_of(weights, inputs):
        with torch.inference_mode():
            return weights.to(torch.bfloat16)(**inputs).last_hidden_state.float()

    for tokens, partner in ((58, False), (59, True), (64, True)):
        inputs = rows_of(tokens)
        with torch.inference_mode():
            first, again = (model(**inputs).last_hidden_state for _ in range(2))
        assert first.dtype == torch.float32 and torch.equal(first, again)
        assert torch.equal(first, bf16_of(model_of(), inputs)) == partner
        with torch.inference_mode():
            assert torch.equal(model(**inputs, return_dict=False)[0], first)

    other = model_of(seed=1)
    model.load_state_dict(other.state_dict())
    inputs = rows_of(64)
    with torch.inference_mode():
        assert torch.equal(model(**inputs).last_hidden_state, bf16_of(model_of(seed=1), inputs))

    calls.clear()
    again = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    assert calls == [] and auto.auto_choice(again).cached and auto.auto_choice(again).split["tokens"] == 59
    with torch.inference_mode():
        assert torch.equal(again(**inputs).last_hidden_state, bf16_of(model_of(), inputs))


def test_fastest_answers_larger_requests_with_another_engine_beside_the_first(graphs, scripted_clock, monkeypatch):
    """int8 ONNX Runtime holding the weights scripted fastest on the short query and OpenVINO float32 on the batches
    (bf16 not fast): the int8 engine is chosen, and from the real tokens where the two cross OpenVINO answers, over
    the weights the first engine holds. Each input is answered one way from its first call; the partner follows a
    load_state_dict, a deep copy and a pickle; a second load reads the split back without measuring."""
    pytest.importorskip("openvino")
    monkeypatch.setattr(auto, "bf16_is_fast", lambda: False)
    monkeypatch.setattr(auto, "ACCURACY_FLOOR", -1.0)
    calls = []
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned int8": SPLIT_COSTS["onnxruntime owned int8"],
                                           "openvino": SPLIT_COSTS["pytorch bf16"]}, calls)
    model = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime owned int8"
    assert chosen.split == {"tokens": 59, "path": "openvino"}
    assert engine_of(vars(model)["forward"].partner) == "OpenVinoEncoder"

    def float32_of(weights, inputs):
        with torch.inference_mode():
            return weights(**inputs).last_hidden_state

    for tokens, partner in ((58, False), (59, True), (64, True)):
        inputs = rows_of(tokens)
        real = inputs["attention_mask"].bool()
        with torch.inference_mode():
            first, again = (model(**inputs).last_hidden_state for _ in range(2))
        expected = float32_of(model_of(), inputs)[real]
        if partner:  # OpenVINO float32, within the float32 rule (its own per-size choice may answer by PyTorch)
            assert_close(first[real], expected)
            assert_close(again[real], first[real])
        else:  # int8: outside it, and the same answer every call
            assert (first[real] - expected).abs().max() > tolerance(expected)
            assert torch.equal(first, again)
    inputs = rows_of(64)
    real = inputs["attention_mask"].bool()
    for served in (model, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        served.load_state_dict(model_of(seed=1).state_dict())
        with torch.inference_mode():
            got = served(**inputs).last_hidden_state
        assert_close(got[real], float32_of(model_of(seed=1), inputs)[real])

    calls.clear()
    again = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    assert calls == [] and auto.auto_choice(again).cached and auto.auto_choice(again).split == chosen.split
    assert engine_of(vars(again)["forward"].partner) == "OpenVinoEncoder"


def test_fastest_runs_bf16_pytorch_alone_where_it_leads_everywhere(graphs, scripted_clock, monkeypatch):
    """bf16 PyTorch scripted fastest at every request: the model itself runs in bfloat16, with no engine; where bf16
    is not fast it is no candidate."""
    monkeypatch.setattr(auto, "bf16_is_fast", lambda: True)
    monkeypatch.setattr(auto, "ACCURACY_FLOOR", -1.0)
    scripted(monkeypatch, scripted_clock, {"pytorch bf16": 0.01})
    model = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    assert auto.auto_choice(model).runtime == "pytorch bf16" and auto.auto_choice(model).split is None
    assert engine_of(model) is None and model.dtype == torch.bfloat16
    monkeypatch.setattr(auto, "bf16_is_fast", lambda: False)
    assert "bf16_is_fast" in auto._candidates("fastest")[1]["pytorch bf16"]


def test_the_floor_is_checked_on_the_samples_text(graphs, scripted_clock, monkeypatch):
    """An int8 path scripted wrong at one id only (as an outlier channel loses on real text's frequent tokens, which
    ids spread over the vocabulary do not weigh): chosen on a sample without that id, refused on one with it, where
    float32 runs and answers as plain PyTorch; the two samples are two decisions."""
    monkeypatch.setattr(auto, "bf16_is_fast", lambda: False)
    monkeypatch.setattr(auto, "missing", lambda path: ["openvino"] if path.runtime == "openvino" else [])
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned int8": 0.001, "onnxruntime": 0.003})
    wrong_at(monkeypatch, "onnxruntime owned int8", OUTLIER)
    model = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    assert auto.auto_choice(model).runtime == "onnxruntime owned int8"

    with_outlier = [PLAIN, sample_of([2, 3, OUTLIER, 5, 6])]
    model, plain = use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=with_outlier), model_of()
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime" and not chosen.cached and chosen.accuracy["onnxruntime owned int8"] < 0
    assert chosen.left_out["onnxruntime owned int8"].startswith("lowest token cosine -1.0000 < 0.984 on 2 tokenized")
    answers_as_pytorch(model, plain)
    assert len(list(graphs.glob("auto-*.json"))) == 2


def test_fastest_without_text_to_check_on_measures_float32_only(graphs, scripted_clock, monkeypatch):
    """A model with no tokenizer saved beside it and no sample: no reduced path (nothing real to check it on), a
    warning naming the fix; texts without a tokenizer are refused so."""
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned int8": 0.001, "onnxruntime": 0.003})
    with pytest.warns(UserWarning, match=r"float32 paths only: no tokenizer saved with the model.*'sample'"):
        model = use_auto(model_of(), precision="fastest", cache_dir=graphs)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime" and "no tokenizer" in chosen.left_out["onnxruntime owned int8"]
    assert all(auto.BY_NAME[name].precision == "f32" for name in chosen.times_ms)
    with pytest.raises(ValueError, match=r"sample texts are tokenized by the model's own tokenizer.*tokenized batches"):
        use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=["A sentence of real text."])


def save_word_tokenizer(folder) -> None:
    """A tokenizer of the tiny model's 99 ids (the built-in sentences' first words, and [UNK] for the rest) that gives
    segment ids, as BERT's does, saved in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_vanilla.runtimes.accuracy import SENTENCES

    words = sorted({word for sentence in SENTENCES for word in sentence.lower().split()})[:95]
    vocabulary = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3} | {word: 4 + i for i, word in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                            model_input_names=["input_ids", "token_type_ids", "attention_mask"]).save_pretrained(folder)


def test_the_sample_is_tokenized_as_the_model_reads_it(tmp_path):
    """The built-in sentences tokenized by the model's tokenizer: batches of ROWS, within the positions, each row
    with a real token; segment ids only where the model has token types (a BERT tokenizer gives them to any)."""
    from hf_vanilla.runtimes import accuracy

    save_word_tokenizer(tmp_path)
    for type_vocab_size in (2, 0):
        model = VanillaEncoderModel(VanillaEncoderConfig(**dict(CONFIG, type_vocab_size=type_vocab_size)))
        model.name_or_path = str(tmp_path)
        batches, text = accuracy.sample_batches(model, None)
        assert text.startswith(f"{len(accuracy.SENTENCES)} built-in English sentences")
        assert sum(len(batch["input_ids"]) for batch in batches) == len(accuracy.SENTENCES)
        assert all(batch["input_ids"].shape[1] <= 64 and (batch["attention_mask"].sum(1) > 0).all()
                   for batch in batches)
        assert all(("token_type_ids" in batch) == bool(type_vocab_size) for batch in batches)


def test_fastest_reads_the_built_in_sentences_with_the_tokenizer_saved_beside(graphs, scripted_clock, monkeypatch,
                                                                              tmp_path):
    """from_pretrained of a folder holding a tokenizer: the built-in English sentences, tokenized by it, are the
    sample; texts given are tokenized by it too."""
    from hf_vanilla.runtimes.accuracy import SENTENCES

    save_word_tokenizer(tmp_path)
    model_of().save_pretrained(tmp_path)
    monkeypatch.setattr(auto, "ACCURACY_FLOOR", -1.0)
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned int8": 0.001})
    model = VanillaEncoderModel.from_pretrained(tmp_path, runtime="auto",
                                                runtime_options={"cache_dir": graphs, "precision": "fastest"})
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime owned int8"
    assert chosen.sample == f"{len(SENTENCES)} built-in English sentences, tokenized by the tokenizer in " \
                            f"{str(tmp_path)!r}"
    model = VanillaEncoderModel.from_pretrained(tmp_path, runtime="auto", runtime_options={
        "cache_dir": graphs, "precision": "fastest", "sample": ["the bridge was closed", "rain fell"]})
    assert auto.auto_choice(model).sample == f"2 texts given, tokenized by the tokenizer in {str(tmp_path)!r}"


def test_from_pretrained_runtime_auto(graphs, scripted_clock, monkeypatch, tmp_path):
    """`runtime="auto"` is a runtime like the others, its options passed through."""
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned": 0.001})
    model_of(VanillaEncoderForSequenceClassification).save_pretrained(tmp_path)
    model = VanillaEncoderForSequenceClassification.from_pretrained(tmp_path, runtime="auto",
                                                                    runtime_options={"cache_dir": graphs})
    assert auto.auto_choice(model).runtime == "onnxruntime owned"
    plain = VanillaEncoderForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.inference_mode():
        assert_close(model(**batch()).logits, plain(**batch()).logits)


@pytest.mark.parametrize("options, message", [
    ({"precision": "int8"}, r"precision='int8' is not one of"),
    ({"threads": 0}, r"threads=0 must be"),
    ({"threads": 2.5}, r"threads=2.5 must be"),
    ({"cache_dir": 5}, r"use_auto: cache_dir=5 is not accepted; it takes a folder's path"),
    ({"sample": "one text"}, r"sample='one text' is not accepted; it takes a non-empty list of texts"),
    ({"sample": []}, r"sample=\[\] is not accepted"),
    ({"sample": [{"input_ids": torch.tensor([[1, 2, 99]])}]}, r"ids from 1 to 99.*vocabulary has 99"),
    ({"sample": [{"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([1])}]}, r"has keys .*labels"),
    ({"sample": [{"input_ids": torch.ones(1, 65, dtype=torch.long)}]}, r"1 to 64 tokens a row"),
    ({"sample": [{"input_ids": torch.tensor([[1.5]])}]}, r"input_ids is torch.float32"),
    ({"sample": [{"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[0, 0]])}]},
     r"a real token in every row"),
    ({"sample": ["text", {"input_ids": torch.tensor([[1]])}]}, r"sample mixes texts and other things"),
    ({"apply_runtime": apply_runtime}, r"runtime='auto' takes no option 'apply_runtime': it is not a runtime option"),
])
def test_bad_options_are_refused(options, message, graphs, tmp_path):
    """Each refused with a one-line ValueError naming the option, before anything is measured; the same through
    from_pretrained (cache_dir=5 was a TypeError from pathlib)."""
    with pytest.raises(ValueError, match=message):
        use_auto(model_of(), **{"cache_dir": graphs} | options)
    model_of().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        VanillaEncoderModel.from_pretrained(tmp_path, runtime="auto", runtime_options={"cache_dir": graphs} | options)


def test_an_option_auto_does_not_take_is_refused_naming_those_it_does(graphs):
    """The options named are the user's: not `apply_runtime`, which the registry hands over itself."""
    with pytest.raises(ValueError, match=r"^runtime='auto' takes no option 'precison': runtime_options takes "
                                         r"\['precision', 'threads', 'cache_dir', 'sample'\]\.$"):
        use_auto(model_of(), cache_dir=graphs, precison="fastest")


def test_training_is_refused(graphs):
    with pytest.raises(ValueError, match=r"inference only: call model.eval\(\)"):
        use_auto(model_of().train(), cache_dir=graphs)


def test_the_key_is_the_models_shape_and_at_fastest_its_weights():
    """At float32 two models of one architecture share a decision (the timing is the architecture's); another width
    or dtype does not. At "fastest" the weights and the sample are in the key too: a reduced precision's accuracy is
    theirs."""
    paths = list(auto.PATHS[:2])
    one, two = (decision.decision_key(model_of(seed=seed), "f32", 2, paths) for seed in (0, 1))
    wider = decision.decision_key(VanillaEncoderModel(VanillaEncoderConfig(**dict(CONFIG, hidden_size=64))).eval(),
                              "f32", 2, paths)
    bf16 = decision.decision_key(model_of().to(torch.bfloat16), "f32", 2, paths)
    assert one == two != wider and bf16 != one
    batches = sample_batches(model_of(), PLAIN)[0]
    fastest = {seed: decision.decision_key(model_of(seed=seed), "fastest", 2, paths, batches) for seed in (0, 1)}
    assert fastest[0] != fastest[1] and fastest[0] == decision.decision_key(model_of(), "fastest", 2, paths, batches)
    edited = model_of()
    with torch.no_grad():
        edited.encoder.embeddings.norm.weight[7] *= 20  # one channel: an outlier
    assert decision.decision_key(edited, "fastest", 2, paths, batches) != fastest[0]
    other = sample_batches(model_of(), sample_of([1, 2, 3]))[0]
    assert decision.decision_key(model_of(), "fastest", 2, paths, other) != fastest[0]


def test_a_fastest_decision_is_measured_again_for_other_weights(graphs, scripted_clock, monkeypatch):
    """A kept "fastest" decision serves the same weights only: a fine-tune of the architecture is checked anew."""
    monkeypatch.setattr(auto, "ACCURACY_FLOOR", -1.0)
    calls = []
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned int8": 0.001}, calls)
    use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)
    calls.clear()
    assert auto.auto_choice(use_auto(model_of(), precision="fastest", cache_dir=graphs, sample=PLAIN)).cached
    assert calls == []
    other = use_auto(model_of(seed=1), precision="fastest", cache_dir=graphs, sample=PLAIN)
    assert calls and not auto.auto_choice(other).cached and len(list(graphs.glob("auto-*.json"))) == 2


def test_a_bfloat16_model_is_refused_naming_the_fix(graphs, scripted_clock, monkeypatch, tmp_path):
    """Loaded in bf16 with runtime="auto": a ValueError naming dtype=torch.float32 and runtime=None, before anything
    is measured, also where a float32 load of the same model kept a decision (whose engine reads float32 weights),
    and never a model that loads and then fails at every call."""
    scripted(monkeypatch, scripted_clock, {"onnxruntime": 0.001})
    model_of(VanillaEncoderForSequenceClassification).save_pretrained(tmp_path)
    kept = VanillaEncoderForSequenceClassification.from_pretrained(tmp_path, runtime="auto",
                                                                   runtime_options={"cache_dir": graphs})
    assert auto.auto_choice(kept).runtime == "onnxruntime"
    for options in ({"cache_dir": graphs}, {"cache_dir": graphs, "precision": "fastest"}):
        with pytest.raises(ValueError, match=r"runtime='auto' measures a float32 model on the CPU, and .* is "
                                             r"torch.bfloat16 on cpu: load it with dtype=torch.float32 .* or with "
                                             r"runtime=None"):
            VanillaEncoderForSequenceClassification.from_pretrained(tmp_path, dtype=torch.bfloat16, runtime="auto",
                                                                    runtime_options=options)
    model = model_of().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype=torch.float32"):
        use_auto(model, cache_dir=graphs)
    assert engine_of(model) is None and auto.auto_choice(model) is None


@pytest.mark.parametrize("flags, vendor, expected", [
    ({"avx2", "fma"}, "AuthenticAMD",  # AMD Zen 3, the AVX2-only EPYC where ONNX Runtime led
     dict(avx512=False, avx512_vnni=False, bf16_fast=False, fbgemm_int8_bits=7, mlas_int8_bits=7)),
    ({"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}, "AuthenticAMD",  # Zen 4, Zen 5
     dict(avx512=True, avx512_vnni=True, bf16_fast=True, fbgemm_int8_bits=8, mlas_int8_bits=8)),
    ({"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}, "GenuineIntel",  # Cooper Lake: bf16 not faster
     dict(avx512=True, bf16_fast=False, amx=False)),
    ({"avx2", "avx_vnni"}, "GenuineIntel",  # Alder Lake: VNNI for MLAS, not for fbgemm
     dict(avx512=False, fbgemm_int8_bits=7, mlas_int8_bits=8)),
    ({"avx2", "avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}, "GenuineIntel",  # SPR
     dict(amx=True, bf16_fast=True, fbgemm_int8_bits=8, mlas_int8_bits=8)),
])
def test_cpu_capabilities_are_read_from_the_flags(flags, vendor, expected):
    """The per-CPU facts the engines rely on, in one place, read from scripted flags."""
    from hf_vanilla.precision import cpu_capabilities

    found = cpu_capabilities(flags, vendor)
    assert {name: found[name] for name in expected} == expected
