"""Reduced precision where, and only where, it is faster than float32 on the machine it runs on.

    from hf_vanilla.precision import bf16_is_fast

    if bf16_is_fast():                 # AMX or AVX-512 BF16 on this CPU (or a CUDA GPU with bf16)
        model = model.to(torch.bfloat16)

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

import torch


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


__all__ = ["bf16_is_fast", "native_bf16_cpu"]
