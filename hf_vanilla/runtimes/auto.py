"""`runtime="auto"`: the engine that is fastest for this model on this machine, measured there, once.

    model = AutoModel.from_pretrained(path, runtime="auto")                                   # float32
    model = AutoModel.from_pretrained(path, runtime="auto", runtime_options={"precision": "fastest"})
    from hf_vanilla.runtime_registry import apply_runtime                                     # on a model in hand
    model = apply_runtime(model, "auto")
    from hf_vanilla.runtimes.auto import auto_choice
    auto_choice(model)   # which path runs, why, and what each measured

Why. Which way of running an encoder is fastest depends on the CPU, the request size and the libraries installed,
and no table answers for a CPU it was not measured on. So the choice is measured where the model runs.

What it does (docs/deploy.md, "How auto measures and chooses", gives each step's reason). Every installed path of
`PATHS` (with `precision="fastest"` also the int8 and, where bf16 is fast, bf16 forms whose expected lowest token
cosine on a sample of real text reaches `ACCURACY_FLOOR`: hf_vanilla/runtimes/accuracy.py) is attached to its own
copy of the model, over the model's tensors, and timed on the encoder at `SHORT`, `PADDED` and `LARGE` requests as
such requests come (the short query after `IDLE_S` of idle, batches back to back in blocks), in balanced orders, for
at least `ROUNDS` rounds and until `BUDGET_S` seconds have passed; a path's time is its samples' median. The path of
least geometric mean time wins, one within `TIE` of it at every request and earlier in `PATHS` (fewer restrictions)
preferred; a runner-up within `NOISE` has the next load measure once more. At "fastest", the sizes where another
path leads go to it (`_split`). The decision is kept beside the graphs (hf_vanilla/runtimes/decision.py), unless it
was measured on a saturated machine (`saturated`).

What it takes and costs. A float32 model on the CPU (one loaded in bf16 is refused, naming the fix); every engine's
form of the weights at once while it measures, freed after; seconds at the first load. `runtime=None` stays eager
PyTorch: auto measures and may hand the weights to an engine that refuses training and edits, which an existing
caller did not ask for.
"""

import functools
import gc
import importlib.util
import logging
import math
import os
import statistics
import time
import warnings
import weakref

import torch

from .. import measure
from ..precision import bf16_is_fast, cpu_capabilities, cpu_name, cpu_vendor
from .accuracy import REFERENCE_TOKENS, expected_lowest, sample_batches, token_cosines
from .attached import engine_of, take_off
from .choice import CHOICE_MIN_GAIN, key_of, measures
from .decision import (BY_NAME, LARGE, PADDED, PATHS, PRECISIONS, SHORT, AutoChoice, Path, decision_file,
                       encoder_of, partner_of, read_decision, requests, write_decision)
from .holding import sharing_copy
from .mapped import return_freed_memory
from .options import checked

logger = logging.getLogger(__name__)


BUDGET_S = 2.0  # seconds of rounds, all paths together (ROUNDS at least, however long they take)
ROUNDS = 3  # rounds at least, whatever the budget
QUERIES = 3  # timed calls of the short query per path and round, each after IDLE_S and another path's call
IDLE_S = 0.05  # seconds of idle before each short query, benchmarks/engines.py's idle gap (why: docs/deploy.md)
BLOCK = 3  # timed calls of the padded batch per block, after its first (not timed)
LARGE_BLOCK = 1  # of the large batch: its calls are long, their spread small beside them, and they cost the load
WARM_CALLS = 40  # untimed calls of each path and request at most, until PyTorch's kernels are chosen
TIE = 1.02  # a path this close to the fastest at every request, earlier in PATHS, is preferred
ACCURACY_FLOOR = 0.984  # lowest token cosine of a reduced-precision path (why this one: docs/deploy.md)
NOISE = 1.05  # a chosen path whose runner-up measured within this factor is measured again once (docs/deploy.md)


_CHOICES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its AutoChoice


def missing(path: Path) -> list:
    """The packages `path` needs that are not installed here (tests script it)."""
    return [package for package in path.packages if importlib.util.find_spec(package) is None]


def use_auto(model, precision: str = "f32", threads: int | None = None, cache_dir=None, sample=None, *, apply_runtime):
    """Run `model` (a vanilla model in eval mode, float32 on the CPU) on the path measured fastest for it here (the
    module docstring), and return it. `precision`: "f32" (float32 paths only, the default) or "fastest" (int8 and bf16
    paths too, at the accuracy rule's floor or above). `threads`: the engines' (default torch's `get_num_threads()`).
    `cache_dir`: where graphs and the decision are kept. `sample`: the text "fastest" checks accuracy on
    (hf_vanilla/runtimes/accuracy.py: texts, or tokenized batches; None: the built-in sentences). Calling it again
    (another thread count, a new version) measures again where the kept decision does not apply. `auto_choice(model)`
    says what was chosen. `apply_runtime`: the registry's, handed over by it (runtime_registry.py says why)."""
    if precision not in PRECISIONS:
        raise ValueError(f"use_auto: precision={precision!r} is not one of {PRECISIONS}: 'f32' measures the float32 "
                         f"paths, 'fastest' also int8 and bf16 at no lower accuracy than the int8 engines'.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"use_auto: threads={threads!r} must be a whole number of threads, 1 or more.")
    checked("use_auto", precision, PRECISIONS, threads, cache_dir=cache_dir)  # cache_dir, as every runtime checks it
    if model.training:
        raise ValueError("runtime='auto' runs inference only: call model.eval() first.")
    _refuse_other_dtypes(model)
    batches, text = sample_batches(model, sample) if sample is not None or precision == "fastest" else (None, "")
    take_off(model)
    threads = threads or torch.get_num_threads()
    paths, left_out = _candidates(precision)
    if precision != "fastest":  # a sample given is read (a wrong one refused) and not needed
        batches, text = None, ""
    elif batches is None:  # nothing to check a reduced path's accuracy on
        warnings.warn(f"runtime='auto' with precision='fastest' measures the float32 paths only: {text}.",
                      stacklevel=2)
        left_out |= {path.name: text for path in paths if path.precision != "f32"}
        paths = [path for path in paths if path.precision == "f32"]
    if len(paths) == 1:  # PyTorch alone: nothing to measure, nothing to keep
        _CHOICES[model] = AutoChoice.pytorch_alone(precision, left_out, _cpu())
        logger.info("runtime='auto': eager PyTorch (no engine installed: %s)", "; ".join(left_out.values()))
        return model
    file = decision_file(model, precision, threads, paths=paths, cache_dir=cache_dir, batches=batches)
    kept = read_decision(file, paths)
    kept = None if kept is None else AutoChoice(**kept, cached=True, file=str(file))
    record = kept if kept is not None and kept.settled else None
    if record is not None:
        try:
            _attach(model, record, threads, cache_dir=cache_dir, apply_runtime=apply_runtime)
            logger.info("runtime='auto': %s, as measured before (%s)", record.runtime, file)
        except (ValueError, RuntimeError, ImportError) as error:  # the engines' refusals: this model, this machine
            take_off(model)
            warnings.warn(f"runtime='auto': ignored the kept decision {file} ({record.runtime} refused this model: "
                          f"{(str(error).splitlines() or [type(error).__name__])[0]}); measuring again.",
                          stacklevel=2)
            kept = record = None
    if record is None:
        record = _measure(model, precision, threads, cache_dir=cache_dir, paths=paths, left_out=left_out,
                          batches=batches, sample=text, apply_runtime=apply_runtime)
        if kept is not None:  # an unsettled decision, measured once more
            record = _settle(kept, record)
        if busy := saturated():
            logger.info("runtime='auto': the decision is not kept: the machine was saturated while it measured (%s); "
                        "the next load measures again", busy)
        else:
            record.file = write_decision(file, record)
        _attach(model, record, threads, cache_dir=cache_dir, apply_runtime=apply_runtime)
    _CHOICES[model] = record
    return model


def auto_choice(model) -> AutoChoice | None:
    """What `use_auto` chose for `model` (None: it did not run on this model in this process)."""
    return _CHOICES.get(model)


def _attach(model, record: AutoChoice, threads: int, *, cache_dir, apply_runtime) -> None:
    """Put the engine of `record`'s path on `model` (through `apply_runtime`), with the per-size decisions of the
    measured requests."""
    path = BY_NAME[record.runtime]
    if path.runtime is not None:
        apply_runtime(model, path.runtime, threads=threads, cache_dir=cache_dir, **dict(path.options))
        _keep_sizes(model, record)
        if record.split is not None:
            make = functools.partial(partner_of, record.split["path"], threads, cache_dir, apply_runtime)
            for module in model.modules():
                if hasattr(engine_of(module), "pair"):
                    engine_of(module).pair(record.split["tokens"], make)
    elif path.precision == "bf16":  # eager PyTorch in bfloat16, every request
        model.to(torch.bfloat16)


def _refuse_other_dtypes(model) -> None:
    """Refuse a model that is not float32 on the CPU before anything is measured or taken off, naming the fix: the
    engines answer float32 from it, which a bf16 head cannot take (the module docstring)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and (tensor.dtype != torch.float32 or tensor.device.type != "cpu"):
            raise ValueError(
                f"runtime='auto' measures a float32 model on the CPU, and {name} is {tensor.dtype} on "
                f"{tensor.device}: load it with dtype=torch.float32 (runtime_options={{'precision': 'fastest'}} then "
                f"measures its bf16 and int8 forms too, where they are faster and accurate enough), or with "
                f"runtime=None to run it as it is on PyTorch.")


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


# ---- measuring ------------------------------------------------------------------------------------------------------


def runner(model, path: Path, inputs: dict):
    """A call of `model`'s encoder on `inputs`, as `path` runs it: the hidden states (tests wrap it)."""
    encoder = encoder_of(model)

    def run():
        with torch.inference_mode():
            return encoder(**inputs, return_dict=True).last_hidden_state
    return run


def _measure(model, precision, threads, *, cache_dir, paths, left_out, batches, sample, apply_runtime) -> AutoChoice:
    """Attach each path to its own copy of `model` (through `apply_runtime`), check the reduced ones' accuracy on
    `batches` (the sample), time them all in balanced orders, each request as such requests come (the module
    docstring), and choose."""
    started = time.perf_counter()
    inputs = requests(model.config)
    models = {}
    for path in paths:
        if path.runtime is None:  # the model itself, or a bfloat16 copy of it
            models[path.name] = model if path.precision == "f32" else sharing_copy(model).to(torch.bfloat16)
            continue
        try:
            models[path.name] = apply_runtime(sharing_copy(model), path.runtime, threads=threads,
                                              cache_dir=cache_dir, **dict(path.options))
        except (ValueError, RuntimeError, ImportError) as error:  # the engines' refusals: this model, this machine
            left_out[path.name] = str(error).splitlines()[0]
            logger.info("runtime='auto': %s left out: %s", path.name, left_out[path.name])
    accuracy = _accuracy(models, batches, left_out, sample)
    for name, candidate in models.items():  # the engine's own path on the measured requests
        for request in inputs.values():
            _decide(candidate, request, engine=True)
    runs = {name: {request: runner(candidate, BY_NAME[name], inputs[request]) for request in inputs}
            for name, candidate in models.items()}
    attached = time.perf_counter() - started
    times = _time(runs)
    effective = {name: {request: _effective(name, request, times) for request in inputs} for name in times}
    chosen, margin = _choose(effective)
    split = _split(chosen, precision, models, inputs=inputs, effective=effective)
    record = AutoChoice(chosen, precision, times_ms=_ms(effective), engine_ms=_ms(times), accuracy=accuracy,
                        sample=sample if accuracy else "", left_out=left_out,
                        measured_s=time.perf_counter() - started, cpu=_cpu(), margin=margin,
                        settled=margin is None or margin >= NOISE, cached=False, file=None, split=split)
    logger.info("runtime='auto': measured %d paths in %.2f s (%.2f s attaching them, %.2f s timing): %s; ms short / "
                "padded: %s", len(times), record.measured_s, attached, record.measured_s - attached, chosen,
                ", ".join(f"{name} {ms['short']:.2f} / {ms['padded']:.2f}" for name, ms in record.times_ms.items()))
    for candidate in models.values():
        if candidate is not model:
            take_off(candidate)
    del models, runs  # the copies and their engines go now, not at some later collection
    gc.collect()
    return_freed_memory()  # and the C heap gives back what they held
    return record


def _decide(model, request: dict, engine: bool) -> None:
    """Every engine in front of `model`'s modules decides `request`'s size: it answers it itself (`engine`) or lets
    PyTorch. The measurement forces the engine, to time its own path and PyTorch's apart (`_effective` then does what
    the per-size choice would); the chosen engine keeps what was measured (`_keep_sizes`)."""
    mask = request["attention_mask"]
    key = key_of(mask.shape[0], int(mask.sum()))
    for module in model.modules():
        decisions = getattr(engine_of(module), "choice", None)
        if isinstance(decisions, measure.MeasuredChoice):
            decisions.decide(key, engine)


def _accuracy(models: dict, batches: list | None, left_out: dict, sample: str) -> dict:
    """The lowest token cosine each reduced-precision path is expected to reach against float32 PyTorch
    (`models["pytorch"]`, the model itself), predicted from its cosines at the real tokens of the sample's `batches`,
    each answered by the path's engine (`accuracy.expected_lowest`); a path below ACCURACY_FLOOR leaves `models`, its
    engine taken off (the rule of the module docstring)."""
    reduced = [name for name in models if BY_NAME[name].precision != "f32"]
    if not reduced:
        return {}
    expected = [runner(models["pytorch"], BY_NAME["pytorch"], batch)() for batch in batches]
    accuracy = {}
    for name in reduced:
        cosines = []
        for batch, want in zip(batches, expected):
            _decide(models[name], batch, engine=True)
            cosines.append(token_cosines(runner(models[name], BY_NAME[name], batch)(), want, batch["attention_mask"]))
        accuracy[name] = expected_lowest(torch.cat(cosines))
        if not accuracy[name] >= ACCURACY_FLOOR:  # NaN included
            left_out[name] = (f"lowest token cosine {accuracy[name]:.4f} < {ACCURACY_FLOOR} on {sample} (expected over "
                              f"{REFERENCE_TOKENS:,} tokens of such text)")
            logger.info("runtime='auto': %s left out: %s", name, left_out[name])
            take_off(models.pop(name))
    return accuracy


def _time(runs: dict) -> dict:
    """{path: {request: median seconds}}: each path's first calls untimed (PyTorch's first calls of a shape time its
    matrix kernels, and a call that did is not counted), then rounds, at least ROUNDS and until BUDGET_S seconds have
    passed since the first (untimed calls included), read on `measure.clock`, each request timed as such requests come:
    the short query `QUERIES` times per path and round, each call after IDLE_S of sleep and after another path's call
    (balanced orders); each batch (the padded one, the large one) in a block per path and round, back to back, its first
    call not timed (it pays for the previous path's threads), the median of the BLOCK (LARGE_BLOCK) others. A path's
    time at a request is the median of its samples (single calls, block medians)."""
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
    batches = [request for request in runs[names[0]] if request != "short"]
    while rounds < ROUNDS or measure.clock() - started < BUDGET_S:
        for query in range(QUERIES if "short" in runs[names[0]] else 0):
            for index in orders[(rounds * QUERIES + query) % len(orders)]:
                measure.sleep(IDLE_S)
                timed(runs[names[index]]["short"], seconds[names[index]]["short"])
        for request in batches:
            for index in orders[rounds % len(orders)]:
                run, block = runs[names[index]][request], []
                run()
                for _ in range(BLOCK if request == "padded" else LARGE_BLOCK):
                    timed(run, block)
                if block:
                    seconds[names[index]][request].append(statistics.median(block))
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
    dense = len(set({"short": SHORT, "padded": PADDED, "large": LARGE}[request])) == 1  # every row as long
    if not measures(BY_NAME[name].precision, dense):
        return times[name][request]
    return times[name][request] if pytorch >= CHOICE_MIN_GAIN * times[name][request] else pytorch


def _split(chosen: str, precision: str, models: dict, *, inputs: dict, effective: dict) -> dict | None:
    """{"tokens": n, "path": name}: from how many real tokens path `name` answers beside the chosen engine
    (`OwnedEncoder.pair`), or None. For each other path, over the measured requests in order of real tokens, at the
    first where it was faster (by `TIE`) with the engine faster at the one before, its split is where the two times,
    each taken as linear in real tokens between those two requests, cross; of the paths with one, the fastest at the
    largest request. None at float32 (`precision="fastest"` alone trades memory for it), where the chosen path is not
    an engine holding its weights, or no path leads from some request on (a size is answered one way from its first
    call: the split is decided here, never on a user's calls)."""
    held = engine_of(encoder_of(models[chosen])) if chosen in models else None
    if precision != "fastest" or not hasattr(held, "pair"):
        return None
    tokens = {request: int(inputs[request]["attention_mask"].sum()) for request in inputs}
    ours, splits = effective[chosen], {}
    for partner in (name for name in effective if name != chosen):
        points = sorted((tokens[request], ours[request], effective[partner][request]) for request in tokens)
        for (before, engine_before, other_before), (n, engine, other) in zip(points, points[1:]):
            if other * TIE < engine and other_before * TIE >= engine_before:
                lead_before, lead = engine_before - other_before, engine - other  # its lead, <= 0 then > 0
                cross = before + (n - before) * -lead_before / (lead - lead_before)
                splits[partner] = min(n, max(before + 1, math.ceil(cross)))
                break
    if not splits:
        return None
    largest = max(tokens, key=tokens.get)
    partner = min(splits, key=lambda name: effective[name][largest])
    return {"tokens": splits[partner], "path": partner}


def _choose(effective: dict) -> tuple[str, float | None]:
    """(the path of least geometric mean time over the requests, or one earlier in PATHS within TIE of it at every
    request; its `_margin`). At every request, not in the mean: two paths that differ at one request alone (the
    short query, where PyTorch answers both engines' batches) would otherwise tie at a third of that difference,
    which TIE would then forgive."""
    score = _scores(effective)
    best = min(score, key=score.get)
    chosen = next(path.name for path in PATHS if path.name in score and all(
        seconds <= TIE * effective[best][request] for request, seconds in effective[path.name].items()))
    return chosen, _margin(score, chosen)


def _scores(times: dict) -> dict:
    """{path: geometric mean of its times over the requests}."""
    return {name: math.exp(statistics.fmean(math.log(max(t, 1e-12)) for t in by.values()))
            for name, by in times.items()}


def _margin(score: dict, chosen: str) -> float | None:
    """The next fastest path's score over `chosen`'s (None: no other path)."""
    others = [value for name, value in score.items() if name != chosen]
    return min(others) / score[chosen] if others else None


def _settle(kept: AutoChoice, measured: AutoChoice) -> AutoChoice:
    """The decision once an unsettled one (`kept`) is measured again: the new measurement's choice where it is sure
    of it (a margin of NOISE or more) or agrees, else of the two paths the one earlier in PATHS (fewer
    restrictions); settled either way."""
    unsure = measured.margin is not None and measured.margin < NOISE
    order = [path.name for path in PATHS]
    if unsure and kept.runtime in measured.times_ms and order.index(kept.runtime) < order.index(measured.runtime):
        logger.info("runtime='auto': %s and %s measured within %.2f of each other twice: %s, which has fewer "
                    "restrictions", kept.runtime, measured.runtime, NOISE, kept.runtime)
        measured.runtime, measured.split = kept.runtime, kept.split
        measured.margin = _margin(_scores(measured.times_ms), kept.runtime)
    measured.settled = True
    return measured


def _ms(times: dict) -> dict:
    return {name: {request: 1e3 * seconds for request, seconds in by.items()} for name, by in times.items()}


def _keep_sizes(model, record: AutoChoice) -> None:
    """The per-size decisions of the measured requests, kept on the chosen engine (the engine where it was at least
    CHOICE_MIN_GAIN faster than PyTorch)."""
    engine, pytorch = record.engine_ms.get(record.runtime, {}), record.engine_ms.get("pytorch", {})
    for request, inputs in requests(model.config).items():
        if request in engine and request in pytorch:
            _decide(model, inputs, engine=pytorch[request] >= CHOICE_MIN_GAIN * engine[request])


# ---- the machine measured on -----------------------------------------------------------------------------------------


def _cpu() -> dict:
    return {"name": cpu_name(), "vendor": cpu_vendor()} | cpu_capabilities()


def saturated() -> str | None:
    """Why this machine is too busy for a measurement worth keeping (more runnable threads on average over the last
    minute than cores this process may use), or None. Under such a load every engine measured level with PyTorch,
    even one several times faster on a quiet machine (docs/performance.md): such a decision serves the process that
    made it, and is not written for the next."""
    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (OSError, AttributeError):  # no load average or affinity here (not Linux): nothing to go by
        return None
    return f"load average {load:.1f} on {cores} cores" if load > cores else None


__all__ = ["ACCURACY_FLOOR", "AutoChoice", "BY_NAME", "PATHS", "auto_choice", "use_auto"]
