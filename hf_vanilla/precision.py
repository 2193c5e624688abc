"""Reduced precision where, and only where, it is faster than float32 on the machine it runs on.

    from hf_vanilla.precision import bf16_is_fast, quantize_int8

    if bf16_is_fast():                 # AMX, or AVX-512 BF16 on AMD (or a CUDA GPU with bf16)
        model = model.to(torch.bfloat16)
    else:
        model = quantize_int8(model)   # int8 projections, on any x86 CPU (inference only)

bfloat16 halves the bytes a matrix product reads, but it is only faster where the hardware multiplies bf16 natively.
A CPU without AMX or AVX-512 BF16 has no bf16 dot product: oneDNN converts every bf16 block to float32 and
multiplies in float32, which is the float32 product plus the conversions (AMD Zen 3, AVX2 only: about half float32's
speed). Having the instruction is not enough either: on issue 28's Intel Xeon, which has AVX-512 BF16 but no AMX,
bf16 ran at 0.67-0.92x float32, while on AMD Zen 4, with the same AVX-512 BF16 and no AMX, it ran at 1.8-2.1x, and
with AMX (Intel Sapphire Rapids and later) at 2.9-4.1x (docs/performance.md). So the rule is the hardware: AMX, or
AVX-512 BF16 on an AMD CPU (Zen 4 and Zen 5, whose 512-bit bf16 dot products run at full width), read from the CPU
(torch's cpuinfo checks, /proc/cpuinfo as a fallback). An Intel CPU with AVX-512 BF16 but no AMX (Cooper Lake, issue
28's Xeon) stays on float32. An earlier version timed one feed-forward block in both precisions in the process; on
issue 34's AMX Xeon that timing answered True when the machine was quiet and False under load, where bf16 was in fact
2.7-13.5x faster: a decision that gates the fastest path must not depend on what else the machine is doing.

torch's own `torch.ops.mkldnn._is_mkldnn_bf16_supported()` is not this test: it is true on any AVX-512 CPU, where
oneDNN can *run* bf16 (emulated), including CPUs where that is slower.
"""

import warnings

import torch
from torch import nn



def cpu_flags() -> set:
    """The CPU feature flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id: "GenuineIntel", "AuthenticAMD", or "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AMX (amx_bf16 tiles) or AVX-512 BF16 (vdpbf16ps)."""
    return _amx() or _avx512_bf16()


def _amx() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check()) if check is not None else "amx_bf16" in cpu_flags()  # an older torch without the check


def _avx512_bf16() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check()) if check is not None else "avx512_bf16" in cpu_flags()


def bf16_is_fast(device=None) -> bool:
    """Whether running a model in bfloat16 is faster than float32 on `device` (default: the CPU), decided by what
    the hardware is, never by a timing: a CUDA GPU that supports bf16; a CPU with AMX; an AMD CPU with AVX-512 BF16.
    False everywhere else, where bf16 would only cost accuracy and, on a CPU, time (see the module docstring)."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (_amx() or (_avx512_bf16() and cpu_vendor() == "AuthenticAMD"))


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

    It owns its weight (docs/errors_and_safety.md, "Derived state"): the int8 weight is the layer's state, held
    in fbgemm's packed form, and nothing else can write it, so nothing can leave it stale. There is no float32
    weight in the model to edit beside it (`weight` says so, naming what to do instead). `load_state_dict` of a
    float checkpoint quantizes the new weight (followed); `state_dict`, and so `save_pretrained`, writes the weight
    under nn.Linear's name, dequantized: a float32 checkpoint of the very weights this layer computes with, which
    any Hugging Face class loads, and which `quantize_int8` quantizes back to the same int8 weights (the same
    answers within the parity rule). The bias is a live float32 parameter. Moved to another dtype or device, the
    layer refuses to compute, with the fix.

    One answer: every call computes int8, so the model answers the same whatever the request size, the thread
    count or the machine's load (fbgemm accumulates in int32, exactly; only the final scaling rounds). An earlier
    version fell back to float32 where int8 measured slower, which made a model's answer depend on what had been
    measured: the two differ by the quantization error, far beyond the parity rule. On real models int8 is the
    faster at every size benchmarks/engines.py times (docs/performance.md); on a toy model's 64 x 64 projections it
    may not be, and there float32 is the better choice anyway.

    Inference only: the int8 weight has no gradient, so a call that would need one raises.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._quantize(linear.weight.detach())

    def _quantize(self, weight: torch.Tensor) -> None:
        """Make `weight` (out_features, in_features) this layer's int8 weight, in fbgemm's packed form."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"quantize_int8 quantizes float32 weights on the CPU; got {weight.dtype} on "
                             f"{weight.device}: call model.float().cpu() first.")
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"Int8Linear({self.in_features} -> {self.out_features}) got a weight of shape "
                             f"{tuple(weight.shape)}.")
        scales = (weight.abs().amax(1).clamp_min(1e-12) / WEIGHT_LEVELS).double()  # symmetric, per output row
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; fbgemm's prepack still takes one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm's own layout; bias added below

    def __getattr__(self, name):
        if name == "weight":  # an AttributeError still (hasattr(layer, "weight") is False), with the way out
            raise AttributeError(
                "Int8Linear has no float32 weight to read or edit: quantize_int8 replaced it by int8. To change it, "
                "load_state_dict a float32 state dict (it is quantized anew), or edit the float32 model and "
                "quantize again; dequantized_weight() returns a float32 copy.")
        return super().__getattr__(name)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer computes with, as a new float32 tensor (out_features, in_features)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.dequantize()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dequantized_weight()  # nn.Linear's name: any class loads it
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        name = prefix + "weight"
        if name in state_dict:
            weight = state_dict[name]
            try:
                self._quantize(weight.detach().to(torch.float32))
            except ValueError as error:
                error_msgs.append(f"{name}: {error}")
        elif strict:
            missing_keys.append(name)
        own = {key: value for key, value in state_dict.items() if key.startswith(prefix) and key != name}
        super()._load_from_state_dict(own, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def forward(self, x):
        bias = self.bias
        if x.dtype != torch.float32 or not x.is_cpu or (bias is not None and (bias.dtype != torch.float32
                                                                                or not bias.is_cpu)):
            where = x if bias is None or bias.dtype == torch.float32 and bias.is_cpu else bias
            raise RuntimeError(f"This model's projections are int8 (quantize_int8), which computes float32 on the "
                               f"CPU, and it now holds {where.dtype} on {where.device}: it was moved after "
                               f"quantize_int8. Move it back (model.float().cpu()), or convert the float32 model "
                               f"and quantize only a float32 CPU model.")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("quantize_int8 made this model for inference: its int8 projections have no gradient. "
                               "Train the float32 model and quantize it afterwards.")
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)  # (..., 1): each token's own range
        y = torch.ops.quantized.linear_dynamic(x / scale, self._packed, False)  # (..., out): 8-bit inputs
        return y * scale if bias is None else torch.addcmul(bias, y, scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, per token"


def quantize_int8(model):
    """Replace every layer's projections (W^Q, W^K, W^V, W^O, W1, W2 of every encoder and decoder layer) by
    `Int8Linear`, in place, and return the model. Embeddings, LayerNorms, attention itself, the pooler and the heads
    stay float32. For inference on a float32 model on a CPU. The model then owns its int8 weights (see
    `Int8Linear`): `save_pretrained` writes them dequantized under their float32 names, a checkpoint any class
    loads and that `quantize_int8` turns back into this model. Calling it again on a quantized model changes nothing. Accuracy and speed on this CPU against float32
    and CTranslate2's int8: docs/performance.md; tests/test_precision.py holds the accuracy on real sentences to a
    floor."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        raise RuntimeError(f"quantize_int8 runs fbgemm's int8 kernels (x86 CPUs); torch's quantized engine here is "
                           f"{torch.backends.quantized.engine!r}.")
    targets = [(module, name) for module in model.modules() for name, child in module.named_children()
               if name in PROJECTIONS and isinstance(child, (nn.Linear, Int8Linear))]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no projections named {', '.join(PROJECTIONS)}: quantize_int8 "
                         f"takes a model from hf_vanilla.")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:  # all checked before any is replaced
        if tensor.is_floating_point() and (tensor.dtype != torch.float32 or tensor.device.type != "cpu"):
            raise ValueError(f"quantize_int8 takes a float32 model on the CPU, and {name} is {tensor.dtype} on "
                             f"{tensor.device}: call model.float().cpu() first (int8 computes float32 activations).")
    for module, name in targets:
        child = getattr(module, name)
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
    return model.eval()


__all__ = ["Int8Linear", "bf16_is_fast", "cpu_flags", "cpu_vendor", "native_bf16_cpu", "quantize_int8"]
