"""ONNX Runtime as the engine behind a vanilla model's encoders, with the model and its Hugging Face API left as they
are.

    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, runtime="onnxruntime")  # use_onnx_runtime(AutoModel.from_pretrained(path))
    model(**batch)                                                  # every encoder head, pipelines, generate's encoder

Why: at small requests an eager PyTorch forward spends most of its time between kernels (Python, dispatch, one
kernel launch per op); ONNX Runtime runs the same graph from C++ with fused kernels. Where that pays depends on the
CPU: `benchmarks/engines.py` measures it, and docs/performance.md has the figures.

engine.py holds OnnxEncoder: attach (trace or find the graph, probe it), the call (ONNX Runtime or PyTorch, which
answers a request size), pickling. What it shares with the other engines is one floor up, in hf_vanilla/runtimes/.
"""

import torch
from transformers import PreTrainedModel

from ..batches import length_groups
from ..cache import GraphCache
from ..choice import runtime_choices
from .engine import OnnxEncoder

def use_onnx_runtime(model, cache_dir=None, threads: int | None = None):
    """Run every encoder of `model` (a vanilla model) on ONNX Runtime where it gives the same answer (see the module
    docstring), and return `model`. `cache_dir`: where graphs are kept (default: $HF_VANILLA_ONNX_CACHE, else
    ~/.cache/hf_vanilla/onnx). `threads`: ONNX Runtime's intra-op threads (default: torch's `get_num_threads()`, so
    both engines use what the process was given). Calling it again traces the model as it is now: exported once
    per architecture, cheap otherwise."""
    units = encoder_units(model)
    if not units:
        raise ValueError(f"{type(model).__name__} has no vanilla encoder to run on ONNX Runtime; use_onnx_runtime "
                         f"takes a model from hf_vanilla (VanillaEncoder*, VanillaSeq2Seq*).")
    remove_onnx_runtime(model)
    cache = GraphCache(cache_dir)
    for unit in units:
        OnnxEncoder.attach(unit, cache, threads or torch.get_num_threads())
    return model


def encoder_units(model) -> list:
    """What runs as one graph: each BERT-style body (embeddings, layers and its pooler), and each encoder-decoder's
    encoder stack. Decoders, causal ones included, stay in PyTorch. The pooler belongs in the graph: a PyTorch op
    right after an ONNX Runtime call waits for torch's threads while ONNX Runtime's still hold the cores (measured:
    5-14 ms for the 384 x 384 pooler of MiniLM on 2 threads, 0.4 ms on one)."""
    units = {}
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        config = module.config
        if config.model_type == "vanilla_encoder" and not config.is_decoder:
            unit = module.base_model
        elif config.model_type == "vanilla_seq2seq" and config.is_encoder_decoder:
            unit = module.get_encoder()
        else:
            continue
        units[id(unit)] = unit
    return list(units.values())


def remove_onnx_runtime(model):
    """Undo `use_onnx_runtime`: every encoder runs in PyTorch again. Returns `model`."""
    for module in model.modules():
        if isinstance(vars(module).get("forward"), OnnxEncoder):
            del module.forward
    return model


__all__ = ["encoder_units", "length_groups", "remove_onnx_runtime", "runtime_choices", "use_onnx_runtime"]
