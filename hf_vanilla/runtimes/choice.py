"""Which path answers a request, the engine or PyTorch, decided per request size, the same way for every engine.

A model answers at the precision it was loaded at, from its first call. An engine at a reduced precision (int8,
bf16) answers every request it can compute: its PyTorch path computes float32 (int8, and bf16 from a float32 model)
or rounds otherwise (bf16), so measuring the two would answer one input two ways, up to 0.1 apart on bert-base.
Only a float32 engine is ever compared with PyTorch, whose answer is the same within the parity rule, so which one
ran never shows in the output, only in the time (`measures`).

A request without padding goes to the engine, unmeasured: PyTorch's one advantage, skipping the padding, is absent,
and the engine computes the same tokens from a compiled graph. In the dense cases of benchmarks/engines.py
(docs/performance.md) the engines were level with eager PyTorch on the long inputs and faster at 16 tokens, where
timing PyTorch would cost a call several of the engine's; the one dense case where the engine trailed, ONNX Runtime
after an idle gap on MiniLM 1x16, the measurement in blocks back to back had chosen as well.

A padded request is where PyTorch can win (docs/performance.md), and there the first calls of each request size
(rows and real tokens, each rounded up to a power of two, and the thread count) measure the two
(`hf_vanilla.measure`): PyTorch first, then the engine, one call each, both timed. Where one took `CHOICE_CLEAR`
times as long as the other, the size is decided there: the loser ran once, and the first ten calls of the size cost
(9 + r) / 10 of ten of the winner's, r the ratio (1.17 where the loser takes 2.7 times as long; 4 + 4 calls in
blocks, as before, cost 1.68). A closer gap costs little to go on measuring: the engine's block goes on, then
PyTorch's, each block's first call a warm-up (a call right after the other path's pays for its spinning threads),
until each has `CHOICE_CALLS` counted, and the size runs the engine only if PyTorch's median is at least
`CHOICE_MIN_GAIN` times its own. The loser then ran at most five times, each less than half a call slower (1.25).

An engine may have a partner (`OwnedEncoder.pair`, chosen by `runtime="auto"` at `precision="fastest"`):
requests of at least its `split` real tokens go to it, unmeasured, decided by the request alone.

PyTorch's calls are timed with the kernel choice pinned (`hf_vanilla.kernels.pinned`): products whose kernel is
still measured run F.linear, untimed, so no call is slowed by kernel timing and none is dropped for it (the kernels
are measured by PyTorch's calls once it is chosen). `HF_VANILLA_RUNTIME_CHOICE=engine` sends every call an engine
can answer to it (the tests use it to test an engine itself).
"""

import os

import numpy as np
import torch

from .. import kernels, measure
from .attached import engine_of

# "measure" (the default) or "engine"; read at import, and read again by the engines on every call.
CHOICE = os.environ.get("HF_VANILLA_RUNTIME_CHOICE", "measure")
if CHOICE not in ("measure", "engine"):
    raise ValueError(f"HF_VANILLA_RUNTIME_CHOICE={CHOICE!r}: use measure (the default) or engine.")
CHOICE_CLEAR = 1.5  # one path this many times slower than the other on their first calls: decided there
CHOICE_CALLS = 3  # else counted calls of each path per request size, each block's first call left out
CHOICE_MIN_GAIN = 1.05  # the engine must be this much faster: noise can only leave a size on PyTorch


def engine_or_pytorch(engine: str) -> measure.MeasuredChoice:
    """A fresh choice between PyTorch (timed first) and `engine` (the challenger), per request size."""
    return measure.MeasuredChoice(f"runtime: {engine}?", ("pytorch", engine), challenger=engine, calls=CHOICE_CALLS,
                                  min_gain=CHOICE_MIN_GAIN, warmup=1, clear=CHOICE_CLEAR)


def measures(precision: str, dense: bool) -> bool:
    """Whether a request (`dense`: without padding) to an engine computing at `precision` is measured against
    PyTorch: only a float32 engine's padded requests are; the engine answers every other."""
    return precision == "f32" and not dense


def compared(decisions: measure.MeasuredChoice | None, precision: str) -> measure.MeasuredChoice | None:
    """`decisions`, an engine's choice, where the engine computes at `precision` as PyTorch does (float32); None
    where it answers every request it can (`route`)."""
    return decisions if measures(precision, dense=False) else None


def key_of(rows: int, tokens: int) -> tuple:
    """What the choice is made per, for a request of `rows` rows holding `tokens` real tokens: both rounded up to a
    power of two, and torch's thread count (both engines use it)."""
    return 1 << (rows - 1).bit_length(), 1 << (max(tokens, 1) - 1).bit_length(), torch.get_num_threads()


def route(decisions: measure.MeasuredChoice | None, mask: np.ndarray,
          split: int | None = None) -> tuple[str, tuple | None]:
    """Which path answers a request whose attention mask is `mask`, decided here once per call for every engine:
    (path, None) where the request is not measured ("partner": the engine's partner, for a request of
    `split` real tokens or more, where the engine has one, `OwnedEncoder.pair`; "dense": the engine's fastest call,
    for a request without padding; "engine"; "pytorch"), the engine whenever `decisions` is None (an engine at a
    reduced precision, `compared`) or `CHOICE` says so; (path, key) while `decisions` still measures the size:
    "engine" or "pytorch", whose call `timed` times under `key`. The engine then calls that path itself, so a
    decided request is routed once and needs no callback."""
    rows, tokens = mask.shape[0], int(np.count_nonzero(mask))  # a mask of 1 and 0 (`batches.feeds_for`)
    if split is not None and tokens >= split and CHOICE != "engine":
        return "partner", None
    if tokens == mask.size:
        return "dense", None
    if decisions is None or CHOICE == "engine":
        return "engine", None
    key = key_of(rows, tokens)
    decided = decisions.decision(key)
    if decided is not None:
        return "engine" if decided else "pytorch", None
    return "pytorch" if decisions.turn(key) == "pytorch" else "engine", key


def timed(decisions: measure.MeasuredChoice, key: tuple, path: str, call):
    """`call()` (a call of no argument), the output of `path` ("engine" or "pytorch", from `route`) for a request of
    size `key`, timed for `decisions`; PyTorch's with the kernel choice pinned (the module docstring)."""
    if path != "pytorch":
        return decisions.time(key, decisions.challenger, call)
    with kernels.pinned():
        return decisions.time(key, path, call)


def runtime_choices(model) -> dict[tuple, bool | None]:
    """Per padded request size (rows and real tokens rounded up to powers of two, threads) seen by the float32
    engines in front of `model`'s modules: True where the engine answers, False where PyTorch does, None while the
    first calls still measure the two. Requests without padding, and every request to an engine at a reduced
    precision, go to the engine unmeasured and are not listed."""
    choices = {}
    for module in model.modules():
        engine = engine_of(module)
        decisions = compared(getattr(engine, "choice", None), getattr(engine, "precision", "f32"))
        if isinstance(decisions, measure.MeasuredChoice):
            choices.update(decisions.decisions(pending=True))
    return choices
