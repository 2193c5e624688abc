"""Which kernel computes a projection, and why.

Every projection in the model (W^Q, W^K, W^V, W^O, the feed-forward's W1 and W2, the heads) is a `VanillaLinear`:
an `nn.Linear` whose CPU float32 inference may run oneDNN's matmul instead of the BLAS call behind `F.linear`
(MKL's sgemm on x86 builds of torch). It is the same product of the same weights in another kernel, which differs
only in the order it sums (outputs within float32 rounding). It exists because MKL is slow on the skinny products
of small requests and generation, where oneDNN was measured faster (docs/performance.md has the figures).

Which of the two is faster depends on the CPU, the shape, the number of rows, the threads and the cache: the same
small projection was measured faster in oneDNN on one CPU and slower on another, so no size threshold is right on
all of them. So the choice is measured, per process, in the model (policy "measure", the
default): for each key (in_features, out_features, rows rounded up to a power of two and capped at 1024, torch's
thread count), the eligible calls time the two kernels until each has `CALIBRATION_CALLS` timings, and all return
F.linear's result; after them the key runs oneDNN only if F.linear's median time is at least `MIN_GAIN` times
oneDNN's. The margin means noise can only leave a product on F.linear (the kernel transformers' BERT uses), never
move it to a slower one. The timed kernel is always the first to read the weight in its call: inside a model the
other layers' weights have passed through the cache since, and the calibration calls, being the model's own, see
the weights as the model does. Two things would time something else than the kernel, and are kept out: a layer's
first call is not timed (its weight's first read after loading page-faults, and oneDNN builds its primitive for
the shape then), and each layer alternates between the kernels from one call to its next, so that both are timed
at every place in the model (alternating call by call within a forward timed oneDNN on every W^Q and W^V and
F.linear on every W^K and W^O, and so kept products on F.linear that oneDNN computes faster in a loop over the
model's weights). The timing, the per-layer turns and the
decision are hf_vanilla/measure.py's, shared with the other measured choices; `decisions()` shows what was decided.

`pinned()` pauses the measurement in one thread: its products whose key is still measured run F.linear, untimed (a
decided key runs its decision). The engines' choice between an engine and PyTorch (runtimes/choice.py) times
PyTorch's calls pinned: a call that also timed its kernels computes two products where it times one, and until its
keys were decided (twelve calls of the one-row pooler's key, six of each kernel) such calls could not be counted.

`HF_VANILLA_LINEAR_KERNEL` (read at import) or `kernels.POLICY` chooses another policy: "blas" (F.linear always:
bit for bit nn.Linear) or "onednn" (oneDNN for every eligible product, without measuring: the tests use it to run
oneDNN deterministically). With `torch.use_deterministic_algorithms(True)` every product is F.linear's, since a
measured choice may differ from one run to the next; `torch.backends.mkldnn.flags(enabled=False)` does the same.

What this module guarantees: outside eligible calls (inference, CPU, float32, plain tensors, at least
`MIN_WEIGHTS` weights), `VanillaLinear` is `nn.Linear` bit for bit, so training, autocast, GPUs, other dtypes,
tracing and export, torch.func transforms and quantized or sharded weights behave exactly as with `nn.Linear`.

It also holds the two predicates the rest of the package asks before doing anything data-dependent:
`is_tracing()` (compile, export, jit trace: graphs must not branch on values) and `is_transformed()`.
"""

import contextlib
import os
import platform
import threading
from functools import partial

import torch
from torch import nn

from .measure import MeasuredChoice, owner_turn


def is_tracing() -> bool:
    """Inside torch.compile, torch.export or torch.jit.trace: code must not branch on tensor values."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


def is_transformed() -> bool:
    """Inside a torch.func transform (vmap, grad, jvp) or forward-mode AD, which see through nn.Linear's own kernel
    but not through oneDNN's op (under `no_grad`, jvp's tangents would silently come out zero)."""
    return torch._C._functorch.maybe_current_level() is not None or torch.autograd.forward_ad._current_level >= 0


# x86-64 only: where torch's float32 products otherwise go to MKL, the kernel oneDNN is compared with.
_ONEDNN = (
    platform.machine().lower() in ("x86_64", "amd64")
    and torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
POLICIES = ("measure", "onednn", "blas")
POLICY = os.environ.get("HF_VANILLA_LINEAR_KERNEL", "measure")
if POLICY not in POLICIES:
    raise ValueError(f"HF_VANILLA_LINEAR_KERNEL={POLICY!r}: use one of {', '.join(POLICIES)} (default: measure).")
# Below this many weights oneDNN's fixed cost per call, several times MKL's, cannot be won back at any row count
# (a 32 x 32 weight always ran slower in oneDNN). Not measured, so that tiny models pay nothing for calibration.
MIN_WEIGHTS = 2**12
CALIBRATION_CALLS = 6  # timed calls of each kernel per shape
MIN_GAIN = 1.05  # oneDNN must be this many times faster (median against median) for a key to leave F.linear
MAX_ROWS_BUCKET = 1024  # row counts above it share one key: there the kernels' ratio no longer moves with rows
# oneDNN (the challenger) or F.linear, per key: see the module docstring and hf_vanilla/measure.py.
CHOICE = MeasuredChoice("linear kernel: oneDNN?", ("blas", "onednn"), challenger="onednn", calls=CALIBRATION_CALLS,
                        min_gain=MIN_GAIN)


_PAUSED = threading.local()  # `paused`: True inside `pinned()` in this thread


@contextlib.contextmanager
def pinned():
    """In this thread, products whose kernel is still measured run F.linear, untimed, and decided ones their
    decision: no call inside counts toward a decision, nor pays for timing (see the module docstring)."""
    before = getattr(_PAUSED, "paused", False)
    _PAUSED.paused = True
    try:
        yield
    finally:
        _PAUSED.paused = before


def decisions() -> dict[tuple, bool]:
    """What the "measure" policy decided so far: (in_features, out_features, rows bucket, threads) -> oneDNN?"""
    return CHOICE.decisions()


def forget_decisions() -> None:
    """Measure again from the next call (after changing threads or CPU affinity, or in tests)."""
    CHOICE.forget()


def _onednn_linear(x, weight, bias):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _key(x, weight) -> tuple:
    """What a projection's measured choice is made per: (in_features, out_features, rows rounded up to a power of
    two and capped at MAX_ROWS_BUCKET, torch's thread count)."""
    out_features, in_features = weight.shape
    rows = max(x.numel() // in_features, 1)
    return in_features, out_features, min(1 << (rows - 1).bit_length(), MAX_ROWS_BUCKET), torch.get_num_threads()


def _measure(key, x, weight, bias, layer):
    """One calibration call of `layer`: not timed if it is the layer's first, else oneDNN or F.linear, alternating
    from one call of the layer to its next, is timed as the first kernel to read the weight in its call (as in the
    model: timing both on one call would time the second with the weight already in cache). F.linear's output is
    returned either way."""
    turn = owner_turn(layer)
    if not turn:
        return nn.functional.linear(x, weight, bias)
    if CHOICE.turn(key, turn) == "onednn":
        CHOICE.time(key, "onednn", partial(_onednn_linear, x, weight, bias))
        return nn.functional.linear(x, weight, bias)
    return CHOICE.time(key, "blas", partial(nn.functional.linear, x, weight, bias))


class VanillaLinear(nn.Linear):
    """nn.Linear: y = x W^T + b, with W stored (out_features, in_features) as in every BERT checkpoint.

    CPU float32 inference may run oneDNN's matmul where it measured faster (see the module docstring); the rest takes
    nn.Linear's own path: training (oneDNN's op has no backward), torch.func transforms and forward-mode AD,
    autocast, GPUs, other dtypes, nested inputs, tracing and export (graphs keep aten::linear), and tensor
    subclasses (quantized or sharded weights). As a subclass it stays an nn.Linear to everything that looks for
    one: PEFT, bitsandbytes, torchao, Accelerate's hooks.

    The test runs on every call, so it is written out inline: in a 16-token request its cost shows.
    """

    def forward(self, x):
        weight, bias = self.weight, self.bias
        if (
            _ONEDNN
            and POLICY != "blas"
            and self.in_features * self.out_features >= MIN_WEIGHTS
            and torch.backends.mkldnn.enabled  # users may turn oneDNN off: torch.backends.mkldnn.flags(enabled=False)
            and x.dtype == torch.float32
            and weight.dtype == torch.float32
            and x.is_cpu
            and weight.is_cpu
            and type(x) is torch.Tensor
            and not x.is_nested  # torch.nested's strided layout is a plain Tensor too
            and type(weight) in (nn.Parameter, torch.Tensor)
            # no autograd through it: the op has no backward (a trainable bias alone counts, as in BitFit)
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)))
            and not torch.is_autocast_enabled("cpu")
            and not is_tracing()
            and not is_transformed()
            and not torch.are_deterministic_algorithms_enabled()
        ):
            if POLICY == "onednn":
                return _onednn_linear(x, weight, bias)
            key = _key(x, weight)
            onednn = CHOICE.decision(key)
            if onednn is None:
                if getattr(_PAUSED, "paused", False):
                    return nn.functional.linear(x, weight, bias)
                return _measure(key, x, weight, bias=bias, layer=self)
            if onednn:
                return _onednn_linear(x, weight, bias)
        return nn.functional.linear(x, weight, bias)


__all__ = ["VanillaLinear", "decisions", "forget_decisions", "is_tracing", "is_transformed", "pinned"]
