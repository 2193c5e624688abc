"""What every engine is: a callable put in front of a module's `forward` (as accelerate's hooks are) that can give
the module back, and the one way to take engines off a model.

A body runs one engine at a time. Attaching one first takes off whatever engine is in front of the model's
modules, so that an engine holding the weights gives them back before another engine reads or takes them (an
OpenVINO-held model handed to `use_onnx_runtime` had no tensor left to export, and failed in torch.export).
"""
from ..precision import Int8Embedding, Int8Linear


class Engine:
    """An engine in front of a module's `forward`."""

    def give_back(self) -> None:
        """Leave the module as it was before the engine came: its own forward (and, for an engine holding the
        weights, its tensors)."""
        raise NotImplementedError


def engine_of(module) -> Engine | None:
    """The engine in front of `module`'s forward, or None: an engine is an attribute of the module itself, set over
    its class's `forward`, so the module's own `__dict__` is read, never the class's method."""
    found = vars(module).get("forward")
    return found if isinstance(found, Engine) else None


def take_off(model, engine: type | tuple = Engine):
    """Every engine of class `engine` (a class or a tuple of them; by default any) in front of one of `model`'s
    modules gives its module back. Returns `model`."""
    for module in list(model.modules()):
        attached = engine_of(module)
        if isinstance(attached, engine):
            attached.give_back()
    return model


def refuse_quantized(model, call: str) -> None:
    """Engines export the float32 (or bfloat16) model and make their own reduced copies; a model whose projections
    `quantize_int8` replaced has no float32 weights for them to read (torch.export failed on it, unexplained)."""
    quantized = [name for name, module in model.named_modules() if isinstance(module, (Int8Linear, Int8Embedding))]
    if quantized:
        raise ValueError(f"{call} takes a float32 model, and {quantized[0]} is int8 (quantize_int8): pass the model "
                         f"as it was before quantize_int8 and ask the engine for int8 (use_openvino(model, "
                         f"precision='int8'), use_onnx_runtime(model, owned=True, precision='int8')): it quantizes "
                         f"its own copy.")
