"""Reduced precision where, and only where, it is faster than float32 on the machine it runs on.

    from hf_vanilla.precision import bf16_is_fast, quantize_int8

    if bf16_is_fast():                 # AMX or AVX-512 BF16 on this CPU (or a CUDA GPU with bf16)
        model = model.to(torch.bfloat16)
    model = quantize_int8(model)       # or: int8 projections, on any x86 CPU (inference only)

bfloat16 halves the bytes a matrix product reads, but it is only faster where the hardware multiplies bf16 natively.
A CPU without AMX or AVX-512 BF16 has no bf16 dot product: oneDNN converts every bf16 block to float32 and
multiplies in float32, which is the float32 product plus the conversions. Measured (docs/performance.md): on an Intel
Xeon with AVX-512 but no AMX, bf16 ran at 0.67-0.92x float32; on AMD Zen 3 (AVX2 only) at <ZEN3> float32; with AVX-512
BF16 (AMD Zen 4) at 1.8-2.1x, with AMX (Intel Sapphire Rapids and later) at 2.9-4.1x. So the rule is the hardware's,
read from the CPU (torch's cpuinfo check, /proc/cpuinfo as a fallback), not a measurement: it costs nothing and
gives the same answer in every process.

torch's own `torch.ops.mkldnn._is_mkldnn_bf16_supported()` is not this test: it is true on any AVX-512 CPU, where
oneDNN can *run* bf16 (emulated), including the Xeon above where that is slower.
"""

import warnings

import torch
from torch import nn


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        return set()


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AMX (amx_bf16 tiles) or AVX-512 BF16 (vdpbf16ps)."""
    amx, avx512_bf16 = getattr(torch.cpu, "_is_amx_tile_supported", None), getattr(
        torch.cpu, "_is_avx512_bf16_supported", None)
    if amx is not None and avx512_bf16 is not None:
        return bool(amx() or avx512_bf16())
    return bool(_cpu_flags() & {"amx_bf16", "avx512_bf16"})  # an older torch without the checks


def bf16_is_fast(device=None) -> bool:
    """Whether running a model in bfloat16 is faster than float32 on `device` (default: the CPU): a CPU with native
    bf16 products (`native_bf16_cpu`), or a CUDA GPU that supports bf16. False everywhere else, where bf16 would only
    cost accuracy and, on a CPU, time."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and native_bf16_cpu()


# ---- int8 ---------------------------------------------------------------------------------------------------------

WEIGHT_LEVELS = 63  # 7-bit weights: no int16 overflow in the non-VNNI kernel (see Int8Linear)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")  # every layer's W^Q, W^K, W^V, W^O, W1, W2


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (one scale per output row) and x quantized to 8 bits per token at each call.

    The product runs in fbgemm's int8 kernel (`torch.ops.quantized.linear_dynamic`, what torch's dynamic
    quantization calls), whose activation quantization is one scale per tensor. One scale for a whole batch lets a
    token with large activations flatten every other token's: on MiniLM and real sentences that took the lowest
    per-token cosine against float32 to 0.95 (docs/performance.md). So each token is divided by its own largest
    |x| first, the kernel sees rows of one range, and the result is multiplied back:
    x W^T = diag(s) (diag(1/s) x) W^T, s = max |x| per token: per-token quantization for one division and one fused
    multiply-add over the output.

    Weights use 7 bits (-63..63), activations all 8. Without VNNI (AVX2, or AVX-512 without it) the kernel multiplies
    with `vpmaddubsw`, which adds two u8 x s8 products into a saturating int16: 8-bit weights can overflow it
    (255 x 127 x 2 > 32767), and did, by 13% of the output on a random nn.Linear; 255 x 63 x 2 = 32130 cannot.
    fbgemm's own answer, 7-bit activations (`reduce_range=True`), lost more on MiniLM (lowest cosine 0.980, top-1
    neighbours 91.4%) than 7-bit weights (0.982, 94.1%; 8-bit weights where they did not overflow: 0.982, 91.8%).

    Inference only: the int8 weight has no gradient, so a call that would need one raises.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(1).clamp_min(1e-12) / WEIGHT_LEVELS).double()  # symmetric, per output row
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; fbgemm's prepack still takes one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm's own layout; bias added below
        bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("bias", bias.clone())

    def forward(self, x):
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("quantize_int8 made this model for inference: its int8 projections have no gradient. "
                               "Train the float32 model and quantize it afterwards.")
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)  # (..., 1): each token's own range
        y = torch.ops.quantized.linear_dynamic(x / scale, self._packed, False)  # (..., out): 8-bit inputs
        return torch.addcmul(self.bias, y, scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, per token"


def quantize_int8(model):
    """Replace every layer's projections (W^Q, W^K, W^V, W^O, W1, W2 of every encoder and decoder layer) by
    `Int8Linear`, in place, and return the model. Embeddings, LayerNorms, attention itself, the pooler and the heads
    stay float32. For inference on a CPU: call it after loading (the int8 weights are derived, not saved; save the
    float32 model). Accuracy and speed on this CPU against float32 and CTranslate2's int8: docs/performance.md;
    tests/test_precision.py holds the accuracy on real sentences to a floor."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        raise RuntimeError(f"quantize_int8 runs fbgemm's int8 kernels (x86 CPUs); torch's quantized engine here is "
                           f"{torch.backends.quantized.engine!r}.")
    targets = [(module, name) for module in model.modules() for name, child in module.named_children()
               if name in PROJECTIONS and isinstance(child, nn.Linear)]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no projections named {', '.join(PROJECTIONS)}: quantize_int8 "
                         f"takes a model from hf_vanilla.")
    for module, name in targets:
        child = getattr(module, name)
        if child.weight.device.type != "cpu":
            raise ValueError(f"quantize_int8 runs on the CPU; {name} is on {child.weight.device}.")
        setattr(module, name, Int8Linear(child))
    return model.eval()


__all__ = ["Int8Linear", "bf16_is_fast", "native_bf16_cpu", "quantize_int8"]
