"""Reduced precision where, and only where, it is faster than float32 on the machine it runs on.

    from hf_vanilla.precision import bf16_is_fast, quantize_int8

    if bf16_is_fast():                 # bf16 products in hardware, and measured faster here (or a CUDA GPU with bf16)
        model = model.to(torch.bfloat16)
    else:
        model = quantize_int8(model)   # int8 projections where measured faster, on any x86 CPU (inference only)

bfloat16 halves the bytes a matrix product reads, but it is only faster where the hardware multiplies bf16 natively.
A CPU without AMX or AVX-512 BF16 has no bf16 dot product: oneDNN converts every bf16 block to float32 and
multiplies in float32, which is the float32 product plus the conversions (AMD Zen 3, AVX2 only: about half float32's
speed). Having the instruction is not enough either: on issue 28's Intel Xeon, which has AVX-512 BF16 but no AMX,
bf16 ran at 0.67-0.92x float32, while on AMD Zen 4, with the same AVX-512 BF16 and no AMX, it ran at 1.8-2.1x, and
with AMX (Intel Sapphire Rapids and later) at 2.9-4.1x (docs/performance.md). No flag tells the Xeon from the Zen 4,
so the rule is two steps: the capability, read from the CPU (torch's cpuinfo checks, /proc/cpuinfo as a fallback),
which rules bf16 out for free where it can only be emulated; then, where the CPU has it, a measurement in this
process (`bf16_measured_faster`: one feed-forward block of a transformer layer in both precisions, about a quarter
of a second, once per process and thread count), which must find bf16 `BF16_MIN_GAIN` times faster.

torch's own `torch.ops.mkldnn._is_mkldnn_bf16_supported()` is not this test: it is true on any AVX-512 CPU, where
oneDNN can *run* bf16 (emulated), including CPUs where that is slower.
"""

import statistics
import time
import warnings

import torch
from torch import nn

from . import kernels


def cpu_flags() -> set:
    """The CPU feature flags /proc/cpuinfo lists (empty where it cannot be read)."""
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
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})  # an older torch without the checks


def bf16_is_fast(device=None) -> bool:
    """Whether running a model in bfloat16 is faster than float32 on `device` (default: the CPU): a CPU with native
    bf16 products (`native_bf16_cpu`) where bf16 also measured faster in this process (`bf16_measured_faster`), or
    a CUDA GPU that supports bf16. False everywhere else, where bf16 would only cost accuracy and, on a CPU, time."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and native_bf16_cpu() and bf16_measured_faster()


BF16_MIN_GAIN = 1.15  # bf16 must be this much faster: noise can only leave float32 in place
BF16_TRIALS = 7  # timed calls of each precision, interleaved
_bf16_faster: dict[int, bool] = {}  # torch's thread count -> measured


def bf16_measured_faster() -> bool:
    """Whether bf16 runs a transformer's feed-forward block (128 tokens, E=768 -> 3072 -> 768, GELU, LayerNorm:
    bert-base's shapes) at least `BF16_MIN_GAIN` times faster than float32 on this CPU, with torch's current
    threads. Measured once per process and thread count: medians of `BF16_TRIALS` calls of each, interleaved."""
    threads = torch.get_num_threads()
    if threads not in _bf16_faster:
        generator = torch.Generator().manual_seed(0)
        x, up, down = (torch.randn(shape, generator=generator) * 0.05 for shape in ((128, 768), (3072, 768),
                                                                                  (768, 3072)))
        blocks = {dtype: (x.to(dtype), up.to(dtype), down.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
        seconds = {dtype: [] for dtype in blocks}
        with torch.inference_mode():
            for trial in range(BF16_TRIALS + 2):  # the first two of each warm the kernels up
                for dtype, (tokens, w1, w2) in blocks.items():
                    start = time.perf_counter()
                    nn.functional.layer_norm(tokens + nn.functional.linear(nn.functional.gelu(
                        nn.functional.linear(tokens, w1)), w2), (768,))
                    elapsed = time.perf_counter() - start
                    if trial >= 2:
                        seconds[dtype].append(elapsed)
        fp32, bf16 = (statistics.median(seconds[dtype]) for dtype in (torch.float32, torch.bfloat16))
        _bf16_faster[threads] = fp32 >= BF16_MIN_GAIN * bf16
    return _bf16_faster[threads]


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

    Never slower than float32, measured: where a product is so small that the extra work (the scales, fbgemm's
    quantization of x) costs more than int8 saves, the float32 projection runs instead, kept beside the int8 one.
    As in `kernels.VanillaLinear`, the choice is measured per key (in_features, out_features, rows rounded up to a
    power of two and capped at 1024, threads) on the first calls: they time int8, F.linear and (where kernels.py
    would consider it) oneDNN in turn (per layer, after its first call, as `kernels.py` does), each as the first
    to read its weight in its call, `CALIBRATION_CALLS` each, and all return the int8 result. Then the key runs
    int8 only if the faster float32 kernel's median time is at least `MIN_GAIN` times int8's; otherwise the float32
    projection (its own measured kernel) runs, which is also the more accurate answer. `int8_decisions()` shows
    what was decided.

    Inference only: the int8 weight has no gradient, so a call that would need one raises.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.float_linear = linear  # where int8 measured no faster (see above); shares the model's tensors
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(1).clamp_min(1e-12) / WEIGHT_LEVELS).double()  # symmetric, per output row
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; fbgemm's prepack still takes one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm's own layout; bias added below
        bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("int8_bias", bias.clone(), persistent=False)

    def int8(self, x):
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)  # (..., 1): each token's own range
        y = torch.ops.quantized.linear_dynamic(x / scale, self._packed, False)  # (..., out): 8-bit inputs
        return torch.addcmul(self.int8_bias, y, scale)

    def forward(self, x):
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("quantize_int8 made this model for inference: its int8 projections have no gradient. "
                               "Train the float32 model and quantize it afterwards.")
        rows = max(x.numel() // self.in_features, 1)
        key = (self.in_features, self.out_features, min(1 << (rows - 1).bit_length(), 1024), torch.get_num_threads())
        use_int8 = _decisions.get(key)
        if use_int8 is None:
            return self._measure(key, x)
        return self.int8(x) if use_int8 else self.float_linear(x)

    def _measure(self, key, x):
        """One calibration call: int8's result, after timing one kernel, as `kernels.py` calibrates: not on the
        layer's first call (first reads of a fresh weight), then the kernels in turn from one call of this layer
        to its next, so that every kernel is timed at every place in the model."""
        weight, bias = self.float_linear.weight, self.float_linear.bias
        candidates = {"int8": self.int8, "F.linear": lambda x: nn.functional.linear(x, weight, bias)}
        if _onednn_considered(self.float_linear):
            candidates["oneDNN"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        calls = kernels.calibration_call(self)  # this layer's before this one
        if not calls:
            return self.int8(x)
        trials = _trials.setdefault(key, {name: [] for name in candidates})
        names = list(trials)
        name = names[calls % len(names)]
        if len(trials[name]) >= CALIBRATION_CALLS:  # this one has its timings: the one with the fewest instead
            name = min(names, key=lambda name: len(trials[name]))
        start = time.perf_counter()
        result = candidates[name](x)
        trials[name].append(time.perf_counter() - start)
        if name != "int8":
            result = self.int8(x)
        if min(map(len, trials.values())) >= CALIBRATION_CALLS:
            medians = {name: statistics.median(seconds) for name, seconds in trials.items()}
            _decisions[key] = min(v for n, v in medians.items() if n != "int8") >= MIN_GAIN * medians["int8"]
            _trials.pop(key, None)
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, per token"


CALIBRATION_CALLS = 6  # timed calls of each kernel per key
MIN_GAIN = 1.05  # int8 must be this much faster than float32's faster kernel; noise can only leave float32 in place
_decisions: dict[tuple, bool] = {}  # key -> run int8
_trials: dict[tuple, dict[str, list[float]]] = {}


def int8_decisions() -> dict[tuple, bool]:
    """What the measurement decided so far: (in_features, out_features, rows bucket, threads) -> int8?"""
    return dict(_decisions)


def forget_int8_decisions() -> None:
    _decisions.clear()
    _trials.clear()


def _onednn_considered(linear) -> bool:
    """Whether `kernels.VanillaLinear` may run this float32 product on oneDNN (its static conditions)."""
    return (isinstance(linear, kernels.VanillaLinear) and kernels._ONEDNN and kernels.POLICY != "blas"
            and linear.in_features * linear.out_features >= kernels.MIN_WEIGHTS and torch.backends.mkldnn.enabled)


def quantize_int8(model):
    """Replace every layer's projections (W^Q, W^K, W^V, W^O, W1, W2 of every encoder and decoder layer) by
    `Int8Linear`, in place, and return the model. Embeddings, LayerNorms, attention itself, the pooler and the heads
    stay float32. For inference on a CPU: call it after loading (the int8 weights are derived, not saved; save the
    float32 model). A projection runs int8 only where that measured faster than float32 in this process (see
    `Int8Linear`), so the model is never slower than float32 and at least as accurate as all-int8. Accuracy and
    speed on this CPU against float32 and CTranslate2's int8: docs/performance.md; tests/test_precision.py holds
    the accuracy on real sentences to a floor."""
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


__all__ = ["Int8Linear", "bf16_is_fast", "bf16_measured_faster", "cpu_flags", "forget_int8_decisions",
           "int8_decisions", "native_bf16_cpu", "quantize_int8"]
