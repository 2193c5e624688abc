"""What every engine is: a callable put in front of a module's `forward` (as accelerate's hooks are) that can give
the module back, and the one way to take engines off a model.

A body runs one engine at a time. Attaching one first takes off whatever engine is in front of the model's
modules, so that an engine holding the weights gives them back before another engine reads or takes them (an
OpenVINO-held model handed to `use_onnx_runtime` had no tensor left to export, and failed in torch.export).
"""


class Engine:
    """An engine in front of a module's `forward`."""

    def give_back(self) -> None:
        """Leave the module as it was before the engine came: its own forward (and, for an engine holding the
        weights, its tensors)."""
        raise NotImplementedError


def take_off(model, engine: type | tuple = Engine):
    """Every engine of class `engine` (a class or a tuple of them; by default any) in front of one of `model`'s
    modules gives its module back. Returns `model`."""
    for module in list(model.modules()):
        attached = vars(module).get("forward")
        if isinstance(attached, engine):
            attached.give_back()
    return model
