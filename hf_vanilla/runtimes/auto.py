"""`runtime="auto"`: the engine that is fastest for this model on this machine, measured there, once.

    model = AutoModel.from_pretrained(path, runtime="auto")                                   # float32
    model = AutoModel.from_pretrained(path, runtime="auto", runtime_options={"precision": "fastest"})
    from hf_vanilla.runtimes.auto import use_auto, auto_choice                                # on a model in hand
    auto_choice(model)   # which path runs, why, and what each measured

Why. Which way of running an encoder is fastest depends on the CPU, the request size and the libraries installed:
on AMD Zen 5 OpenVINO holding the weights led at every size, on a 2-core AVX2-only EPYC ONNX Runtime holding them
was 1.11x faster on one short request after an idle gap (issue 46), and docs/deploy.md could only answer from the
CPUs it was measured on. So the choice is measured where the model runs.

What is measured. The installed paths (`PATHS`; one whose packages are missing, or that refuses this model, is not
a candidate): eager PyTorch (its padding-free path), ONNX Runtime fed the model's weights, ONNX Runtime holding them,
OpenVINO holding them, and with `precision="fastest"` their int8 forms and OpenVINO's bf16 where the CPU multiplies
bf16 natively (`hf_vanilla.precision.bf16_is_fast`). Each is attached to its own copy of the model and timed on the
model's encoder at two requests: one short dense row (`SHORT`) and a right-padded batch (`PADDED`), as the engine
will run them (the engine's own path; PyTorch's separately), each as such requests come, in balanced orders
(`measure.balanced_orders`: a Williams design, each path right after each other one equally often), for `ROUNDS`
rounds at least and until `BUDGET_S` seconds have passed:
- the short query after an idle moment (`IDLE_S`, 50 ms, the benchmark's idle gap) and after another path's call,
  `QUERIES` times a round. The idle decides which engine answers a query first: MiniLM on a 2-core Zen 4, ONNX
  Runtime holding the weights answered 15% sooner than OpenVINO after 20 ms of idle, and after none (calls back to
  back); OpenVINO was sooner after 50 ms and after 200 ms, as in the benchmark's rounds, which is how queries come;
- the padded batch in blocks, as batches come back to back: the block's first call not counted (right after another
  engine's, it pays for that engine's spinning threads, which no request to a model holding one engine pays), then
  `BLOCK` calls, their median.
A path's time at a request is the median of its samples, not the best: ONNX Runtime's short calls are bimodal on the
VMs measured, and the best of a few samples chose by luck (MiniLM, eight loads: OpenVINO six times, ONNX Runtime
twice). 5-6 s for MiniLM on 2 cores, attaching included, 18-33 s for a model of bert-base's size, once per
machine (the decision is kept, below). A machine saturated throughout defeats it (docs/performance.md: on 2 cores
under a load of 6-9, inside a process holding some twenty engines, every MiniLM engine measured level with PyTorch,
where OpenVINO is 2.6x faster when quiet). Its cost, with the attach of every path, is logged at INFO.

How it chooses. At each request, a path that has an engine runs what the per-size choice would run
(hf_vanilla/runtimes/choice.py): the engine on the short request (no padding) and at a reduced precision, else the
engine where it was at least `choice.CHOICE_MIN_GAIN` faster than PyTorch, else PyTorch. The path chosen is the one
whose geometric mean time over the two requests is least; one within `TIE` of it that comes first in `PATHS` (fewer
restrictions: PyTorch, then the engine fed the weights, then those holding them) is preferred. The chosen engine is
attached to the model, and the per-size decisions of the two requests are kept (`MeasuredChoice.decide`): other
sizes are measured by the engine as they come, as with any runtime.

The accuracy rule of `precision="fastest"`. A path below float32 (int8, bf16) is a candidate only where its lowest
per-token cosine against float32 PyTorch, at the real tokens of the padded request, is at least `ACCURACY_FLOOR`:
0.984, what CTranslate2's int8 reaches on MiniLM's 256 Lee sentences (tests/test_precision.py), the most accurate of
the int8 engines users compare with (ONNX Runtime's own quantizer as it comes: 0.968). Float32 paths answer within
the float32 rule of PyTorch (each engine checks its graph at attach).

Kept. The decision is written to `auto-<key>.json` in the graph cache folder (runtimes/cache.py: `cache_dir`, else
$HF_VANILLA_ONNX_CACHE, else ~/.cache/hf_vanilla/onnx), atomically; the key hashes the model's structure (classes,
shapes, config), the CPU (model name, vendor, flags), the thread count, the precision, the candidate paths, and the
versions of torch, transformers, onnxruntime, openvino and hf_vanilla. A second load finds it and attaches the chosen
engine without measuring. A decision measured while the machine was saturated (`saturated`: a load average above
the cores this process may use) serves its process only and is not written. To measure again, remove the file
(`auto_choice(model).file`). A file that cannot be read, is not JSON, or says anything unexpected is ignored with a
warning and measured again (and rewritten); it is never trusted.

What it costs. The measurement holds a copy of the model per engine path (the engines holding weights take their
copy's), freed after: where memory is tight, name the engine. The chosen engine's rules are the model's (a held
engine refuses training and edits it cannot follow: docs/deploy.md); a user who edits weights between calls or
trains names `runtime="onnxruntime"` (fed the weights) or none. `runtime=None` stays eager PyTorch: auto measures
for seconds and may hand the weights to an engine, which an existing caller did not ask for.
"""

import copy
import dataclasses
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
import weakref

import torch
import transformers

from .. import measure
from ..precision import bf16_is_fast, cpu_capabilities, cpu_flags, cpu_name, cpu_vendor
from .attached import take_off
from .choice import CHOICE_MIN_GAIN, key_of, measures

logger = logging.getLogger(__name__)


def _own_version() -> str:
    """hf_vanilla's version, read off the package (loaded before any module inside it): imported from there, it would
    be the one upward import in the house (tests/test_architecture.py)."""
    return sys.modules[__name__.partition(".")[0]].__version__

def _apply(model, runtime: str, **options):
    """The built-in engine `runtime` ("onnxruntime" or "openvino") put on `model`: imported here, not through
    hf_vanilla.runtime_registry, which names this module (the two would import each other)."""
    if runtime == "onnxruntime":
        from .onnxruntime import use_onnx_runtime as use
    else:
        from .openvino import use_openvino as use
    return use(model, **options)

FORMAT = 2  # of the auto-<key>.json files, in their key: bump when what they hold, or how it is measured, changes
SHORT = (16,)  # one dense row of 16 tokens: an embedding service's query
PADDED = (32, 24, 16, 8)  # four rows right-padded to 32: a small batch of mixed lengths
BUDGET_S = 2.0  # seconds of rounds, all paths together (ROUNDS at least, however long they take)
ROUNDS = 3  # rounds at least, whatever the budget
QUERIES = 3  # timed calls of the short query per path and round, each after IDLE_S and another path's call
IDLE_S = 0.05  # the idle moment before each short query, as benchmarks/engines.py idles (why: the module docstring)
BLOCK = 3  # timed calls of the padded batch per block, after its first (not timed)
WARM_CALLS = 40  # untimed calls of each path and request at most, until PyTorch's kernels are chosen
TIE = 1.02  # a path this close to the fastest, earlier in PATHS, is preferred
ACCURACY_FLOOR = 0.984  # lowest token cosine of a reduced-precision path (the module docstring)
PRECISIONS = ("f32", "fastest")


@dataclasses.dataclass(frozen=True)
class Path:
    """One way to run the model: `runtime` and its `options` (None: eager PyTorch), at `precision`."""

    name: str
    runtime: str | None
    options: tuple = ()
    precision: str = "f32"
    packages: tuple = ()


_ONNX = ("onnx", "onnxscript")
# In order of preference at a tie: fewer restrictions first (see the module docstring).
PATHS = (
    Path("pytorch", None),
    Path("onnxruntime", "onnxruntime", (), "f32", ("onnxruntime", *_ONNX)),
    Path("onnxruntime owned", "onnxruntime", (("owned", True),), "f32", ("onnxruntime", *_ONNX)),
    Path("openvino", "openvino", (), "f32", ("openvino", *_ONNX)),
    Path("onnxruntime owned int8", "onnxruntime", (("owned", True), ("precision", "int8")), "int8",
         ("onnxruntime", *_ONNX)),
    Path("openvino int8", "openvino", (("precision", "int8"),), "int8", ("openvino", *_ONNX)),
    Path("openvino bf16", "openvino", (("precision", "bf16"),), "bf16", ("openvino", *_ONNX)),
)
BY_NAME = {path.name: path for path in PATHS}

_CHOICES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its AutoChoice


@dataclasses.dataclass
class AutoChoice:
    """What `runtime="auto"` chose for a model, and from what (`auto_choice(model)`)."""

    runtime: str  # the path running: a name of PATHS
    precision: str  # what was asked: "f32" or "fastest"
    times_ms: dict  # path -> {"short": ms, "padded": ms}, each as the per-size choice would run it
    engine_ms: dict  # path -> {"short": ms, "padded": ms} of the engine's own path (PyTorch's under "pytorch")
    accuracy: dict  # reduced-precision path -> lowest token cosine against float32 (ACCURACY_FLOOR: the rule)
    left_out: dict  # path -> why it was not a candidate (not installed, refused this model, below the floor)
    measured_s: float  # seconds the measurement took when it was made (attach and timing)
    cpu: dict  # the CPU it was measured on: its name and capabilities (hf_vanilla.precision.cpu_capabilities)
    cached: bool  # True where this process read the decision from the file instead of measuring
    file: str | None  # the JSON file the decision is kept in (None: no writable cache folder)


def missing(path: Path) -> list:
    """The packages `path` needs that are not installed here (tests script it)."""
    return [package for package in path.packages if importlib.util.find_spec(package) is None]


def use_auto(model, precision: str = "f32", threads: int | None = None, cache_dir=None):
    """Run `model` (a vanilla model in eval mode) on the path measured fastest for it here (the module docstring),
    and return it. `precision`: "f32" (float32 paths only, the default) or "fastest" (int8 and bf16 paths too, at
    the accuracy rule's floor or above). `threads`: the engines' (default torch's `get_num_threads()`). `cache_dir`:
    where graphs and the decision are kept. Calling it again (another thread count, a new version) measures again
    where the kept decision does not apply. `auto_choice(model)` says what was chosen."""
    if precision not in PRECISIONS:
        raise ValueError(f"use_auto: precision={precision!r} is not one of {PRECISIONS}: 'f32' measures the float32 "
                         f"paths, 'fastest' also int8 and bf16 at no lower accuracy than the int8 engines'.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"use_auto: threads={threads!r} must be a whole number of threads, 1 or more.")
    if model.training:
        raise ValueError("runtime='auto' runs inference only: call model.eval() first.")
    take_off(model)
    threads = threads or torch.get_num_threads()
    paths, left_out = _candidates(precision)
    if len(paths) == 1:  # PyTorch alone: nothing to measure, nothing to keep
        _CHOICES[model] = AutoChoice("pytorch", precision, {}, {}, {}, left_out, 0.0, _cpu(), False, None)
        logger.info("runtime='auto': eager PyTorch (no engine installed: %s)", "; ".join(left_out.values()))
        return model
    file = _decision_file(model, precision, threads, paths, cache_dir)
    kept = _read(file, paths)
    if kept is not None:
        record = AutoChoice(**kept, cached=True, file=str(file))
        logger.info("runtime='auto': %s, as measured before (%s)", record.runtime, file)
    else:
        record = _measure(model, precision, threads, cache_dir, paths, left_out)
        busy = saturated()
        if busy:
            logger.info("runtime='auto': the decision is not kept: the machine was saturated while it measured (%s); "
                        "the next load measures again", busy)
        else:
            record.file = _write(file, record)
    path = BY_NAME[record.runtime]
    if path.runtime is not None:
        _apply(model, path.runtime, threads=threads, cache_dir=cache_dir, **dict(path.options))
        _keep_sizes(model, record)
    _CHOICES[model] = record
    return model


def auto_choice(model) -> AutoChoice | None:
    """What `use_auto` chose for `model` (None: it did not run on this model in this process)."""
    return _CHOICES.get(model)


# ---- candidates -----------------------------------------------------------------------------------------------------


def _candidates(precision: str) -> tuple[list, dict]:
    """(the paths to measure, {path: why not} for the others)."""
    paths, left_out = [], {}
    for path in PATHS:
        if path.precision != "f32" and precision != "fastest":
            continue
        if path.precision == "bf16" and not bf16_is_fast():
            left_out[path.name] = "this CPU multiplies bf16 no faster than float32 (hf_vanilla.precision.bf16_is_fast)"
        elif missing(path):
            left_out[path.name] = f"{', '.join(missing(path))} not installed"
        else:
            paths.append(path)
    return paths, left_out


def _encoder(model):
    """The module an engine is put in front of, which the measurement calls: the encoder of an encoder-decoder, else
    the BERT-style body."""
    return model.get_encoder() if model.config.is_encoder_decoder else model.base_model


def requests(config) -> dict:
    """The two requests measured, by name: {"short": inputs, "padded": inputs} (ids spread over the vocabulary, as
    `hf_vanilla.export.example_inputs` spreads them; rows right-padded)."""
    limit = config.max_position_embeddings - getattr(config, "position_offset", 0)
    made = {}
    for name, lengths in (("short", SHORT), ("padded", PADDED)):
        lengths = [min(length, limit) for length in lengths]
        T = max(lengths)
        ids = (torch.arange(len(lengths) * T).view(len(lengths), T) * 7919 + 5) % config.vocab_size
        mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
        made[name] = {"input_ids": ids.masked_fill(mask == 0, config.pad_token_id or 0), "attention_mask": mask}
    return made


# ---- measuring ------------------------------------------------------------------------------------------------------


def runner(model, path: Path, inputs: dict):
    """A call of `model`'s encoder on `inputs`, as `path` runs it: the hidden states (tests wrap it)."""
    encoder = _encoder(model)

    def run():
        with torch.inference_mode():
            return encoder(**inputs, return_dict=True).last_hidden_state
    return run


def _measure(model, precision, threads, cache_dir, paths, left_out) -> AutoChoice:
    """Attach each path to its own copy of `model`, check the reduced ones' accuracy, time them all in balanced
    orders, each request as such requests come (the module docstring), and choose."""
    started = time.perf_counter()
    inputs = requests(model.config)
    models = {}
    for path in paths:
        if path.runtime is None:
            models[path.name] = model
            continue
        try:
            models[path.name] = _apply(copy.deepcopy(model), path.runtime, threads=threads,
                                              cache_dir=cache_dir, **dict(path.options))
        except (ValueError, RuntimeError, ImportError) as error:  # the engines' refusals: this model, this machine
            left_out[path.name] = str(error).splitlines()[0]
            logger.info("runtime='auto': %s left out: %s", path.name, left_out[path.name])
    for name, candidate in models.items():  # the engine's own path on the measured requests
        for request in inputs.values():
            _force_engine(candidate, request)
    runs = {name: {request: runner(candidate, BY_NAME[name], inputs[request]) for request in inputs}
            for name, candidate in models.items()}
    accuracy = _accuracy(runs, inputs["padded"]["attention_mask"], left_out)
    attached = time.perf_counter() - started
    times = _time(runs)
    effective = {name: {request: _effective(name, request, times) for request in inputs} for name in times}
    chosen = _choose(effective)
    record = AutoChoice(chosen, precision, _ms(effective), _ms(times), accuracy, left_out,
                        time.perf_counter() - started, _cpu(), False, None)
    logger.info("runtime='auto': measured %d paths in %.2f s (%.2f s attaching them, %.2f s timing): %s; ms short / "
                "padded: %s", len(times), record.measured_s, attached, record.measured_s - attached, chosen,
                ", ".join(f"{name} {ms['short']:.2f} / {ms['padded']:.2f}" for name, ms in record.times_ms.items()))
    for candidate in models.values():
        if candidate is not model:
            take_off(candidate)
    del models, runs  # the copies and their engines (a model's size each) go now, not at some later collection
    gc.collect()
    return record


def _force_engine(model, request: dict) -> None:
    """Every engine in front of `model`'s modules answers `request`'s size itself: the measurement times the engine's
    own path, and PyTorch's apart (`_effective` then does what the per-size choice would)."""
    key = key_of(request["attention_mask"].shape[0], int(request["attention_mask"].sum()))
    for module in model.modules():
        decisions = getattr(vars(module).get("forward"), "choice", None)
        if isinstance(decisions, measure.MeasuredChoice):
            decisions.decide(key, True)


def _accuracy(runs: dict, mask: torch.Tensor, left_out: dict) -> dict:
    """The lowest token cosine of each reduced-precision path against float32 PyTorch at the padded request's real
    tokens; a path below ACCURACY_FLOOR leaves `runs` (the rule of the module docstring)."""
    reduced = [name for name in runs if BY_NAME[name].precision != "f32"]
    if not reduced:
        return {}
    real = mask.bool()
    expected = runs["pytorch"]["padded"]()[real].double()
    accuracy = {}
    for name in reduced:
        actual = runs[name]["padded"]()[real].double()
        accuracy[name] = torch.nn.functional.cosine_similarity(actual, expected, dim=-1).min().item()
        if not accuracy[name] >= ACCURACY_FLOOR:  # NaN included
            left_out[name] = f"lowest token cosine {accuracy[name]:.4f} < {ACCURACY_FLOOR}"
            del runs[name]
    return accuracy


def _time(runs: dict) -> dict:
    """{path: {request: median seconds}}: each path's first calls untimed (a compilation of the request's own shape
    comes at the second: OpenVINO's `static_shapes`; PyTorch's first calls of a shape time its matrix kernels, and
    a call that did is not counted, as in runtimes/choice.py), then rounds, at least ROUNDS and until BUDGET_S seconds
    have passed since the first (untimed calls included), read on `measure.clock`, each request timed as such
    requests come: the short query `QUERIES` times per path and round, each call after IDLE_S of sleep and after
    another path's call (balanced orders); the padded batch in a block per path and round, back to back, its first
    call not timed (it pays for the previous path's threads), the median of the BLOCK others. A path's time at a
    request is the median of its samples (single calls, block medians)."""
    names = list(runs)
    for calls in runs.values():
        for run in calls.values():
            run()
            for _ in range(WARM_CALLS):  # on until a call calibrates no matrix kernel (hf_vanilla/kernels.py)
                before = measure.timed_calls()
                run()
                if measure.timed_calls() == before:
                    break
    seconds = {name: {request: [] for request in runs[name]} for name in names}

    def timed(run, samples: list) -> None:
        before, start = measure.timed_calls(), measure.clock()
        run()
        if measure.timed_calls() == before:  # a call that also timed kernels is slower than it will be
            samples.append(measure.clock() - start)

    orders, rounds, started = measure.balanced_orders(len(names)), 0, measure.clock()
    while rounds < ROUNDS or measure.clock() - started < BUDGET_S:
        for query in range(QUERIES):
            for index in orders[(rounds * QUERIES + query) % len(orders)]:
                measure.sleep(IDLE_S)
                timed(runs[names[index]]["short"], seconds[names[index]]["short"])
        for index in orders[rounds % len(orders)]:
            run, block = runs[names[index]]["padded"], []
            run()
            for _ in range(BLOCK):
                timed(run, block)
            if block:
                seconds[names[index]]["padded"].append(statistics.median(block))
        rounds += 1
    return {name: {request: statistics.median(samples) if samples else float("inf") for request, samples in by.items()}
            for name, by in seconds.items()}


def _effective(name: str, request: str, times: dict) -> float:
    """What `name` takes at `request` once the per-size choice has decided: its engine where the choice does not
    measure the request (one without padding, or an engine at a reduced precision: `choice.measures`) or where the
    engine was at least CHOICE_MIN_GAIN faster than PyTorch, else PyTorch (an engine path runs PyTorch there)."""
    pytorch = times["pytorch"][request]
    if name == "pytorch":
        return pytorch
    dense = len(set(SHORT if request == "short" else PADDED)) == 1  # every row of the request as long
    if not measures(BY_NAME[name].precision, dense):
        return times[name][request]
    return times[name][request] if pytorch >= CHOICE_MIN_GAIN * times[name][request] else pytorch


def _choose(effective: dict) -> str:
    """The path of least geometric mean time over the requests, or one earlier in PATHS within TIE of it."""
    score = {name: math.exp(statistics.fmean(math.log(max(t, 1e-12)) for t in by.values()))
             for name, by in effective.items()}
    best = min(score.values())
    return next(path.name for path in PATHS if path.name in score and score[path.name] <= TIE * best)


def _ms(times: dict) -> dict:
    return {name: {request: 1e3 * seconds for request, seconds in by.items()} for name, by in times.items()}


def _keep_sizes(model, record: AutoChoice) -> None:
    """The per-size decisions of the measured requests, kept on the chosen engine (the engine where it was at least
    CHOICE_MIN_GAIN faster than PyTorch)."""
    engine, pytorch = record.engine_ms.get(record.runtime, {}), record.engine_ms.get("pytorch", {})
    for request, inputs in requests(model.config).items():
        if request not in engine or request not in pytorch:
            continue
        mask = inputs["attention_mask"]
        key = key_of(mask.shape[0], int(mask.sum()))
        faster = pytorch[request] >= CHOICE_MIN_GAIN * engine[request]
        for module in model.modules():
            decisions = getattr(vars(module).get("forward"), "choice", None)
            if isinstance(decisions, measure.MeasuredChoice):
                decisions.decide(key, faster)


# ---- the kept decision ---------------------------------------------------------------------------------------------


def _cpu() -> dict:
    return {"name": cpu_name(), "vendor": cpu_vendor()} | cpu_capabilities()


def versions() -> dict:
    """The versions the decision depends on (None: not installed)."""
    found = {"torch": torch.__version__, "transformers": transformers.__version__, "hf_vanilla": _own_version()}
    for package in ("onnxruntime", "openvino"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def decision_key(model, precision: str, threads: int, paths: list) -> str:
    """What the decision depends on, hashed (the module docstring)."""
    from .watch import structure_of

    meta = {"format": FORMAT, "structure": structure_of(_encoder(model)), "precision": precision,
            "threads": threads, "paths": [path.name for path in paths], "versions": versions(),
            "cpu": {"name": cpu_name(), "vendor": cpu_vendor(), "flags": sorted(cpu_flags())},
            "requests": [SHORT, PADDED]}
    return hashlib.sha256(json.dumps(meta, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def _decision_file(model, precision, threads, paths, cache_dir):
    """Where the decision for this model, machine and setting is kept (None: no cache folder)."""
    from .cache import GraphCache

    directory = GraphCache(cache_dir).directory
    return None if directory is None else directory / f"auto-{decision_key(model, precision, threads, paths)}.json"


def _read(file, paths: list) -> dict | None:
    """The kept decision's fields, or None (absent, or ignored with a warning where it is not one this code wrote)."""
    if file is None or not file.exists():
        return None
    try:
        data = json.loads(file.read_text())
        fields = {field.name for field in dataclasses.fields(AutoChoice)} - {"cached", "file"}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != file.stem[5:]:
            raise ValueError("not a decision of this version for this key")
        record = data["choice"]
        if set(record) != fields or record["runtime"] not in {path.name for path in paths}:
            raise ValueError("fields or path unknown")
        for table in ("times_ms", "engine_ms"):
            if not isinstance(record[table], dict) or not all(
                    isinstance(by, dict) and all(isinstance(ms, (int, float)) and ms > 0 for ms in by.values())
                    for by in record[table].values()):
                raise ValueError(f"{table} is not milliseconds per path and request")
        if not isinstance(record["measured_s"], (int, float)) or not all(
                isinstance(record[table], dict) for table in ("accuracy", "left_out", "cpu")) \
                or record["precision"] not in PRECISIONS:
            raise ValueError("a field of the wrong type")
        return record
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:  # json's errors are ValueErrors
        warnings.warn(f"runtime='auto': ignored the kept decision {file} ({type(error).__name__}: {error}); "
                      f"measuring again.", stacklevel=4)
        return None


def saturated() -> str | None:
    """Why this machine is too busy for a measurement worth keeping (more runnable threads on average over the last
    minute than cores this process may use), or None. Measured on two cores under a load of 6-9, every engine read
    level with PyTorch where it is 2.6x faster on the quiet machine (docs/performance.md): such a decision serves the
    process that made it, and is not written for the next."""
    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (OSError, AttributeError):  # no load average or affinity here (not Linux): nothing to go by
        return None
    return f"load average {load:.1f} on {cores} cores" if load > cores else None


def _write(file, record: AutoChoice) -> str | None:
    """Keep the decision (atomically; a folder that cannot be written keeps nothing, with a log line)."""
    from .cache import write_atomic

    if file is None:
        return None
    choice = {name: value for name, value in dataclasses.asdict(record).items() if name not in ("cached", "file")}
    try:
        write_atomic(file, json.dumps({"format": FORMAT, "key": file.stem[5:], "choice": choice}, indent=1).encode())
    except OSError as error:
        logger.info("runtime='auto': the decision is not kept (%s): the next load measures again", error)
        return None
    return str(file)


__all__ = ["ACCURACY_FLOOR", "AutoChoice", "PATHS", "auto_choice", "use_auto"]
