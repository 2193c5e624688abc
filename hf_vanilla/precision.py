"""Reduced precision where, and only where, it is faster than float32 on the machine it runs on.

    from hf_vanilla.precision import bf16_is_fast, quantize_int8

    if bf16_is_fast():                 # AMX, or AVX-512 BF16 on AMD (or a CUDA GPU with bf16)
        model = model.to(torch.bfloat16)
    else:
        model = quantize_int8(model)   # int8 projections, on any x86 CPU (inference only)

bfloat16 halves the bytes a matrix product reads, but it is only faster where the hardware multiplies bf16 natively.
A CPU without AMX or AVX-512 BF16 has no bf16 dot product: an AVX2-only CPU has no oneDNN bf16 kernel at all, and
torch multiplies bf16 in its reference kernel, several times slower than float32 (docs/performance.md).
Having the instruction is not enough either: with AVX-512 BF16 but no AMX, bf16 was measured slower than float32
on an Intel CPU and faster on AMD ones, and with AMX faster still (docs/performance.md has the figures).
So the rule is the hardware: AMX, or AVX-512 BF16 on an AMD CPU (whose 512-bit bf16 dot products run at full
width), read from the CPU (torch's cpuinfo checks, /proc/cpuinfo as a fallback). An Intel CPU with AVX-512 BF16 but
no AMX stays on float32. An earlier version timed one feed-forward block in both precisions in the process; on a
CPU with AMX that timing answered True when the machine was quiet and False under load, where bf16 was in fact
much faster: a decision that gates the fastest path must not depend on what else the machine is doing.

torch's own `torch.ops.mkldnn._is_mkldnn_bf16_supported()` is not this test: it is true on any AVX-512 CPU, where
oneDNN can *run* bf16 (emulated), including CPUs where that is slower.
"""

import warnings
import weakref
from typing import ClassVar

import torch
from torch import nn



def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo
                         if line.split(":", 1)[0].strip() == field), "")
    except OSError:
        return ""


def cpu_flags() -> set:
    """The CPU feature flags /proc/cpuinfo lists (empty where it cannot be read)."""
    return set(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id: "GenuineIntel", "AuthenticAMD", or "" where it cannot be read."""
    return _cpuinfo("vendor_id")


def cpu_family_model() -> tuple[str, str]:
    """/proc/cpuinfo's cpu family and model numbers, as text ("" where they cannot be read): with the vendor, which
    generation of CPU this is where its model name gives only the vendor's product line (as virtual machines often
    report it)."""
    return _cpuinfo("cpu family"), _cpuinfo("model")


def cpu_name() -> str:
    """/proc/cpuinfo's model name (the vendor's name for the CPU), or "" where it cannot be read."""
    return _cpuinfo("model name")


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
    return device.type == "cpu" and _bf16_rule(_amx(), _avx512_bf16(), cpu_vendor())


def _bf16_rule(amx: bool, avx512_bf16: bool, vendor: str) -> bool:
    """bf16 is faster than float32 on a CPU with AMX, or with AVX-512 BF16 made by AMD (the module docstring)."""
    return amx or (avx512_bf16 and vendor == "AuthenticAMD")


# ---- int8 ---------------------------------------------------------------------------------------------------------


def weight_levels(flags=None) -> int:
    """The int8 weights' largest level on this CPU: 127 (8 bits) where fbgemm multiplies with AVX-512 VNNI, 63 (7
    bits) elsewhere. VNNI's `vpdpbusd` adds u8 x s8 products straight into int32. Without it the kernel multiplies
    with `vpmaddubsw`, which adds two u8 x s8 products into a saturating int16: 8-bit weights can overflow it
    (255 x 127 x 2 > 32767), and did, by 13% of the output on a random nn.Linear; 255 x 63 x 2 = 32130 cannot.
    fbgemm's VNNI kernels are AVX-512 ones (GenerateKernelU8S8S32ACC32Avx512VNNI): a CPU with AVX-VNNI alone runs
    its AVX2 kernel, and gets 7 bits. The 8th bit matters where the margins are thin: Marian's vocabulary projection
    (benchmarks/engines.py) changed one greedy token in 8 x 64 at 7 bits, none at 8. `flags`: the CPU's, by default
    /proc/cpuinfo's (a test scripts them)."""
    return 127 if "avx512_vnni" in (cpu_flags() if flags is None else flags) else 63


# The flags of an int8 product that accumulates u8 x s8 in int32 in ONNX Runtime's MLAS (what it picks by cpuid):
# elsewhere it multiplies with vpmaddubsw, as fbgemm does without AVX-512 VNNI (`weight_levels`), and gets 7 bits.
INT8_PRODUCTS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_capabilities(flags=None, vendor=None) -> dict:
    """What this CPU offers the engines, read from its flags (`flags`, `vendor`: /proc/cpuinfo's by default; tests
    script them), in one place with what each engine does with it. Everything else about which engine is faster
    is measured on the machine (`runtime="auto"`, hf_vanilla/runtimes/auto.py), never assumed from these:

    avx2         (avx2) PyTorch: float32 in 256-bit vectors, int8 (fbgemm) with vpmaddubsw, so 7-bit weights;
                 ONNX Runtime (MLAS): the same, 7-bit weights; OpenVINO: float32
    avx512       (avx512f, avx512bw) every engine's float32 in 512-bit vectors
    avx512_vnni  int8 products accumulated in int32: fbgemm and MLAS use 8-bit weights; OpenVINO's int8 products
    avx_vnni     MLAS: 8-bit weights; fbgemm has no VNNI kernel but AVX-512's: 7-bit weights
    avx512_bf16  PyTorch's bf16 dot products: faster than float32 on AMD, not on Intel CPUs without AMX;
                 OpenVINO computes bf16 by default (its precision hint); ONNX Runtime's CPU engine float32 only
    amx          (amx_bf16, amx_int8) bf16 tiles, PyTorch's fastest bf16; MLAS's int8 on amx_int8; OpenVINO
                 bf16 by default

    Returns the capabilities (True / False) and what follows from them: `bf16_fast` (`bf16_is_fast`'s rule, from
    these flags), `fbgemm_int8_bits` (`weight_levels`), `mlas_int8_bits` (INT8_PRODUCTS)."""
    flags = cpu_flags() if flags is None else set(flags)
    vendor = cpu_vendor() if vendor is None else vendor
    found = {"avx2": "avx2" in flags, "avx512": {"avx512f", "avx512bw"} <= flags,
             "avx512_vnni": "avx512_vnni" in flags, "avx_vnni": "avx_vnni" in flags,
             "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_bf16" in flags or "amx_int8" in flags}
    return found | {"bf16_fast": _bf16_rule("amx_bf16" in flags, found["avx512_bf16"], vendor),
                    "fbgemm_int8_bits": 8 if weight_levels(flags) == 127 else 7,
                    "mlas_int8_bits": 8 if flags & INT8_PRODUCTS else 7}


# Every layer's W^Q, W^K, W^V, W^O, W1, W2.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


# Int8Linear -> (a weak reference to the float32 copy of its weight it last returned, that copy's version counter).
_DEQUANTIZED = weakref.WeakKeyDictionary()


class _Int8Weighted(nn.Module):
    """What the two int8 modules share: they keep no float32 `weight`, so reading one raises an AttributeError
    (`hasattr(module, "weight")` stays False) whose message, `_no_weight`, says what to do instead; and a float32
    `weight` in a state dict loads by being quantized anew into the int8 matrix."""

    _no_weight: ClassVar[str]

    def __getattr__(self, name):
        if name == "weight":
            raise AttributeError(self._no_weight)
        return super().__getattr__(name)

    @staticmethod
    def _load_weight(matrix: "Int8Linear", state_dict, prefix, *, strict, missing_keys, error_msgs) -> str:
        """Quantize `state_dict[prefix + "weight"]` into `matrix`, reporting a refused weight in `error_msgs` and,
        under `strict`, a missing one in `missing_keys`, as nn.Module's loading reports its own. Returns the key."""
        name = prefix + "weight"
        if name in state_dict:
            try:
                matrix._quantize(state_dict[name].detach().to(torch.float32))
            except ValueError as error:
                error_msgs.append(f"{name}: {error}")
        elif strict:
            missing_keys.append(name)
        return name


class Int8Linear(_Int8Weighted):
    """y = x W^T + b with W in int8 (one scale per output row) and x quantized to 8 bits per token at each call.

    The product runs in fbgemm's int8 kernel (`torch.ops.quantized.linear_dynamic`, what torch's dynamic
    quantization calls), whose activation quantization is one scale per tensor. One scale for a whole batch lets a
    token with large activations flatten every other token's: on MiniLM and real sentences that took the lowest
    per-token cosine against float32 to 0.95 (docs/performance.md). So each token is divided by its own largest
    |x| first, the kernel sees rows of one range, and the result is multiplied back:
    x W^T = diag(s) (diag(1/s) x) W^T, s = max |x| per token: per-token quantization for one division and one fused
    multiply-add over the output.

    Weights use 8 bits where the CPU has AVX-512 VNNI and 7 bits elsewhere (`weight_levels`: without VNNI 8-bit
    weights can overflow the kernel's int16 sums), activations all 8. fbgemm's own answer to that overflow, 7-bit
    activations (`reduce_range=True`), lost more on MiniLM (lowest cosine 0.980, top-1 neighbours 91.4%) than 7-bit
    weights (0.982, 94.1%); 8-bit weights with AVX-512 VNNI: 0.991, 93.4% (tests/test_precision.py).

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

    _no_weight = ("Int8Linear has no float32 weight to read or edit: quantize_int8 replaced it by int8. To change it, "
                  "load_state_dict a float32 state dict (it is quantized anew), or edit the float32 model and quantize "
                  "again; dequantized_weight() returns a float32 copy.")

    def __init__(self, linear: nn.Linear, rows: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.keeps_rows = rows  # the int8 rows kept readable too, for the embeddings tied to it (Int8Embedding)
        self._quantize(linear.weight.detach())

    def _quantize(self, weight: torch.Tensor) -> None:
        """Make `weight` (out_features, in_features) this layer's int8 weight, in fbgemm's packed form."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"quantize_int8 quantizes float32 weights on the CPU; got {weight.dtype} on "
                             f"{weight.device}: call model.float().cpu() first.")
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"Int8Linear({self.in_features} -> {self.out_features}) got a weight of shape "
                             f"{tuple(weight.shape)}.")
        scales = (weight.abs().amax(1).clamp_min(1e-12) / weight_levels()).double()  # symmetric, per output row
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; fbgemm's prepack still takes one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm's own layout; bias added below
        _DEQUANTIZED.pop(self, None)
        if self.keeps_rows:  # fbgemm's packed form cannot be indexed by row: the same int8 rows, plainly
            self._int8_rows, self._row_scales = qweight.int_repr(), scales.float()[:, None]  # (out, in), (out, 1)

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows `indices` of the weight this layer computes with, dequantized: (..., in_features). For embeddings
        tied to this layer (`Int8Embedding`); only a layer made with `rows=True` keeps them."""
        return self._int8_rows[indices].float() * self._row_scales[indices]

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer computes with, as a float32 tensor (out_features, in_features): a new one, or the
        one returned before while it is still held somewhere and unchanged (nothing written into it, the layer not
        quantized since). So one state dict holds the keys tied to this layer (Int8Embedding) as one tensor, which is
        how transformers' `save_pretrained` recognises a tie and writes the matrix once, as for the float32 model."""
        held, version = _DEQUANTIZED.get(self, (lambda: None, None))
        weight = held()
        if weight is None or weight._version != version:
            qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
            weight = qweight.dequantize()
            if not weight.is_inference():  # an inference tensor keeps no version counter to tell a write by
                _DEQUANTIZED[self] = (weakref.ref(weight), weight._version)
        return weight

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dequantized_weight()  # nn.Linear's name: any class loads it
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        name = self._load_weight(self, state_dict, prefix, strict=strict, missing_keys=missing_keys,
                                 error_msgs=error_msgs)
        own = {key: value for key, value in state_dict.items() if key.startswith(prefix) and key != name}
        super()._load_from_state_dict(own, prefix, local_metadata=local_metadata, strict=strict,
                                      missing_keys=missing_keys, unexpected_keys=unexpected_keys, error_msgs=error_msgs)

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


class Int8Embedding(_Int8Weighted):
    """Token embeddings that read the int8 matrix of the vocabulary projection they are tied to.

    Where the output projection is the token embedding matrix (section 3.4: Marian, BERT's masked-LM head), the
    projection is the largest product a decoding step runs (Marian: 58101 x 512, bound by
    reading the matrix), and `quantize_int8` makes it an `Int8Linear`. The lookups must then read that same int8
    matrix: a float32 table kept beside it would be a second copy of one weight, and an edit to either would leave
    the other stale. So the projection owns the matrix and this module keeps none: row i is the projection's int8 row
    i times its scale, the numbers the projection computes with. `state_dict` writes them dequantized under
    nn.Embedding's name (every tied key holds the same values, as in a float32 checkpoint); `load_state_dict` of a
    float32 weight quantizes it into the one matrix, so the projection and every lookup follow it. There is no
    `weight` to edit (it says what to do instead)."""

    _no_weight = ("Int8Embedding has no float32 weight: its rows are the int8 matrix of the output projection it is "
                  "tied to (quantize_int8). To change it, load_state_dict a float32 state dict (it is quantized anew), "
                  "or edit the float32 model and quantize again; projection.dequantized_weight() returns a copy.")

    def __init__(self, embedding: nn.Embedding, projection: Int8Linear):
        super().__init__()
        if not projection.keeps_rows or (projection.out_features, projection.in_features) != tuple(
                embedding.weight.shape):
            raise ValueError(f"Int8Embedding reads the rows of the projection it is tied to: an Int8Linear made with "
                             f"rows=True of shape {tuple(embedding.weight.shape)}.")
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.__dict__["projection"] = projection  # not a submodule: its owner saves and moves it, once

    def forward(self, input_ids):  # (...) -> (..., E)
        return self.projection.rows(input_ids)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.projection.dequantized_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._load_weight(self.projection, state_dict, prefix, strict=strict, missing_keys=missing_keys,
                          error_msgs=error_msgs)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows of the tied output projection"


def quantize_int8(model):
    """Replace every layer's projections (W^Q, W^K, W^V, W^O, W1, W2 of every encoder and decoder layer) and the
    output projection over the vocabulary by `Int8Linear`, in place, and return the model. Token embeddings tied to
    that output projection (section 3.4) read its int8 matrix (`Int8Embedding`); other embeddings, LayerNorms,
    attention itself, the pooler and the other heads stay float32. For inference on a float32 model on a CPU. The
    model then owns its int8 weights (see `Int8Linear`): `save_pretrained` writes them dequantized under their
    float32 names, a checkpoint any class loads and that `quantize_int8` turns back into this model. Calling it again
    on a quantized model changes nothing. Accuracy and speed on this CPU against float32 and CTranslate2's int8:
    docs/performance.md; tests/test_precision.py holds the accuracy on real sentences to a floor."""
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
    _quantize_vocabulary(model)
    return model.eval()


def _quantize_vocabulary(model) -> None:
    """The output projection over the vocabulary (`get_output_embeddings()`, a float32 nn.Linear) becomes an
    Int8Linear, and every token embedding that shares its weight (tied) an Int8Embedding reading its rows; an
    embedding module that two stacks share stays one module."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):  # none, or already quantized
        return
    children = [(module, name, child) for module in model.modules() for name, child in module.named_children()]
    tied = [(module, name, child) for module, name, child in children
            if isinstance(child, nn.Embedding) and child.weight is head.weight]
    int8 = Int8Linear(head, rows=bool(tied))
    for module, name, child in children:
        if child is head:
            setattr(module, name, int8)
    lookups = {}
    for module, name, embedding in tied:
        if id(embedding) not in lookups:
            lookups[id(embedding)] = Int8Embedding(embedding, int8)
        setattr(module, name, lookups[id(embedding)])


__all__ = ["INT8_PRODUCTS", "Int8Embedding", "Int8Linear", "bf16_is_fast", "cpu_capabilities", "cpu_flags", "cpu_name",
           "cpu_vendor", "native_bf16_cpu", "quantize_int8", "weight_levels"]
