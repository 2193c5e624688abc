"""The weights an engine holding them keeps (hf_vanilla/runtimes/owned.py says the contract): a private copy of the
body (the shadow) holds every tensor, and the body the user holds shows them without owning any. This module is that
mechanism, below the engine that compiles and calls: the one empty parameter the body keeps (`HeldMarker`), the
read-only views it shows in each tensor's place (`HeldTensor`), the outputs whose gradients are refused, the one
shape of a refusal, and `HeldWeights`, what an `OwnedEncoder` does to show the held tensors, find them again and
give them back into the body.
"""

import copy
import functools
import types
import weakref

import torch

from .watch import note_change, structure_of


def refusal(engine, attempted: str, then: str = "") -> str:
    """The one shape of every refusal of an engine holding the weights: what was attempted, which engine holds them,
    and the call that gives them back (then what to do)."""
    return (f"{attempted} is refused: runtime={engine.RUNTIME!r} holds this encoder's weights, compiled into the "
            f"engine. Call {engine.REMOVE} to give them back to the model{', then ' + then if then else ''}.")


# What a refused write says to do instead.
EDIT = ("edit the model; or load the new values with model.load_state_dict(...), which the engine follows "
        "(model.state_dict() gives read-only views of its weights: .clone() one to change it)")


def raw_attr(tensor: torch.Tensor, name: str):
    """A tensor's attribute (`requires_grad`, `device`), read past any subclass's `__torch_function__`."""
    with torch._C.DisableTorchFunctionSubclass():
        return getattr(tensor, name)


class HeldMarker(torch.nn.Parameter):
    """The one parameter a held body keeps (`OwnedEncoder.marker`): empty, standing where the encoder's weights were,
    so that `model.parameters()` is not empty, `model.to(...)` reaches the engine and `model.dtype` /
    `model.device` answer. Its `requires_grad` is the held weights' (what `give_back` gives them): set at attach,
    then by `model.requires_grad_()`; the engine refuses gradients while it is set.

    What treats it as the weights is refused where it happens, naming the engine: an in-place write (`p.mul_()`
    over `model.parameters()`, an optimizer's step, `p.data.zero_()`), and `.data =` of anything but a move of the
    marker itself (`vector_to_parameters`, `to_empty`); it would change nothing, and the user would believe the
    model changed. A move to a dtype is let through (the engine follows it or refuses it at the next call); to
    another device, refused there, before torch moves anything after it."""

    @staticmethod
    def of(engine, dtype: torch.dtype, requires_grad: bool) -> "HeldMarker":
        marker = HeldMarker(torch.empty(0, dtype=dtype), requires_grad)
        marker.RUNTIME, marker.REMOVE = engine.RUNTIME, engine.REMOVE  # what `refusal` names
        return marker

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _marker_function(func, args, kwargs or {})

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = HeldMarker.of(self, raw_attr(self, "dtype"), raw_attr(self, "requires_grad"))
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return _marker, (self.RUNTIME, self.REMOVE, raw_attr(self, "dtype"), raw_attr(self, "requires_grad"))


class _MarkerView(torch.Tensor):
    """What shares the marker's (empty) memory: `marker.data`, `marker.detach()`, a view; it refuses writes as the
    marker does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _marker_function(func, args, kwargs or {})


def _marker(runtime: str, remove: str, dtype: torch.dtype, requires_grad: bool) -> HeldMarker:
    """A pickled marker, unpickled."""
    return HeldMarker.of(types.SimpleNamespace(RUNTIME=runtime, REMOVE=remove), dtype, requires_grad)


# In-place methods that write nothing of the marker's: its flag, and the shared memory `Module.share_memory()` asks.
_MARKER_FLAGS = {"requires_grad_", "share_memory_"}
# What a module's moves (`Module.to`, `.cuda()`, `.to_empty()`) call on each parameter.
_MOVES = {"to", "cuda", "cpu", "xpu", "ipu", "mtia", "type", "empty_like"}
_STANDS_IN = "model.parameters() yields an empty marker where the encoder's weights were"


def _marker_function(func, args: tuple, kwargs: dict):
    """`__torch_function__` of the marker and its views (`HeldMarker`)."""
    name = getattr(func, "__name__", "")
    guarded = [a for a in _flat((*args, *kwargs.values())) if isinstance(a, (HeldMarker, _MarkerView))]
    marker = next((a for a in guarded if isinstance(a, HeldMarker)), guarded[0])
    target = kwargs["out"] if "out" in kwargs else (args[0] if args else None)
    ours = any(target is a for a in guarded)
    if name == "__set__" and ours:  # a property set: args = (tensor, value)
        prop, value = _property(func), args[1]
        if prop == "data":
            with torch._C.DisableTorchFunctionSubclass():
                device, moved = value.device, value.dtype != target.dtype or value.device != target.device
                alias = torch._C._is_alias_of(value, target)
            if device.type != "cpu":
                raise RuntimeError(refusal(marker, f"Moving the model to {device}", "move the model"))
            if not (moved or alias):
                raise RuntimeError(refusal(marker, f"Replacing the model's parameters (.data = ..., as "
                                                   f"vector_to_parameters and to_empty do: {_STANDS_IN})", EDIT))
        elif prop not in ("requires_grad", "grad"):
            raise RuntimeError(refusal(marker, f"Setting the model's parameters' .{prop}", EDIT))
    elif ours and ("out" in kwargs or name in _WRITES or (name.endswith("_") and not name.startswith("_"))):
        itself = name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) and \
            torch._C._is_alias_of(args[1], target)  # load_state_dict copies the marker onto itself (`load`)
        if name not in _MARKER_FLAGS and not itself:
            raise RuntimeError(refusal(marker, f"Writing the model's parameters ({name}: {_STANDS_IN})", EDIT))
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
        device = result.device if isinstance(result, torch.Tensor) else None
    if name == "__set__" and ours and _property(func) == "data":
        note_change()  # model.to(dtype) moved the marker: the engine's check sees it at the next call (watch.py)
    if name in _MOVES and ours and device is not None and device.type != "cpu":  # torch replaces a parameter moved
        raise RuntimeError(refusal(marker, f"Moving the model to {device}", "move the model"))  # to another device
    if isinstance(result, torch.Tensor) and not isinstance(result, (HeldMarker, _MarkerView)) and any(
            torch._C._is_alias_of(result, a) for a in guarded):
        view = result.as_subclass(_MarkerView)
        view.RUNTIME, view.REMOVE = marker.RUNTIME, marker.REMOVE
        return view
    return result


def _flat(items):
    """The items of `items`, those inside lists and tuples too (torch.cat's tensors)."""
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flat(item)
        else:
            yield item


class HeldTensor(torch.Tensor):
    """A weight an engine holds, as the body shows it (`layer.weight`): a view of the engine's own copy that answers
    every read as the tensor does (what it computes is a plain tensor) and refuses every write (an in-place op, an
    `out=`, `.data =`, `requires_grad_()`, a numpy view written), naming the call that gives the weights back. The
    engine's compilation reads that memory, so a write that got through would change one path's answers and not the
    other's. A deep copy is the copied engine's own view; a pickle holds none (the unpickled engine shows its copy's
    views at its first call, `OwnedEncoder._expose`)."""

    WRITING = "Writing a weight"  # what a refused write attempted, in its message

    @classmethod
    def of(cls, tensor: torch.Tensor, engine, parameter: bool | None = None, where=None) -> "HeldTensor":
        """A view of `tensor` (the shadow's), refusing writes in the name of `engine`; `where`: (module path, name)
        of the held weight it shows, None for a view of a view."""
        view = tensor.detach().as_subclass(cls)
        view.engine, view.where = engine, where
        view.parameter = isinstance(tensor, torch.nn.Parameter) if parameter is None else parameter
        return view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # What an in-place call writes: its `out=`, else its first tensor (torch.nn.init passes it by keyword).
        target = kwargs["out"] if "out" in kwargs else next(
            (a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
        writes = "out" in kwargs or name in _WRITES or (name.endswith("_") and not name.startswith("_"))
        held = next((a for a in [target, *args] if isinstance(a, HeldTensor)), None)
        if name == "__set__" and isinstance(target, Taken) and _property(func) == "grad":
            writes = False  # an optimizer's zero_grad: the weight is not written
        if writes and isinstance(target, HeldTensor) or (name == "requires_grad_" and held is not None):
            raise RuntimeError(refusal(held.engine, f"{held.WRITING} ({name})", EDIT))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return _held_views(result, held)

    def numpy(self, *args, **kwargs):
        array = torch.Tensor.numpy(self.as_subclass(torch.Tensor), *args, **kwargs)
        array.flags.writeable = False  # numpy's own refusal of a write: the memory is the engine's
        return array

    def __reduce_ex__(self, protocol):
        """A view the body shows pickles as nothing (the unpickled engine shows its copy's views at its first call);
        any other (a state dict's, `torch.save(model.state_dict())`) as the plain tensor it reads as."""
        if self.where is not None:
            return type(None), ()
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

    def __deepcopy__(self, memo):
        """The same weight of the copied engine's copy (a view of a view: a plain copy)."""
        if self.where is None:
            return self.as_subclass(torch.Tensor).clone()
        engine = copy.deepcopy(self.engine, memo)
        path, name = self.where
        return HeldTensor.of(getattr(engine.shadow.get_submodule(path), name), engine, self.parameter, self.where)


class Taken(HeldTensor):
    """A buffer of the body as the user may still hold it from before the engine took it (`seal`): the same tensor
    object, over the memory the engine was compiled from, refusing every write as a held view does. Without it, a
    write through it (a tensor kept by an EMA, a tied module outside the model) would reach PyTorch's path and not
    the engine's."""

    WRITING = "Writing a weight through a reference taken before the engine held it"


class TakenParameter(Taken, torch.nn.Parameter):
    """A parameter of the body as the user may still hold it from before the engine took it (an optimizer's, one
    from `model.get_parameter`): `Taken`, still a Parameter; copied or pickled, a plain Parameter."""

    def __deepcopy__(self, memo):
        return torch.nn.Parameter(_plain(self).clone(), raw_attr(self, "requires_grad"))

    def __reduce_ex__(self, protocol):
        return torch._utils._rebuild_parameter, (_plain(self), raw_attr(self, "requires_grad"), {})


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor).detach()


def seal(tensors: list, engine) -> list:
    """Turn each of the body's own tensors (what references taken before attach point at) into `Taken` in place,
    refusing writes in the name of `engine`. Returns what `unseal` needs: (weak reference, class) of each."""
    sealed = []
    for tensor in {id(t): t for t in tensors}.values():
        if isinstance(tensor, HeldTensor) or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            continue  # a subclass of the user's own keeps its class (its writes are followed as today's are not)
        sealed.append((weakref.ref(tensor), type(tensor)))
        tensor.__class__ = TakenParameter if isinstance(tensor, torch.nn.Parameter) else Taken
        tensor.engine, tensor.where, tensor.parameter = engine, None, isinstance(tensor, torch.nn.Parameter)
    return sealed


def unseal(sealed: list) -> dict:
    """Give each tensor `seal` turned back its own class. Returns those still alive by where their memory is
    (`alias_key`): the body gets them back where the engine's copy still shares that memory."""
    alive = {}
    for reference, cls in sealed:
        tensor = reference()
        if tensor is None or not isinstance(tensor, Taken):
            continue
        for name in ("engine", "where", "parameter"):
            vars(tensor).pop(name, None)
        tensor.__class__ = cls
        alive[alias_key(tensor)] = tensor
    return alive


def alias_key(tensor: torch.Tensor) -> tuple:
    """Where a tensor's values are: two tensors with the same key read the same memory the same way."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device


def _property(func) -> str:
    """The name of the property a `__set__` in `__torch_function__` sets."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


# Tensor methods and attributes that write into a tensor besides the in-place ops (named with a trailing _).
_WRITES = {"__setitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
           "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _held_views(result, held):
    """`result` of an op on a held tensor: what shares its memory stays held (a view, `.data`, `.detach()`), the
    rest is a plain tensor."""
    if isinstance(result, (tuple, list)):
        return type(result)(_held_views(item, held) for item in result)
    if not isinstance(result, torch.Tensor) or held is None:
        return result
    if result.device.type != "meta" and result.untyped_storage().data_ptr() == held.untyped_storage().data_ptr():
        return (Taken if isinstance(held, Taken) else HeldTensor).of(result, held.engine, held.parameter)
    return result.as_subclass(torch.Tensor) if isinstance(result, HeldTensor) else result


class _NoGradient(torch.autograd.Function):
    """The body's outputs as a node of the autograd graph whose backward refuses by name: in eager PyTorch they
    would carry the encoder's gradients, which weights compiled into an engine cannot give (without it, backward()
    fails on 'element 0 of tensors does not require grad', or trains the head alone while the user meant the
    encoder too)."""

    @staticmethod
    def forward(ctx, message: str, anchor, *outputs):
        ctx.message = message
        return tuple(output.view_as(output) for output in outputs)

    @staticmethod
    def backward(ctx, *gradients):
        raise RuntimeError(ctx.message)


_ANCHOR = torch.zeros((), requires_grad=True)  # what puts `_NoGradient` into the graph; it never gets a gradient


def refuse_gradients(output, message: str):
    """`output` (a ModelOutput or a tuple) with its floating-point tensors behind `_NoGradient`."""
    keys = list(output.keys()) if isinstance(output, dict) else range(len(output))
    keys = [key for key in keys if isinstance(output[key], torch.Tensor) and output[key].is_floating_point()]
    refused = _NoGradient.apply(message, _ANCHOR, *(output[key] for key in keys))
    if isinstance(output, dict):
        for key, tensor in zip(keys, refused):
            output[key] = tensor
        return output
    replaced = dict(zip(keys, refused))
    return type(output)(replaced.get(index, item) for index, item in enumerate(output))


def held_repr(engine, path: str = "") -> str:
    """What `print(model)` shows of a module whose tensors the engine holds; `path`, where the module was in the body
    when they were taken (what `give_back` puts back into it, wherever it is now)."""
    return f"weights held by runtime={engine.RUNTIME!r}: {engine.REMOVE} gives them back"


def sharing_copy(unit):
    """A deep copy of `unit` (a body, or a whole model; its config object shared) whose parameters and buffers are
    new tensors over `unit`'s memory, not copies of it: a checkpoint loaded memory-mapped stays so, never
    materialised a second time. New Parameters, not requiring grad: what the copy's moves and flags change is its
    own."""
    memo = {id(unit.config): unit.config}
    for tensor in [*unit.parameters(), *unit.buffers()]:
        shared = tensor.detach()
        memo[id(tensor)] = torch.nn.Parameter(shared, False) if isinstance(tensor, torch.nn.Parameter) else shared
    return copy.deepcopy(unit, memo)


def tensors_of(shadow, dtype: torch.dtype | None = None) -> dict:
    """The shadow's tensors by the names the graph reads them, as float32 numpy arrays; rounded to `dtype` first
    where given (what a move to it would hold)."""
    return {name: (tensor.detach() if dtype is None else tensor.detach().to(dtype)).float().numpy()
            for name, tensor in [*shadow.named_parameters(), *shadow.named_buffers()]}


class HeldWeights:
    """The body's tensors held in the engine's `shadow`: shown in the body as `HeldTensor` views (`_expose`), found
    under the names they have now (`kept`) and given back (`give_back`). A mixin of `OwnedEncoder`, which sets what
    it reads: `unit` (the body), `shadow`, `held` (module path -> the names taken from it), `sealed` (`seal`),
    `RUNTIME`, `REMOVE`, `trainable`, `frozen`, `marker`, and `_watch()` (the per-call check, taken again with the
    views)."""

    def _expose(self) -> None:
        """Each held tensor readable where the body kept it (`layer.weight`, `model.get_input_embeddings().weight`):
        a `HeldTensor` view of the shadow's, which answers every read and refuses every write, naming the call that
        gives the weights back. Shown anew whenever the shadow's tensors change; then what the per-call check
        compares is taken again (the body's attributes now hold the new views)."""
        own = dict(self.shadow.named_modules())
        for path, names in self.held.items():
            module, source = self.unit.get_submodule(path), own[path]
            for name in names:
                tensor = getattr(source, name)
                vars(module)[name] = None if tensor is None else HeldTensor.of(tensor, self, where=(path, name))
        self.structure = structure_of(self.unit)
        self.watch = self._watch()

    def give_back(self) -> None:
        """Put the shadow's tensors back into the body, each into the module it was taken from (found by the
        `held_repr` it was given, wherever it is now) under its own name, and the body's own forward and state-dict
        methods. What the user put in a tensor's place since is the user's, as PyTorch keeps it: a Parameter
        assigned or a buffer registered under that name (the shadow's is dropped, the module's others come back), or
        None (`module.bias = None`: registered as None); a name deleted stays deleted; a module that replaced one
        holds its own tensors. The marker's `requires_grad`, where it was set since, is every returned parameter's.
        A tensor the body had before the engine took it (`seal`) is itself given back where the engine's copy still
        shares its memory (nothing was loaded or moved since), so a reference kept from before writes the model
        again."""
        unit, own = self.unit, dict(self.shadow.named_modules())
        if vars(self).get("watch") is not None:  # the body's modules get their plain registries back
            self.watch.release()
        originals, self.sealed = unseal(self.sealed), []
        vars(unit).pop("forward", None)
        for hooks in (unit._state_dict_hooks, unit._load_state_dict_pre_hooks):
            for key in [key for key, hook in hooks.items() if getattr(getattr(hook, "hook", hook), "args", ())[:1]
                        == (self,)]:
                del hooks[key]
        marker = unit._parameters.pop(self.marker, None)
        trainable = self.trainable if marker is None else raw_attr(marker, "requires_grad")
        returned = []
        for module in unit.modules():
            taken = vars(module).get("extra_repr")
            if not (isinstance(taken, functools.partial) and taken.func is held_repr and taken.args[0] is self):
                continue  # not one this engine took from (a module added since holds its own tensors)
            del vars(module)["extra_repr"]
            path = taken.args[1]
            source = own[path]
            for name in self.held[path]:
                kind = "_parameters" if name in source._parameters else "_buffers"
                tensor = getattr(source, kind)[name]
                if name in module._parameters or name in module._buffers or name not in vars(module):
                    continue  # registered anew (the user's own tensor), or deleted (`del module.weight`)
                shown = vars(module).pop(name)
                if self._shows(shown, path, name, tensor):  # the user's own tensor where it still is the weight
                    tensor = tensor if tensor is None else originals.get(alias_key(tensor), tensor)
                    getattr(module, kind)[name] = tensor
                    returned += [(module, name)] if kind == "_parameters" and tensor is not None else []
                elif shown is None:  # `module.bias = None`: PyTorch registers None in the tensor's place
                    getattr(module, kind)[name] = None
                elif (tied := self._viewed(shown)) is not None:  # `a.weight = b.weight`: tied, as in PyTorch
                    getattr(module, "_parameters" if shown.parameter else "_buffers")[name] = tied
                else:  # a tensor set as a buffer (what `_refuse_as_torch` lets through): PyTorch registers it
                    module._buffers[name] = shown
            for registry in (module._parameters, module._buffers):  # in the order PyTorch keeps: the taken names'
                for name in [*(name for name in self.held[path] if name in registry),
                             *(name for name in list(registry) if name not in self.held[path])]:
                    registry[name] = registry.pop(name)
            module._non_persistent_buffers_set.update(source._non_persistent_buffers_set & set(module._buffers))
        paths = {id(module): path for path, module in unit.named_modules()}
        for module, name in returned:
            path = paths.get(id(module))
            full = f"{path}.{name}" if path else name
            module._parameters[name].requires_grad_(trainable if trainable != self.trainable else
                                                    full not in self.frozen)

    def _shows(self, value, path: str, name: str, tensor) -> bool:
        """Whether `value`, a module attribute, is what `_expose` put there for the held tensor `tensor`."""
        if tensor is None:
            return value is None
        return isinstance(value, HeldTensor) and value.engine is self and value.where == (path, name)

    def _viewed(self, value):
        """The held tensor `value` is this engine's view of (another module's weight, assigned to tie the two), or
        None."""
        if not (isinstance(value, HeldTensor) and value.engine is self and value.where is not None):
            return None
        path, name = value.where
        source = dict(self.shadow.named_modules()).get(path)
        return None if source is None else getattr(source, name, None)

    def _refuse_as_torch(self) -> None:
        """Raise PyTorch's own TypeError where a held tensor's name was given what PyTorch refuses to assign there (a
        plain tensor or any other object in a parameter's place, anything but a tensor in a buffer's), putting the
        held tensor's view back first: the model is then as PyTorch leaves it after refusing the assignment."""
        own = dict(self.shadow.named_modules())
        for module in self.unit.modules():
            taken = vars(module).get("extra_repr")
            if not (isinstance(taken, functools.partial) and taken.func is held_repr and taken.args[0] is self):
                continue
            path = taken.args[1]
            source = own[path]
            for name in self.held[path]:
                shown = vars(module).get(name)
                parameter = name in source._parameters
                tensor = getattr(source, "_parameters" if parameter else "_buffers")[name]
                if shown is None or self._shows(shown, path, name, tensor) or (
                        isinstance(shown, torch.Tensor) and not parameter) or (
                        self._viewed(shown) is not None and shown.parameter):
                    continue
                vars(module)[name] = None if tensor is None else HeldTensor.of(tensor, self, where=(path, name))
                expected = "torch.nn.Parameter or None" if parameter else "torch.Tensor or None"
                raise TypeError(f"cannot assign '{torch.typename(shown)}' as {'parameter' if parameter else 'buffer'} "
                                f"'{name}' ({expected} expected)")

    def kept(self):
        """(name in the body, tensor, whether a parameter, whether saved) of each held tensor, as `give_back` would
        put it back: under the name its module has now, unless something took its place since."""
        own = dict(self.shadow.named_modules())
        for path, module in self.unit.named_modules(remove_duplicate=False):
            taken = vars(module).get("extra_repr")
            if not (isinstance(taken, functools.partial) and taken.func is held_repr and taken.args[0] is self):
                continue
            source = own[taken.args[1]]
            for name in self.held[taken.args[1]]:
                parameter = name in source._parameters
                tensor = getattr(source, "_parameters" if parameter else "_buffers")[name]
                if (tensor is None or name in module._parameters or name in module._buffers
                        or not self._shows(vars(module).get(name), taken.args[1], name, tensor)):
                    continue
                yield (f"{path}.{name}" if path else name, tensor, parameter,
                       parameter or name not in source._non_persistent_buffers_set)
