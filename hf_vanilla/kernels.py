"""Which kernel computes a projection, and why.

Every projection in the model (W^Q, W^K, W^V, W^O, the feed-forward's W1 and W2, the heads) is a `VanillaLinear`:
an `nn.Linear` whose CPU float32 inference on a large weight runs oneDNN's matmul instead of the BLAS call behind
`F.linear` (MKL's sgemm on x86 builds of torch). It is the same product of the same weights in another kernel,
which differs only in the order it sums (outputs within float32 rounding). It exists because MKL is slow on the
skinny products of small requests and generation; docs/performance.md has the measurements and
`benchmarks/linear_kernels.py` re-measures them on any machine.

What this module guarantees: outside that one case (inference, CPU, float32, plain tensors, a large weight),
`VanillaLinear` is `nn.Linear` bit for bit, so training, autocast, GPUs, other dtypes, tracing and export,
torch.func transforms and quantized or sharded weights behave exactly as with `nn.Linear`.

It also holds the two predicates the rest of the package asks before doing anything data-dependent:
`is_tracing()` (compile, export, jit trace: graphs must not branch on values) and `is_transformed()`.
"""

import platform

import torch
from torch import nn


def is_tracing() -> bool:
    """Inside torch.compile, torch.export or torch.jit.trace: code must not branch on tensor values."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


def is_transformed() -> bool:
    """Inside a torch.func transform (vmap, grad, jvp) or forward-mode AD, which see through nn.Linear's own kernel
    but not through oneDNN's op (under `no_grad`, jvp's tangents would silently come out zero)."""
    return torch._C._functorch.maybe_current_level() is not None or torch.autograd.forward_ad._current_level >= 0


# x86-64 only: where torch's float32 products otherwise go to MKL, the comparison measured (docs/performance.md).
_ONEDNN = (
    platform.machine().lower() in ("x86_64", "amd64")
    and torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
# Below this many weights, oneDNN's fixed cost per call (~12 us, against MKL's ~3) outweighs what it saves. Measured in
# the models here: MiniLM's 384 x 384 projections gain, a 32-wide model loses, 256 x 256 is even.
_ONEDNN_MIN_WEIGHTS = 2**17


class VanillaLinear(nn.Linear):
    """nn.Linear: y = x W^T + b, with W stored (out_features, in_features) as in every BERT checkpoint.

    CPU float32 inference on a large weight runs oneDNN's matmul (see the module docstring); everything else takes
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
            and self.in_features * self.out_features >= _ONEDNN_MIN_WEIGHTS
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
        ):
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return nn.functional.linear(x, weight, bias)


__all__ = ["VanillaLinear", "is_tracing", "is_transformed"]
