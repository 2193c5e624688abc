"""ONNX Runtime as the engine behind a vanilla model's encoders, with the model and its Hugging Face API left as they
are.

    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, runtime="onnxruntime")  # use_onnx_runtime(AutoModel.from_pretrained(path))
    model(**batch)                                                  # every encoder head, pipelines, generate's encoder

Why: at small requests an eager PyTorch forward spends most of its time between kernels (Python, dispatch, one
kernel launch per op); ONNX Runtime runs the same graph from C++ with fused kernels. Where that pays depends on the
CPU: `benchmarks/engines.py` measures it, and docs/performance.md has the figures.

    model = AutoModel.from_pretrained(path, runtime="onnxruntime", runtime_options={"owned": True, "precision": "int8"})

Two ways to give it the weights. By default it is fed the model's own tensors on every call (engine.py: nothing is
copied, so no write can go stale, and every vanilla encoder runs, encoder-decoders included). With `owned=True` it
holds the BERT-style bodies' weights, compiled into its session once (held.py): faster on short requests, and the
only way to its int8 products (`precision="int8"`), under the ownership contract of hf_vanilla/runtimes/owned.py.

engine.py holds OnnxEncoder: attach (trace or find the graph, probe it), the call (ONNX Runtime or PyTorch, which
answers a request size), pickling; held.py the engine holding its weights. What they share with the other engines
is in the package above, hf_vanilla/runtimes/.
"""

import torch
from transformers import PreTrainedModel

from ..attached import refuse_quantized, take_off
from ..batches import length_groups
from ..cache import GraphCache
from ..choice import runtime_choices
from ..options import checked
from ..owned import hold
from .engine import OnnxEncoder
from .held import OwnedOnnxEncoder


def use_onnx_runtime(model, cache_dir=None, threads: int | None = None, owned: bool = False, precision: str = "f32"):
    """Run every encoder of `model` (a vanilla model) on ONNX Runtime where it gives the same answer (see the module
    docstring), and return `model`. `cache_dir`: where graphs are kept (default: $HF_VANILLA_ONNX_CACHE, else
    ~/.cache/hf_vanilla/onnx). `threads`: ONNX Runtime's intra-op threads (default: torch's `get_num_threads()`, so
    both engines use what the process was given). `owned=True`: ONNX Runtime holds the weights of each BERT-style
    body (a float32 model in eval mode, its weights untied from any head), at `precision` "f32" or "int8".
    Calling it again traces the model as it is now: exported once per architecture, cheap otherwise."""
    checked("use_onnx_runtime", precision, precisions=OwnedOnnxEncoder.PRECISIONS, threads=threads,
            cache_dir=cache_dir, owned=owned)
    if owned:  # hold() makes every check of its own
        return hold(model, OwnedOnnxEncoder, precision, threads=threads, cache_dir=cache_dir,
                    call="use_onnx_runtime(owned=True)")
    refuse_quantized(model, "use_onnx_runtime")
    if precision != "f32":
        raise ValueError(f"use_onnx_runtime(precision={precision!r}) needs owned=True: fed the model's weights on "
                         f"every call, ONNX Runtime computes in float32; holding them, it quantizes them once.")
    units = encoder_units(model)
    if not units:
        raise ValueError(f"{type(model).__name__} has no vanilla encoder to run on ONNX Runtime; use_onnx_runtime "
                         f"takes a model from hf_vanilla (VanillaEncoder*, VanillaSeq2Seq*).")
    take_off(model)  # any engine, one holding the weights included: this one feeds them
    cache = GraphCache(cache_dir)
    for unit in units:
        OnnxEncoder.attach(unit, cache, threads or torch.get_num_threads())
    return model


def encoder_units(model) -> list:
    """What runs as one graph: each BERT-style body (embeddings, layers and its pooler), and each encoder-decoder's
    encoder stack. Decoders, causal ones included, stay in PyTorch. The pooler belongs in the graph: a PyTorch op
    right after an ONNX Runtime call waits for torch's threads while ONNX Runtime's still hold the cores, many times
    longer than the op itself takes on one thread."""
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
    """Undo `use_onnx_runtime`: every encoder runs in PyTorch again (those it held get their weights back). Returns
    `model`."""
    return take_off(model, (OnnxEncoder, OwnedOnnxEncoder))


__all__ = ["encoder_units", "length_groups", "remove_onnx_runtime", "runtime_choices", "use_onnx_runtime"]
