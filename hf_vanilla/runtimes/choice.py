"""Which engine answers a request: the engine or PyTorch, decided per request size, the same way for every engine.

Fed or owning its weights, an engine is much faster than eager PyTorch on short requests and no faster, sometimes
slower, on long or padded batches, where PyTorch skips the padding (docs/performance.md). So where both can answer,
the first calls of each request size (rows and real tokens, each rounded up to a power of two, and the thread
count) are answered by the engine, then by PyTorch, each in a block of calls, all timed (`hf_vanilla.measure`:
blocks, since a call right after the other's pays for its spinning threads), and after `CHOICE_CALLS`
timed calls of each (past each one's first) the size runs on the engine only if PyTorch took at least
`CHOICE_MIN_GAIN` times as long. Both give the same answer within the parity rule, so which one ran never shows in
the output. `HF_VANILLA_RUNTIME_CHOICE=engine` sends every call an engine can answer to it (the tests use it to test
an engine itself).
"""

import os

import numpy as np
import torch

from .. import measure

# "measure" (the default) or "engine"; read at import, and read again by the engines on every call.
CHOICE = os.environ.get("HF_VANILLA_RUNTIME_CHOICE", "measure")
if CHOICE not in ("measure", "engine"):
    raise ValueError(f"HF_VANILLA_RUNTIME_CHOICE={CHOICE!r}: use measure (the default) or engine.")
CHOICE_CALLS = 3  # timed calls of each path per request size, after its first
CHOICE_MIN_GAIN = 1.05  # the engine must be this much faster: noise can only leave a size on PyTorch


def engine_or_pytorch(engine: str) -> measure.MeasuredChoice:
    """A fresh choice between `engine` (the challenger) and PyTorch, per request size."""
    return measure.MeasuredChoice(f"runtime: {engine}?", (engine, "pytorch"), engine, CHOICE_CALLS,
                                  CHOICE_MIN_GAIN, warmup=1)


def key_of(rows: int, tokens: int) -> tuple:
    """What the choice is made per, for a request of `rows` rows holding `tokens` real tokens: both rounded up to a
    power of two, and torch's thread count (both engines use it)."""
    return 1 << (rows - 1).bit_length(), 1 << (max(tokens, 1) - 1).bit_length(), torch.get_num_threads()


def route(decisions: measure.MeasuredChoice, mask: np.ndarray) -> tuple[str, tuple | None]:
    """Which path answers a request whose attention mask is `mask`, decided here once per call for every engine:
    (path, None) where the size is decided ("dense": the engine's fastest call, for a request without padding;
    "engine"; "pytorch"), the engine whenever `CHOICE` says so; (path, key) while `decisions` still measures the
    size: "engine" or "pytorch", whose call `timed` times under `key`. The engine then calls that path itself, so
    a decided request enters this room once and comes back with no callback."""
    rows, tokens = mask.shape[0], int(mask.sum())
    key = None if CHOICE == "engine" else key_of(rows, tokens)
    decided = True if key is None else decisions.decision(key)
    if decided:
        return "dense" if tokens == mask.size else "engine", None
    if decided is not None:
        return "pytorch", None
    return "pytorch" if decisions.turn(key) == "pytorch" else "engine", key


def timed(decisions: measure.MeasuredChoice, key: tuple, path: str, call):
    """`call()` (a call of no argument), the output of `path` ("engine" or "pytorch", from `route`) for a request of
    size `key`, timed for `decisions`."""
    if path != "pytorch":
        return decisions.time(key, decisions.challenger, call)
    # A PyTorch call that also measured its products' kernels (kernels.py computes two products where it times one)
    # is not counted: it would make PyTorch look slower than it will be.
    measured = measure.timed_calls()
    start = measure.clock()
    output = call()
    if measure.timed_calls() == measured:
        decisions.record(key, path, measure.clock() - start)
    return output


def runtime_choices(model) -> dict[tuple, bool | None]:
    """Per request size (rows and real tokens rounded up to powers of two, threads) seen by the engines in front of
    `model`'s modules: True where the engine answers, False where PyTorch does, None while the first calls still
    measure the two."""
    choices = {}
    for module in model.modules():
        decisions = getattr(vars(module).get("forward"), "choice", None)
        if isinstance(decisions, measure.MeasuredChoice):
            choices.update(decisions.decisions(pending=True))
    return choices
