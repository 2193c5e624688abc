"""The engines `from_pretrained(path, runtime=NAME, runtime_options={...})` can put behind a loaded model, by name.

As transformers' `from_pretrained(quantization_config=...)` finds its quantizer, the model finds its engine here and
never imports one: an engine is a function `apply(model, **options) -> model` that wraps the model's modules from
beside it, through their public API, and lives in its own module (hf_vanilla/runtimes/ for the built-in ones).
Each is named here as "module:function" and imported only when asked for, so that this file stays what the
model files may import: it travels with every `trust_remote_code` checkpoint (transformers copies relative
imports), and imports nothing but the standard library. Where hf_vanilla is not installed (a checkpoint's own copy
of the code), the built-in names give an error that says so. An engine that chooses among the others
(runtime="auto") declares a parameter `apply_runtime` and is handed `apply_runtime` itself: it reaches them by
name, through this registry, as the model does, without importing this file, which names it.

    from hf_vanilla.runtime_registry import register_runtime
    register_runtime("my-engine", "my_package.engine:apply", install="pip install my-package")
"""

import importlib
import inspect

_ONNX_EXTRA = 'pip install "hf_vanilla[onnx]"'

# name -> (the "module:function" that applies it, how to install what it imports)
_RUNTIMES = {
    "onnxruntime": ("hf_vanilla.runtimes.onnxruntime:use_onnx_runtime", _ONNX_EXTRA),
    "openvino": ("hf_vanilla.runtimes.openvino:use_openvino", 'pip install "hf_vanilla[openvino]"'),
    "auto": ("hf_vanilla.runtimes.auto:use_auto", _ONNX_EXTRA),  # the fastest of those installed, measured here
}
_INJECTED = "apply_runtime"  # the parameter an engine declares to be handed `apply_runtime` (the module docstring)


def register_runtime(name: str, apply: str, install: str) -> None:
    """Make `runtime=name` call `apply` ("module:function", imported when first asked for) with the model and the
    `runtime_options`. `install` is the command that installs what the module imports, quoted in the error when
    that is missing."""
    module, _, function = apply.partition(":")
    if not module or not function:
        raise ValueError(f"register_runtime({name!r}, {apply!r}): name the function as 'module:function'.")
    _RUNTIMES[name] = (apply, install)


def apply_runtime(model, name: str, **options):
    """`model` with the engine `name` behind it (what `from_pretrained(runtime=name)` returns). An engine whose
    function declares `apply_runtime` is handed this function too, and puts the other engines on by name through it
    (runtime="auto" on the copies it measures), never importing this module, which imports it."""
    if name not in _RUNTIMES:
        raise ValueError(f"Unknown runtime {name!r}: pass one of {sorted(_RUNTIMES)}, leave it out for PyTorch, or "
                         f"register yours with hf_vanilla.runtime_registry.register_runtime.")
    target, install = _RUNTIMES[name]
    module_name, _, function = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not (module_name + ".").startswith(error.name + "."):
            raise ImportError(f"runtime={name!r} needs {error.name}, which is not installed: {install}.") from error
        # The engine's own module is missing: this model's code came from its checkpoint (trust_remote_code).
        raise ImportError(f"runtime={name!r} comes with the {module_name.split('.')[0]} package, which is not "
                          f"installed here: {install}.") from error
    apply = getattr(module, function)
    _refuse_unknown(name, apply, options)
    if _INJECTED in inspect.signature(apply).parameters:  # an engine that reaches the others by name
        options = {**options, _INJECTED: apply_runtime}
    return apply(model, **options)


def _refuse_unknown(name: str, apply, options: dict) -> None:
    """A runtime_options key that the engine's function does not take, refused naming those it does (Python's own
    TypeError names only the wrong one, and the function, not the runtime); `apply_runtime`, which the registry
    hands over and no user passes, is not one of them."""
    if _INJECTED in options:
        raise ValueError(f"runtime={name!r} takes no option {_INJECTED!r}: it is not a runtime option, the registry "
                         f"hands its own to the engines that declare it.")
    parameters = list(inspect.signature(apply).parameters.values())[1:]  # after the model
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        return
    accepted = [parameter.name for parameter in parameters
                if parameter.kind is not parameter.VAR_POSITIONAL and parameter.name != _INJECTED]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"runtime={name!r} takes no option {unknown[0]!r}: runtime_options takes {accepted}.")
