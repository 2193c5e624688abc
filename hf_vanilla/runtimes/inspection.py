"""What a user or a library asks of a model whose encoder weights an engine holds, to inspect it
(hf_vanilla/runtimes/owned.py says why the engine holds them): the parameter count, the memory footprint, the
parameters by name and the lookups by name, answered from the engine's copy under the body's names, as PyTorch would answer them without the
engine. `hold` puts these answers on each PreTrainedModel of a model it holds (`answer_for_held`)."""

import functools

import torch

from .attached import engine_of
from .holding import HeldTensor, HeldWeights, raw_attr

# The methods answered on each PreTrainedModel of a model an engine holds, for the weights the engines hold.
_LOOKUPS = (("get_parameter", {True}), ("get_buffer", {False}), ("get_parameter_or_buffer", {True, False}))
HOLD_METHODS = ("num_parameters", "get_memory_footprint", "named_parameters", "parameters",
                *(name for name, _ in _LOOKUPS))


def answer_for_held(module) -> None:
    """Put the answers of this module on `module` (a PreTrainedModel), as attributes of the instance."""
    vars(module).update(num_parameters=functools.partial(num_parameters, module),
                        get_memory_footprint=functools.partial(memory_footprint, module),
                        named_parameters=functools.partial(named_parameters, module),
                        parameters=functools.partial(parameters, module))
    vars(module).update({name: functools.partial(or_held, getattr(type(module), name), kinds, module)
                         for name, kinds in _LOOKUPS if hasattr(type(module), name)})


def held_tensors(model, buffers: bool = False):
    """(name, tensor, trainable) of every parameter (or buffer) of `model` as PyTorch would list them without the
    engines: where an engine holds a body's, its copy's under the body's names, trainable as they will be when it
    gives them back; the engines' empty markers left out."""
    engines = {path: engine for path, module in model.named_modules()
               if isinstance(engine := engine_of(module), HeldWeights)}
    markers = {f"{path}.{engine.marker}" if path else engine.marker for path, engine in engines.items()}
    for name, tensor in model.named_buffers() if buffers else torch.nn.Module.named_parameters(model):
        if name not in markers:
            yield name, tensor, tensor.requires_grad
    for path, engine in engines.items():
        seen = set()
        for name, tensor, parameter, _ in engine.kept():
            if parameter != buffers and id(tensor) not in seen:
                seen.add(id(tensor))
                trainable = parameter and _trainable(engine, name)
                yield f"{path}.{name}" if path else name, tensor, trainable


def named_parameters(model, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
    """`nn.Module.named_parameters`, listing each weight an engine holds under its name, as its read-only view
    (`HeldTensor`), where PyTorch would list the engine's empty marker: an edit loop by name (`if "up_proj" in name:
    p.mul_(1.5)`) finds what it finds in the plain model, and its write is refused by name rather than finding
    nothing. `parameters()` still yields the marker (`parameters` below): what acts on all of them at once
    (`requires_grad_()`, an optimizer, `model.dtype`) acts on the engine through it."""
    seen = set()
    modules = model.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, model)]
    for path, module in modules:
        engine = engine_of(module)
        marker = engine.marker if isinstance(engine, HeldWeights) else None
        listed = [(name, tensor) for name, tensor in module._parameters.items() if name != marker]
        taken = vars(module).get("extra_repr")
        if isinstance(taken, functools.partial) and isinstance(taken.args[0], HeldWeights):  # `held_repr`
            held, where = taken.args
            for name in held.held.get(where, ()):
                if isinstance(view := vars(module).get(name), HeldTensor) and view.parameter:
                    with torch._C.DisableTorchFunctionSubclass():  # trainable as `give_back` would leave it
                        view.requires_grad_(_trainable(held, f"{where}.{name}" if where else name))
                    listed.append((name, view))
        for name, tensor in listed:
            if tensor is None or (remove_duplicate and id(tensor) in seen):
                continue
            seen.add(id(tensor))
            yield f"{path}.{name}" if path else name, tensor


def _trainable(engine, name: str) -> bool:
    """Whether the held parameter `name` (as the body named it when taken) trains once given back: the marker's
    requires_grad where `requires_grad_()` set it since, else as it was at attach."""
    marker = engine.unit._parameters.get(engine.marker)
    if marker is not None and raw_attr(marker, "requires_grad") != engine.trainable:
        return not engine.trainable
    return name not in engine.frozen


def parameters(model, recurse: bool = True):
    """`nn.Module.parameters` as PyTorch lists them: the engines' markers where they hold the weights (the module
    docstring of hf_vanilla/runtimes/owned.py says why)."""
    for _, tensor in torch.nn.Module.named_parameters(model, recurse=recurse):
        yield tensor


def num_parameters(model, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """transformers' `PreTrainedModel.num_parameters`, counting the weights the engines hold."""
    embeddings = {f"{name}.weight" for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Embedding)} if exclude_embeddings else set()
    return sum(tensor.numel() for name, tensor, trainable in held_tensors(model)
               if name not in embeddings and (trainable or not only_trainable))


def or_held(lookup, kinds: set, model, target: str):
    """`lookup(model, target)` (nn.Module's `get_parameter`, `get_buffer`, transformers' `get_parameter_or_buffer`),
    answering the name of a held weight of the kind it looks for (`kinds`: whether a parameter) with its view
    (`HeldTensor`), where torch finds no Parameter or buffer there."""
    try:
        return lookup(model, target)
    except AttributeError:
        path, _, name = target.rpartition(".")
        view = vars(model.get_submodule(path)).get(name)
        if isinstance(view, HeldTensor) and view.parameter in kinds:
            return view
        raise


def memory_footprint(model, return_buffers: bool = True) -> int:
    """transformers' `PreTrainedModel.get_memory_footprint`, counting the weights the engines hold (their own
    copies; what a compilation lays out for its kernels besides is the engine's, not counted)."""
    tensors = [*held_tensors(model), *(held_tensors(model, buffers=True) if return_buffers else ())]
    return sum(tensor.nelement() * tensor.element_size() for _, tensor, _ in tensors)
