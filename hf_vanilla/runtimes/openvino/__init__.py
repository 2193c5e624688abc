"""OpenVINO as the engine behind a vanilla encoder, holding the encoder's weights: a fast path for short requests,
with the model's Hugging Face API kept.

    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, runtime="openvino")                    # float32
    model = AutoModel.from_pretrained(path, runtime="openvino", runtime_options={"precision": "bf16"})
    model(**batch)   # every BERT-style head: its body on OpenVINO (or PyTorch, per request size), the head in PyTorch

Why a second engine. `runtime="onnxruntime"` computes with the model's own tensor memory on every call, so any
write reaches it, and pays for that on short requests: an engine fed its weights packs them on every call.
OpenVINO packs them once, when it compiles, and so must own them (hf_vanilla/runtimes/owned.py says how, and which
changes it follows or refuses; engine.py what OpenVINO adds). Measured on each CPU by `benchmarks/engines.py`
(docs/performance.md).
"""

from ..attached import take_off
from ..options import checked
from ..owned import hold
from .engine import STATIC_SHAPES, OpenVinoEncoder, runs_bf16


def use_openvino(model, precision: str = "f32", threads: int | None = None, cache_dir=None,
                 static_shapes: int = STATIC_SHAPES):
    """Run each encoder body of `model` (a vanilla model, in eval mode, float32 or bfloat16 on the CPU) on OpenVINO at
    `precision` ("f32", "bf16" where `runs_bf16()`, or "int8": what OpenVINO computes in; the weights keep the model's dtype, but float32
    for "f32" and "int8"), the weights held by the engine, and return `model`. `threads`: OpenVINO's (default
    torch's `get_num_threads()`). `cache_dir`: where traced graphs are kept (the ONNX Runtime engine's cache:
    $HF_VANILLA_ONNX_CACHE, else ~/.cache/hf_vanilla/onnx). `static_shapes`: how many request shapes of at most
    STATIC_TOKENS (128) tokens may get a compilation of their own, each at the second request of that shape; none by
    default (faster on short requests of one repeated shape, but each stalls the request that compiles it and holds
    the projections' weights again: engine.py). Calling it again compiles the model as it is."""
    checked("use_openvino", precision, OpenVinoEncoder.PRECISIONS, threads=threads, cache_dir=cache_dir,
            static_shapes=static_shapes)
    return hold(model, OpenVinoEncoder, precision, threads=threads, cache_dir=cache_dir, call="use_openvino",
                static_shapes=static_shapes)


def remove_openvino(model):
    """Undo `use_openvino`: each body gets its weights back (as the engine holds them) and runs in PyTorch. Returns
    `model`."""
    return take_off(model, OpenVinoEncoder)


__all__ = ["remove_openvino", "runs_bf16", "use_openvino"]
