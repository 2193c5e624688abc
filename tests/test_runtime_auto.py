"""`runtime="auto"` (hf_vanilla/runtimes/auto.py): the path measured fastest here, on a scripted clock.

- the path whose scripted calls are fastest is the one attached, whichever it is, and the model answers within the
  float32 rule of plain PyTorch; the per-size decisions of the measured requests are kept on its engine;
- the decision is kept in a file under the graph cache folder and a second load measures nothing; another CPU (flags
  scripted), another version or another thread count measures again; a damaged or foreign file is ignored with a
  warning and rewritten, never trusted;
- paths whose packages are missing are not candidates; bf16 only where the CPU multiplies it natively; int8 and bf16
  only with `precision="fastest"` and at the accuracy floor or above;
- `from_pretrained(path, runtime="auto")`; bad options refused with a one-line error.
"""

import itertools
import json

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
from hf_vanilla.runtimes.choice import key_of, runtime_choices

pytest.importorskip("onnxruntime", reason="runtime='auto' chooses among engines: pip install -e '.[onnx]'")
from hf_vanilla.runtimes import auto  # noqa: E402

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
        kept.unlink()
    return shared_graphs


def model_of(cls=VanillaEncoderModel, seed=0):
    torch.manual_seed(seed)
    return cls(VanillaEncoderConfig(**CONFIG)).eval()


def scripted(monkeypatch, clock, costs, calls=None):
    """Each path's call costs `costs[path]` seconds (or `costs[path][request]`; 1 s where not named; a list: its
    seconds in turn, call after call) on the scripted clock; `calls` (a list) records (path, request) of every call."""
    original = auto.runner

    def runner(model, path, inputs):
        request = "short" if inputs["input_ids"].shape[0] == 1 else "padded"
        cost = costs.get(path.name, 1.0)
        cost = cost[request] if isinstance(cost, dict) else cost
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
    assert auto.use_auto(model, cache_dir=graphs) is model
    chosen = auto.auto_choice(model)
    assert chosen.runtime == winner and not chosen.cached
    assert engine_of(model) == ENGINES[winner]
    assert chosen.times_ms[winner] == pytest.approx({"short": 100.0, "padded": 100.0})
    assert set(chosen.times_ms) == {name for name in ENGINES if name not in chosen.left_out}
    answers_as_pytorch(model, plain)


def test_each_measured_size_keeps_its_engine_or_pytorch(graphs, scripted_clock, monkeypatch):
    """ONNX Runtime scripted faster than PyTorch on the short request and slower on the padded one: chosen (its
    geometric mean, with PyTorch answering the padded size, is the least), and the two sizes' decisions are kept on
    the engine, as its per-size choice would have made them."""
    scripted(monkeypatch, scripted_clock, {"onnxruntime": {"short": 0.1, "padded": 0.5},
                                           "pytorch": {"short": 0.3, "padded": 0.2}})
    model = auto.use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "onnxruntime"
    assert auto.auto_choice(model).times_ms["onnxruntime"] == pytest.approx({"short": 100.0, "padded": 200.0})
    short, padded = key_of(1, 16), key_of(4, 32 + 24 + 16 + 8)
    assert runtime_choices(model) == {short: True, padded: False}


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
    model = auto.use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "onnxruntime"
    assert auto.auto_choice(model).engine_ms["onnxruntime owned"]["short"] == pytest.approx(300.0)
    timed = events[events.index(("idle", auto.IDLE_S)):]  # the untimed first calls of each path come before
    queries = [i for i, event in enumerate(timed) if event[1] == "short"]
    assert len(queries) == 2 * 3 * len(auto.auto_choice(model).times_ms)  # rounds x queries x paths measured
    assert all(timed[i - 1] == ("idle", auto.IDLE_S) for i in queries)


def test_a_tie_goes_to_the_path_with_fewer_restrictions(graphs, scripted_clock, monkeypatch):
    """Within 2% of each other, PyTorch is kept over an engine holding the weights."""
    scripted(monkeypatch, scripted_clock, {"pytorch": 0.101, "onnxruntime owned": 0.1})
    model = auto.use_auto(model_of(), cache_dir=graphs)
    assert auto.auto_choice(model).runtime == "pytorch" and engine_of(model) is None


def test_the_decision_is_kept_and_measured_again_where_it_does_not_apply(graphs, scripted_clock, monkeypatch):
    """The second load reads the kept decision and times nothing; another CPU's flags, another version of a
    library or another thread count is another key, and measures again."""
    calls = []
    scripted(monkeypatch, scripted_clock, {"onnxruntime owned": 0.001}, calls)
    first = auto.use_auto(model_of(VanillaEncoderForSequenceClassification), cache_dir=graphs)
    kept = sorted(graphs.glob("auto-*.json"))
    assert len(kept) == 1 and calls and auto.auto_choice(first).file == str(kept[0])
    calls.clear()
    second = auto.use_auto(model_of(VanillaEncoderForSequenceClassification, seed=1), cache_dir=graphs)
    assert calls == [] and auto.auto_choice(second).cached
    assert auto.auto_choice(second).runtime == "onnxruntime owned" == auto.auto_choice(first).runtime
    assert engine_of(second) == "OwnedOnnxEncoder"
    answers_as_pytorch(second.base_model, model_of(VanillaEncoderForSequenceClassification, seed=1).base_model)

    paths = auto._candidates("f32")[0]
    keys = {auto.decision_key(second, "f32", 2, paths)}
    flags = auto.cpu_flags()
    monkeypatch.setattr(auto, "cpu_flags", lambda: flags ^ {"avx512_vnni"})  # another CPU
    keys.add(auto.decision_key(second, "f32", 2, paths))
    calls.clear()
    again = auto.use_auto(model_of(VanillaEncoderForSequenceClassification), cache_dir=graphs)
    assert calls and not auto.auto_choice(again).cached and len(list(graphs.glob("auto-*.json"))) == 2
    found = auto.versions()
    monkeypatch.setattr(auto, "versions", lambda: dict(found, openvino="0.0.1"))
    keys.add(auto.decision_key(second, "f32", 2, paths))
    keys.add(auto.decision_key(second, "f32", 3, paths))
    keys.add(auto.decision_key(second, "fastest", 3, paths))
    assert len(keys) == 5


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"format": 1}', "wrong path", "foreign key"])
def test_a_damaged_decision_is_ignored_with_a_warning(damage, graphs, scripted_clock, monkeypatch):
    """A kept decision that is empty, not JSON, incomplete, names a path that is not a candidate, or was written for
    another key is never trusted: a warning, a new measurement, a rewritten file."""
    model = model_of()
    kept = auto._decision_file(model, "f32", torch.get_num_threads(), auto._candidates("f32")[0], graphs)
    record = {"runtime": "onnxruntime", "precision": "f32", "times_ms": {}, "engine_ms": {}, "accuracy": {},
              "left_out": {}, "measured_s": 1.0, "cpu": {}}
    if damage == "wrong path":
        damage = json.dumps({"format": auto.FORMAT, "key": kept.stem[5:],
                             "choice": dict(record, runtime="../../etc/passwd")}).encode()
    elif damage == "foreign key":
        damage = json.dumps({"format": auto.FORMAT, "key": "0" * 32, "choice": record}).encode()
    kept.write_bytes(damage)
    calls = []
    scripted(monkeypatch, scripted_clock, {"onnxruntime": 0.001}, calls)
    with pytest.warns(UserWarning, match=r"ignored the kept decision .*auto-.*\.json.*measuring again"):
        auto.use_auto(model, cache_dir=graphs)
    assert calls and auto.auto_choice(model).runtime == "onnxruntime"
    assert json.loads(kept.read_text())["choice"]["runtime"] == "onnxruntime"
    assert auto._read(kept, auto._candidates("f32")[0])["runtime"] == "onnxruntime"


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
    auto.use_auto(model, cache_dir=graphs)
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
    model = auto.use_auto(model_of(), cache_dir=graphs)
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
    model = auto.use_auto(model_of(), cache_dir=graphs)
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
    model = auto.use_auto(model_of(), precision="fastest", cache_dir=graphs)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime owned int8" and vars(model)["forward"].precision == "int8"
    assert "bf16_is_fast" in chosen.left_out["openvino bf16"]
    assert 0.9 < chosen.accuracy["onnxruntime owned int8"] <= 1.0

    monkeypatch.setattr(auto, "ACCURACY_FLOOR", 1.5)
    for kept in graphs.glob("auto-*.json"):
        kept.unlink()
    model = auto.use_auto(model_of(), precision="fastest", cache_dir=graphs)
    chosen = auto.auto_choice(model)
    assert chosen.runtime == "onnxruntime"
    assert chosen.left_out["onnxruntime owned int8"].startswith("lowest token cosine")


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


@pytest.mark.parametrize("options, message", [({"precision": "int8"}, r"precision='int8' is not one of"),
                                              ({"threads": 0}, r"threads=0 must be"),
                                              ({"threads": 2.5}, r"threads=2.5 must be")])
def test_bad_options_are_refused(options, message, graphs):
    with pytest.raises(ValueError, match=message):
        auto.use_auto(model_of(), cache_dir=graphs, **options)


def test_training_is_refused(graphs):
    with pytest.raises(ValueError, match=r"inference only: call model.eval\(\)"):
        auto.use_auto(model_of().train(), cache_dir=graphs)


def test_the_key_is_the_models_shape_not_its_weights():
    """Two models of one architecture share a decision; another width does not."""
    paths = list(auto.PATHS[:2])
    one, two = (auto.decision_key(model_of(seed=seed), "f32", 2, paths) for seed in (0, 1))
    wider = auto.decision_key(VanillaEncoderModel(VanillaEncoderConfig(**dict(CONFIG, hidden_size=64))).eval(),
                              "f32", 2, paths)
    assert one == two != wider


@pytest.mark.parametrize("flags, vendor, expected", [
    ({"avx2", "fma"}, "AuthenticAMD",  # AMD Zen 3, the AVX2-only EPYC of issue 46
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
