"""What the engine watches, and why.

Which weights. The graph holds none (`hf_vanilla.export.export_encoder_reading_weights`): each parameter and
buffer is a graph input, fed on every call with the model's own tensor memory (a numpy view, no copy). A write into that
memory by any route (an optimizer step, `load_state_dict`, `p.data.mul_()`, a numpy view of a weight) is what the
next call computes with: there is nothing to detect. What replaces memory or changes the model is detected by a
check on every call (`Watch`, below). When it sees a change, the model is compared by value with what the graph was
traced from (`structure_of`): equal (tensors replaced by others of the same shape: `p.data = ...`,
`vector_to_parameters`, `half().float()`, a deep copy), the new memory is fed; different (a layer removed, a module
replaced as LoRA does, a config value the graph baked in), PyTorch runs, with a warning naming the fix: call
`use_onnx_runtime` again. Forward hooks on the modules inside the encoder (or torch's global ones), which the graph
would not run, send calls to PyTorch while they are set. ONNX Runtime keeps no copy of the weights, and the graph is
the same for every checkpoint of one architecture.

The check on every call costs the same whatever the model's size. A module changes through nn.Module's own code,
and that code asks the module's registries first: `module.x = value` and `del module.x` ask `_parameters` whether
it holds the name (whatever the value: a plain attribute, a training flag, a function, `__class__`), registering a
parameter, buffer or submodule writes into its registry, containers (ModuleList.insert, ModuleDict.pop) write into
`_modules`, and a forward hook is added to and removed from its hook registry. While a `Watch` stands, each module's
registries are counting ones (`_Counting`): every write into them, and every name asked of them that they lack,
moves one count (`CHANGES`); reading a weight asks for a name they hold, and moves nothing. A call compares that
count with the one the watch was made at, and then what no module registry sees: the config's fields, the classes of
the model's own code, torch's global forward hooks and the memory and strides of the tensors it feeds. Where the
count moved, everything is compared as it was when the watch was made (`Watch` has the list), a read of a submodule
(which asks `_parameters` for a name it lacks too) costing that comparison once.
"""

import inspect
import operator
from collections import OrderedDict

import torch
import transformers

from ..compat import CONFIG_STORED_PER_CALL

def hooked(unit) -> bool:
    """Whether forward hooks would run inside the unit (its own run around the engine either way)."""
    return any(GLOBAL_HOOKS) or any(module._forward_hooks or module._forward_pre_hooks
                                     for module in unit.modules() if module is not unit)


_META = operator.attrgetter("shape", "dtype", "is_cpu")
# Moved by every write into a watched module registry, and every name asked of one that it lacks (`_Counting`): one
# count for the whole process, so that a registry needs no word of which watch stands over it.
CHANGES = 0


def note_change() -> None:
    """Move the count: what a watched object says when it changed past its module's registries (an engine's
    marker moved by `model.to(dtype)`, holding.HeldMarker)."""
    global CHANGES
    CHANGES += 1


class _Counting:
    """A module registry (`_parameters`, `_buffers`, `_modules`, its forward hooks) as a `Watch` leaves it: the same
    contents in the same kind of dict, counting (`CHANGES`) every write and every name asked that it lacks. Copied
    or pickled, it is the plain registry."""

    __slots__ = ()

    def __contains__(self, key) -> bool:
        if super().__contains__(key):
            return True
        note_change()  # nn.Module.__setattr__ and __delattr__ ask this before they write anything
        return False

    def __reduce__(self):
        return self.plain, (self.plain(self),)


def _counted(write):
    def counted(self, *args, **kwargs):
        note_change()
        return write(self, *args, **kwargs)
    counted.__name__ = write.__name__
    return counted


def _counting(plain: type) -> type:
    writes = ("__setitem__", "__delitem__", "__ior__", "pop", "popitem", "clear", "update", "setdefault",
              "move_to_end")
    return type(f"Counting{plain.__name__}", (_Counting, plain), {
        "__slots__": (), "__module__": __name__, "plain": plain,
        **{name: _counted(getattr(plain, name)) for name in writes if hasattr(plain, name)}})


_COUNTING = {dict: _counting(dict), OrderedDict: _counting(OrderedDict)}  # torch's registries: dicts; hooks: ordered
_REGISTRIES = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _count_writes(module) -> bool:
    """Leave counting registries in `module` (`_Counting`). Returns whether every one counts: a hook registry holding
    hooks stays as it is (the handles that remove them hold it, not the module), as does a registry of a kind torch
    does not make."""
    state, counts = vars(module), True
    for name in _REGISTRIES:
        registry = state.get(name)
        counting = _COUNTING.get(type(registry))
        if counting is None or (registry and name in _HOOKS):
            counts = counts and isinstance(registry, _Counting)
        else:
            state[name] = counting(registry)
    return counts


def stop_counting(modules) -> None:
    """Give `modules` their plain registries back (a hook registry holding hooks keeps counting: its handles hold
    it)."""
    for module in modules:
        state = vars(module)
        for name in _REGISTRIES:
            registry = state.get(name)
            if isinstance(registry, _Counting) and not (registry and name in _HOOKS):
                state[name] = registry.plain(registry)


# The bases every model and config shares (nn.Module, PreTrainedModel, PreTrainedConfig and their mixins): a method
# patched on one of them is seen where the count moved (the module docstring), not compared at every call.
_SHARED_BASES = frozenset({*transformers.PreTrainedModel.__mro__, *transformers.PretrainedConfig.__mro__})


class Watch:
    """Whether anything but the weights' values changed since it was made: the check on every call.

    Made, it leaves the unit's modules with counting registries (the module docstring) and keeps what it compares:
    every module's attribute dict and its parameter, buffer, submodule and forward hook registries, the config's
    fields, torch's global forward hooks and the attribute dicts of the modules' and config's classes, each as a
    shallow copy (the same objects, so a dict compares by identity, in C); the attribute dicts themselves, the
    modules' classes likewise; and the tensors fed to the graph by data pointer, shape, stride, dtype and device.

    At each call (`unchanged`): the count (`CHANGES`), the config's fields and class, the attribute dicts of the
    classes outside the bases every model shares (`_SHARED_BASES`), torch's global forward hooks and the tensors'
    data pointers and strides (`.data = ...` replaces a tensor's memory or layout unseen by its module; with
    `counted`, tensors that move the count themselves when their data is replaced, an engine's marker: their class,
    which torch's swap_tensors changes). Where the count moved, or the watch could not make every registry count (a
    forward hook set inside when it was made), everything it keeps is compared. Not seen until the count moves: an
    attribute written into a module's `__dict__` past nn.Module (`vars(module)[name] = ...`, `object.__setattr__`),
    a method patched on one of the shared bases, and a tensor narrowed over the same memory and strides (`p.data =
    p.data[:n]`, whose rows the graph reads as before). A change that bypasses all of these leaves the graph's
    answer right: a write into the weights' memory is what the graph reads. `before`: the watch this one replaces,
    whose modules no longer in the unit get their registries back."""

    def __init__(self, unit, tensors: list, before: "Watch | None" = None, counted: bool = False):
        self.changes = CHANGES  # first: a write while the watch is made moves the count past it
        modules = list(unit.modules())
        configs = {id(m.config): m.config for m in modules if isinstance(getattr(m, "config", None),
                                                                         transformers.PretrainedConfig)}
        # Then the registries made to count (after the reads above, which ask them for names they lack).
        self.counts = all([_count_writes(module) for module in modules])  # every module's, whatever the first says
        if before is not None:  # modules the last watch left counting that are no longer in the unit
            inside = set(map(id, modules))
            stop_counting(module for module in before.modules if id(module) not in inside)
        self.modules = modules
        self.configs = list(configs.values())
        self.owners = modules + self.configs  # whose attribute dict must stay the same object
        self.states = list(map(vars, self.owners))
        classes = _classes(self.owners)
        self.dicts = self.states + [registry for m in modules for registry in (
            m._parameters, m._buffers, m._modules, m._forward_hooks, m._forward_pre_hooks)] + list(GLOBAL_HOOKS) \
            + list(map(vars, classes))  # a method patched on a class (the graph runs the old one)
        self.copies = list(map(dict, self.dicts))
        self.types = list(map(type, self.owners))
        # What a call compares besides the count: the configs' fields, the classes outside the shared bases.
        self.config_types = list(map(type, self.configs))
        self.config_states = list(map(vars, self.configs))
        self.own = self.config_states + [vars(cls) for cls in classes if cls not in _SHARED_BASES]
        self.own_copies = list(map(dict, self.own))
        self.tensors, self.meta, self.counted = tensors, _tensor_meta(tensors), counted
        self.at_call = list(map(type, tensors)) if counted else self.meta[:2]  # classes, or `_layout`

    def unchanged(self) -> bool:
        try:
            if CHANGES != self.changes or GLOBAL_HOOKS[0] or GLOBAL_HOOKS[1] or not self.counts:
                return self._unchanged_everywhere()
            return (all(map(operator.eq, self.own, self.own_copies))
                    and list(map(type, self.configs)) == self.config_types
                    and all(map(operator.is_, map(vars, self.configs), self.config_states))
                    and (list(map(type, self.tensors)) if self.counted else _layout(self.tensors)) == self.at_call)
        except (RuntimeError, ValueError):  # an attribute replaced by a tensor or array: == is elementwise
            return False

    def _unchanged_everywhere(self) -> bool:
        """Everything the watch keeps compared with what it kept; where nothing changed, the count the next calls
        compare with is the one read before comparing."""
        changes = CHANGES
        if not (all(map(operator.eq, self.dicts, self.copies)) and list(map(type, self.owners)) == self.types
                and all(map(operator.is_, map(vars, self.owners), self.states))
                and _tensor_meta(self.tensors) == self.meta):
            return False
        self.changes = changes
        return True

    def release(self) -> None:
        """The unit's modules get their plain registries back (the engine gives the unit back)."""
        stop_counting(self.modules)


def _classes(objects) -> list:
    """Every class in the MROs of `objects`' classes but `object`."""
    return list({cls: None for obj in objects for cls in type(obj).__mro__ if cls is not object})


def class_code(unit) -> dict:
    """What the unit's modules' classes (and their bases) hold, each attribute by identity: a method patched on a
    class after tracing (`VanillaFeedForward.forward = patched`) changes what PyTorch runs but not the graph. What no
    call of a module that exists runs (`run_by_a_call`) is left out."""
    return {cls: {name: value for name, value in vars(cls).items() if run_by_a_call(name)}
            for cls in _classes(unit.modules())}


def _layout(tensors: list) -> tuple:
    """Where each tensor's memory is and how it is laid out: what `.data = ...` changes unseen by its module."""
    return list(map(torch.Tensor.data_ptr, tensors)), list(map(torch.Tensor.stride, tensors))


def _tensor_meta(tensors: list) -> tuple:
    with torch._C.DisableTorchFunctionSubclass():  # an engine's marker (holding.HeldMarker) is read as a tensor
        return (*_layout(tensors), list(map(_META, tensors)))


def run_by_a_call(name: str) -> bool:
    """Whether a class attribute of this name can run when a module that exists is called: not what makes a module
    or restores one from a pickle, nor the flag torch.compile leaves beside them. torch.compile, the first time it runs
    anywhere in the process, wraps nn.Module.__init__ and __setstate__ and flags nn.Module as done
    (torch._dynamo.mutation_guard.install_generation_tagging_init, to tag the modules made after it; the flag is
    `___needs_generation_tag_patch` in torch 2.13, `___has_generation_tag_patch` in 2.15): counted as a patched class,
    it sent every engine attached before back to PyTorch (runtime="onnxruntime") or through a recompilation."""
    return name not in ("__init__", "__new__", "__setstate__") and not name.endswith("_generation_tag_patch")


# torch's global forward hooks run around every module's forward: inside the graph they would not run.
GLOBAL_HOOKS = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks)
# What a module's attribute dict holds besides what it computes with: registries (walked apart), hooks and the
# training flag (documented reasons to run PyTorch, checked apart), and where the weights came from.
_MODULE_BOOKKEEPING = {"_parameters", "_buffers", "_modules", "training", "_is_full_backward_hook", "_backward_hooks",
                       "_backward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
                       "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                       "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                       "_load_state_dict_post_hooks", "name_or_path"}
# Config fields read on every call rather than traced (the engine checks them itself, or they choose among kernels
# of the same function), and where the weights came from.
_CONFIG_PER_CALL = {"output_hidden_states", "return_dict", "use_cache", *CONFIG_STORED_PER_CALL}
# Config fields no forward of the body reads: what save_pretrained writes into the config it saves (the dtype, spelt
# "float32" once saved where it was torch.float32; the architectures; the remote-code map; the version), and
# generate()'s settings but the token ids (a position scheme may read the padding id). Counted as changes, a routine
# save_pretrained sent runtime="onnxruntime" to PyTorch for good and made the engines that hold the weights compile
# again. The weights' own dtype is watched apart, on the tensors.
_CONFIG_NOT_COMPUTED = {"dtype", "torch_dtype", "architectures", "auto_map", "transformers_version", "_commit_hash",
                        *(name for name in transformers.GenerationConfig().to_dict() if not name.endswith("token_id"))}


def structure_of(unit) -> dict:
    """What the graph was traced from, by value, the weights' values aside: for every module (by path) its class,
    its attributes, its parameters' and buffers' shapes (and which name another tensor's is), and the config's
    fields. Plain data compares by value; any other object by identity (its state is not seen, so only that very
    object is the same)."""
    structure, first_name, configs = {}, {}, {}
    for path, module in unit.named_modules(remove_duplicate=False):
        attributes = {name: value for name, value in vars(module).items() if name not in _MODULE_BOOKKEEPING
                      and not (module is unit and name == "forward")}  # the engine itself
        tensors = {}
        for registry in (module._parameters, module._buffers):
            for name, tensor in registry.items():
                full = f"{path}.{name}" if path else name
                tensors[name] = None if tensor is None else (list(tensor.shape),
                                                              first_name.setdefault(id(tensor), full))
        structure[path] = {"class": _plain(type(module), configs), "attributes": _plain(attributes, configs),
                           "tensors": tensors, "children": [name for name in module._modules]}
    return structure


def _plain(value, configs: dict):
    """`value` as JSON-able plain data: compared by value, and hashed into the cache key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item, configs) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, (_plain(item, configs) for item in value)))
    if isinstance(value, dict):
        return {str(key): _plain(item, configs) for key, item in value.items()}
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, transformers.PretrainedConfig):
        if id(value) not in configs:
            configs[id(value)] = {"class": _plain(type(value), configs), "fields": _plain(
                {name: field for name, field in vars(value).items()
                 if name not in _CONFIG_PER_CALL and name not in _CONFIG_NOT_COMPUTED}, configs)}
        return configs[id(value)]
    if isinstance(value, type) or inspect.isroutine(value):
        return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', value.__name__)}"
    return f"<{type(value).__module__}.{type(value).__qualname__} object {id(value)}>"


def difference(reference: dict, current: dict) -> str:
    """Where two structures first differ, for the warning: a module and what of it, or a config field."""
    path = next(p for p in sorted(set(reference) | set(current)) if reference.get(p) != current.get(p))
    was, now = reference.get(path), current.get(path)
    if was is None or now is None:
        return f"{path} {'added' if was is None else 'removed'}"
    part = next(p for p in was if was[p] != now[p])
    if part != "attributes":
        return f"{path or 'the encoder'}: {part}"
    name = next(n for n in sorted(set(was[part]) | set(now[part])) if was[part].get(n) != now[part].get(n))
    if name == "config" and all(isinstance(c[part].get(name), dict) for c in (was, now)):
        old, new = was[part][name]["fields"], now[part][name]["fields"]
        return "config." + next(f for f in sorted(set(old) | set(new)) if old.get(f) != new.get(f))
    return f"{path + '.' if path else ''}{name}"


