"""OpenVINO as the engine behind a vanilla encoder, holding the encoder's weights: the fastest path for short
requests, with the model's Hugging Face API kept.

    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, runtime="openvino")                    # float32
    model = AutoModel.from_pretrained(path, runtime="openvino", runtime_options={"precision": "int8"})
    model(**batch)   # every BERT-style head: its body on OpenVINO (or PyTorch, per request size), the head in PyTorch

Why a second engine. `runtime="onnxruntime"` computes with the model's own tensor memory on every call, so any
write reaches it, and pays for that on short requests: an engine fed its weights packs them on every call.
OpenVINO packs them once, when it compiles, and so must own them (engine.py says how, and which changes it follows
or refuses). Measured on each CPU by `benchmarks/engines.py` (docs/performance.md).

What it runs: the bodies of `vanilla_encoder` models (`model.base_model`, embeddings to pooler). It refuses a model
whose other modules share a tensor with a body (a masked-LM head tied to the word embeddings: the body's copy and
the head's would part), and encoder-decoders (their encoder shares the embeddings with the decoder): those run on
`runtime="onnxruntime"`.
"""

import torch
from transformers import PreTrainedModel

from ..cache import GraphCache
from .engine import PRECISIONS, OwnedEncoder


def use_openvino(model, precision: str = "f32", threads: int | None = None, cache_dir=None):
    """Run each encoder body of `model` (a vanilla model, in eval mode, float32 or bfloat16 on the CPU) on OpenVINO
    at `precision` ("f32", "bf16" or "int8"; the weights move to that precision's dtype), the weights held by the
    engine, and return `model`. `threads`: OpenVINO's (default torch's `get_num_threads()`). `cache_dir`: where
    traced graphs are kept (the ONNX Runtime engine's cache: $HF_VANILLA_ONNX_CACHE, else ~/.cache/hf_vanilla/onnx).
    Calling it again compiles the model as it is."""
    if precision not in PRECISIONS:
        raise ValueError(f"use_openvino(precision={precision!r}): use one of {sorted(PRECISIONS)}.")
    remove_openvino(model)
    units = [module.base_model for module in model.modules() if isinstance(module, PreTrainedModel)
             and module.config.model_type == "vanilla_encoder" and not module.config.is_decoder]
    units = list({id(unit): unit for unit in units}.values())
    if not units:
        raise ValueError(f"{type(model).__name__} has no vanilla encoder body for OpenVINO: use_openvino takes a "
                         f"VanillaEncoder* model (encoder-decoders run on runtime='onnxruntime').")
    if model.training:
        raise ValueError("use_openvino runs inference only: call model.eval() first.")
    inside = {id(tensor) for unit in units for tensor in [*unit.parameters(), *unit.buffers()]}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if tensor.device.type != "cpu" or tensor.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"use_openvino takes a float32 or bfloat16 model on the CPU, and {name} is "
                             f"{tensor.dtype} on {tensor.device}: call model.float().cpu() first.")
    outside = [name for name, tensor in _outside(model, units) if id(tensor) in inside]
    if outside:
        raise ValueError(f"{outside[0]} is shared with the encoder body that runtime='openvino' would take, and the "
                         f"two copies would part: run this model on runtime='onnxruntime', or untie the weights.")
    cache = GraphCache(cache_dir)
    for unit in units:
        OwnedEncoder(unit, precision, threads or torch.get_num_threads(), cache)
    return model


def remove_openvino(model):
    """Undo `use_openvino`: each body gets its weights back (as the engine holds them) and runs in PyTorch. Returns
    `model`."""
    for module in model.modules():
        engine = vars(module).get("forward")
        if isinstance(engine, OwnedEncoder):
            engine.give_back()
    return model


def _outside(model, units):
    """(name, tensor) of every parameter and buffer of `model` outside the bodies `units`."""
    inner = {id(module) for unit in units for module in unit.modules()}
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in inner:
            continue
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                yield f"{path}.{name}" if path else name, tensor


__all__ = ["remove_openvino", "use_openvino"]
