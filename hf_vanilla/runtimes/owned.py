"""An engine that owns the weights it compiled: what OpenVINO (`runtime="openvino"`) and ONNX Runtime holding its
weights (`runtime="onnxruntime", runtime_options={"owned": True}`) share. Each engine's own module says what it
compiles and how it runs it (`build`, `run`); this one holds the weights and decides which changes the engine follows
and which it refuses. The contract users see, change by change, is docs/deploy.md's "Engines holding the encoder's
weights"; tests/test_conformance.py and tests/test_runtime_owned.py hold every path to it.

Why own them. An engine lays each weight out for its kernels once, when it compiles, and int8 products need weights
quantized once; a compiled copy can only be trusted while nothing else writes the weights, and nothing short of
reading every weight tells a `.data` or numpy write from no write. So at attach the body's parameters and buffers
move into a private copy of the body (`shadow`); the body the user holds keeps its modules, config and code, with one
empty marker (`HeldMarker`) in `model.parameters()` and read-only views (`HeldTensor`) where each weight was. Every
change then comes through a door kept here: `state_dict`/`save_pretrained` (`save`), `load_state_dict` (`load`,
recompiled), a module, tensor, config field or class method changed (the per-call `Watch`: the tensors go back into
the body, which is traced and compiled again, `_follow`), `model.to(dtype)` (`_move`: followed where the engine
computes that dtype, else refused), and writes into held weights, training, gradients and hooks inside the body
(refused by name, `holding.refusal`). A checkpoint file written under the loaded model is refused at every call
(`mapped.MappedFiles`).

What runs where. The engine answers what the graph computes (`input_ids`, default positions, no cache, hidden states
or attention maps); the shadow, eager PyTorch on the same weights, answers everything else and, at float32, the padded
sizes where it measured faster (hf_vanilla/runtimes/choice.py). Padded batches run as groups of rows of similar
length (batches.py). It refuses, at attach, a head sharing a tensor with the body (a tied masked LM), encoder-decoders,
and layers after the body in another dtype than the engine holds the body in.
"""

import copy
import functools
import inspect
import threading

import torch
from transformers import PreTrainedModel

from . import choice
from .attached import Engine, refuse_quantized, take_off
from .batches import PROBE_TOLERANCE, Rules, probe, serve
from .cache import GraphCache, cache_key, export_graph, graph_io
from .holding import (HeldMarker, HeldTensor, HeldWeights, held_repr, raw_attr, refusal, refuse_gradients, seal,
                      sharing_copy, tensors_of, unseal)
from .mapped import MappedFiles, release_mapped_pages, return_freed_memory, written_under
from .inspection import HOLD_METHODS, answer_for_held
from .watch import Watch, class_code, difference, hooked, structure_of


class OwnedEncoder(HeldWeights, Engine):
    """A body's `forward` while an engine runs it: the body's weights held in `shadow`, the engine compiled from
    them. Subclasses name the engine and say how it compiles (`build`) and runs (`run`, `run_dense`)."""

    RUNTIME = ""  # the runtime= name, in messages
    REMOVE = ""  # the call that gives the weights back, in messages
    PRECISIONS: dict = {}  # precision -> the dtype the shadow holds (None: the model's own, float32 or bfloat16)
    FOLLOWS: dict = {}  # dtype a model.to(...) may move to -> the precision the engine then computes in

    @property
    def marker(self) -> str:
        """The one tensor the body still has: an empty parameter of the engine's dtype, so that model.to(...) tells
        the engine where the model was moved, and model.dtype / model.device (read off the parameters) still
        answer. Never saved."""
        return f"_{self.RUNTIME}_marker"

    def __init__(self, unit, precision: str, threads: int, cache: GraphCache):
        self.unit, self.precision, self.threads, self.cache = unit, precision, threads, cache
        self.lock = threading.RLock()  # one rebuild at a time; calls check the body under it
        self.local = threading.local()  # per-thread state of the compiled engine (OpenVINO's infer requests)
        self.choice = choice.engine_or_pytorch(self.RUNTIME)
        # `pair`: from how many real tokens the partner answers, what makes it from the shadow, and the partner
        self.split, self.make_partner, self.partner = None, None, None
        self.unfollowed = {}  # dtype -> the refusal of a move to it the engine cannot compile (`_move`)
        self._take()

    # ---- what an engine says: how it compiles and runs --------------------------------------------------------

    def build(self, tensors: dict, precision: str):
        """The engine compiled from `self.graph` with `tensors` (name -> float32 array) as its weights, at
        `precision`; at a reduced precision run once on a short request, raising ValueError naming the fix where
        this machine cannot run it."""
        raise NotImplementedError

    def run(self, compiled, feeds: dict) -> list:
        """The graph's outputs (numpy arrays, in `self.names` order) for `feeds`, computed by `compiled`."""
        raise NotImplementedError

    def run_dense(self, compiled, feeds: dict) -> list:
        """`run` for one request without padding (what an embedding service sends most): the engine's fastest
        call."""
        return self.run(compiled, feeds)

    def for_shape(self, B: int, T: int):
        """The compilation a dense (B, T) request runs on, chosen under the lock after the check: the engine's own (an
        engine may keep one per request shape, dropped with it by `_compile`)."""
        return self.compiled

    def outputs_of(self, compiled) -> tuple[list, bool]:
        """(the graph's output names in order, whether it reads token_type_ids)."""
        raise NotImplementedError

    # ---- taking the weights, and giving them back -------------------------------------------------------------

    def _take(self) -> None:
        """Move the body's tensors into a private copy of it, trace it (or find its graph), compile, and put the
        engine in front of the body's forward, with its state-dict doors."""
        unit = self.unit
        first = {}
        for name, tensor in [*unit.named_parameters(remove_duplicate=False), *unit.named_buffers(
                remove_duplicate=False)]:
            if first.setdefault(id(tensor), name) != name:  # its graph would read it once, under one name
                raise ValueError(f"{name} is {first[id(tensor)]} (one tensor under two names): the graph an engine "
                                 f"runs reads each weight of the encoder once, so {self.RUNTIME!r} cannot hold it; "
                                 f"untie them (a copy of the tensor each), or run the model in PyTorch.")
        # Its own tensors over the body's memory (`sharing_copy`), the body's own forward (the engine is not in front
        # yet), and the body's config object: what a user sets on model.config reaches both (the watch sees it).
        shadow = sharing_copy(unit)
        for module in shadow.modules():  # `hold`'s counting methods answer for the user's model, not for this copy:
            for name in HOLD_METHODS:  # copied into it, they would make its graph's cache key new at every attach
                vars(module).pop(name, None)
        dtype = self.PRECISIONS[self.precision] or next(unit.parameters()).dtype
        self.shadow, self.dtype = shadow.requires_grad_(False).to(dtype), dtype
        self.signature = inspect.signature(type(shadow).forward.__get__(shadow))
        # The body's own tensors refuse writes from here on (a reference kept from before attach, another thread),
        # then traced and compiled before the body gives anything up: a failure leaves it whole.
        self.sealed = seal([*unit.parameters(), *unit.buffers()], self)
        try:
            self._compile(self._graph())
        except BaseException:
            unseal(self.sealed)
            raise
        self.frozen = {name for name, parameter in unit.named_parameters() if not parameter.requires_grad}
        self.trainable = any(parameter.requires_grad for parameter in unit.parameters())
        self.held = {path: [*module._parameters, *module._buffers] for path, module in unit.named_modules()
                     if module._parameters or module._buffers}
        for path, module in unit.named_modules():  # the body keeps its modules and code, no tensor
            if module._parameters or module._buffers:  # torch's own repr reads the weights; this one says where
                module.extra_repr = functools.partial(held_repr, self, path)  # they are, and where they came from
            module._parameters.clear()
            module._buffers.clear()
            module._non_persistent_buffers_set.clear()
        unit.register_parameter(self.marker, HeldMarker.of(self, dtype, self.trainable))
        unit.forward = self
        unit.register_state_dict_post_hook(functools.partial(OwnedEncoder.save, self))  # torch marks the hook:
        unit.register_load_state_dict_pre_hook(functools.partial(OwnedEncoder.load, self))  # not a bound method
        self.code = class_code(unit)
        self._expose()

    def _retake(self) -> None:
        """Follow a change of the body's modules, code or config: give the tensors back, and take them again from
        the body as it is now (traced and compiled anew). Where that fails, the body keeps every tensor (its
        state_dict is the model as the user changed it, nothing lost) and the engine stays in front, trying again at
        every call, so that a repaired model is held again rather than left on PyTorch unsaid."""
        current = structure_of(self.unit)
        what = vars(self).get("broken") or (difference(self.structure, current) if current != self.structure else
                                            "a method patched on a class")
        self._refuse_as_torch()
        self.give_back()
        try:
            self._take()
            self.broken = None
        except Exception as error:
            self.unit.forward = self
            self.broken = what  # the body, given back, differs from the held one everywhere: the first word stays
            cause = error
            while cause.__cause__ is not None:
                cause = cause.__cause__
            said = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
            raise RuntimeError(
                f"The encoder as changed ({what}) cannot run on runtime={self.RUNTIME!r}: {type(cause).__name__}: "
                f"{said.rstrip('.')}. The model keeps every weight as it is now (model.state_dict()); repair the change and the "
                f"next call holds it again, or call {self.REMOVE} to run it in PyTorch.") from error

    # ---- the graph and its compilation ------------------------------------------------------------------------

    def _graph(self):
        """Find (in the cache) or trace the shadow's graph reading its weights as inputs, as `self.graph`, and return
        the engine's float32 compilation of it that was checked against PyTorch (`batches.probe`)."""
        shadow = self.shadow.float() if self.dtype != torch.float32 else self.shadow
        try:
            structure = structure_of(shadow)
            inputs, outputs = graph_io(shadow)
            key = cache_key(shadow, structure, inputs, outputs)
            for fresh in (False, True):
                self.graph = self.cache.load(key) if not fresh else export_graph(shadow, inputs, outputs, key)
                if self.graph is None:
                    continue
                checked = self.build(tensors_of(shadow), "f32")
                names, _ = self.outputs_of(checked)
                worst = probe(shadow.config, type(shadow).forward.__get__(shadow),
                              lambda feeds: dict(zip(names, self.run(checked, feeds))), "token_type_ids" in inputs)
                if worst <= PROBE_TOLERANCE:
                    if fresh:
                        self.cache.store(key, self.graph)
                    return checked
                self.cache.discard(key)
            raise RuntimeError(f"The {self.RUNTIME} graph of {type(shadow).__name__} differs from PyTorch by "
                               f"{worst:.2e} x max(1, |output|): runtime={self.RUNTIME!r} cannot run this model "
                               f"holding its weights; use PyTorch or runtime='onnxruntime'.")
        finally:
            shadow.to(self.dtype)

    def _compile(self, checked=None, built=None) -> None:
        """The engine compiled from the shadow's tensors at the engine's precision. `checked`: the float32
        compilation `_graph` has just run against PyTorch, which is this one at "f32"; `built`: this one."""
        compiled = built if built is not None else checked if checked is not None and self.precision == "f32" else \
            self.build(tensors_of(self.shadow), self.precision)
        self.names, self.token_types = self.outputs_of(compiled)
        self.compiled, self.local = compiled, threading.local()
        self.files = MappedFiles(self.shadow)  # the checkpoint files its weights are mapped from, watched
        self.partner = self._partner()
        return_freed_memory()  # what the build freed on the way: graphs, copies, a checked float32 compilation
        release_mapped_pages(self.shadow)  # and the checkpoint's pages the check read, mapped again where read

    def pair(self, tokens: int, make) -> None:
        """Requests of at least `tokens` real tokens answered by a partner, the others by the engine: what
        `runtime="auto"` chooses at `precision="fastest"` where another path leads on larger requests only
        (hf_vanilla/runtimes/auto.py, `_split`). `make(shadow)` makes the partner from the shadow without copying its
        weights: eager PyTorch in bfloat16 (padding-free), or another engine over them. Which path answers depends on
        the request's real tokens alone, so an input is answered one way from its first call. The partner is made
        again at every compilation (`_compile`), so it follows every change the engine follows."""
        with self.lock:
            self.split, self.make_partner = tokens, make
            self.partner = self._partner()

    def _partner(self):
        """The module that answers from `split` real tokens on, or None where nothing is paired."""
        return None if self.split is None else self.make_partner(self.shadow)

    # ---- calls ------------------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        output = self._call(args, kwargs)
        # What PyTorch would differentiate, refused by name: the marker's requires_grad is the weights' (set at attach,
        # then by model.requires_grad_(); frozen, the encoder is a fixed function and what is around it trains).
        marker = self.unit._parameters.get(self.marker) if torch.is_grad_enabled() else None
        if marker is not None and raw_attr(marker, "requires_grad"):
            output = refuse_gradients(output, refusal(
                self, "Computing gradients of the encoder's weights", "train (or freeze the encoder, "
                "model.base_model.requires_grad_(False), to train only what is around it)"))
        return output

    def _call(self, args: tuple, kwargs: dict):
        """Every change of the body followed or refused (`_follow`), then the request read against the config's
        `rules` and answered (`batches.serve`): all checks before the engine's call, which they slow beside it."""
        arguments = self.signature.bind(*args, **kwargs).arguments if args else kwargs
        with self.lock:
            self._follow()
            rules = self.rules
        partner = None if self.split is None else (self.split, functools.partial(self._pytorch, args, kwargs, True))
        decisions = choice.compared(self.choice, self.precision)
        return serve(rules, arguments, token_types=self.token_types, decisions=decisions, engine=self._engine,
                     pytorch=functools.partial(self._pytorch, args, kwargs), partner=partner)

    def _engine(self, feeds: dict, dense: bool):
        """(run, output names, dtype) for `feeds` (`batches.serve`): the compilation the request runs on, under the
        lock; the engine's call runs outside it."""
        with self.lock:
            compiled = self.for_shape(*feeds["input_ids"].shape) if dense else self.compiled
            names, dtype = self.names, self.dtype
        return functools.partial(self.run_dense if dense else self.run, compiled), names, dtype

    def _watch(self) -> Watch:
        """The per-call check of the body (hf_vanilla/runtimes/watch.py: its marker moves the count itself when moved),
        and what a request is read against, off the config the check vouches for (`batches.Rules`)."""
        self.rules = Rules.of(self.shadow.config)
        return Watch(self.unit, list(self.unit._parameters.values()), before=vars(self).get("watch"), counted=True)

    def _pytorch(self, args, kwargs, partner: bool = False):
        """The shadow's answer: eager PyTorch on the engine's own copy of the weights; with `partner`, its partner's
        (`pair`: its own forward, an engine's where one stands in front of it), in the engine's dtype as the engine's
        own answer is."""
        with self.lock:
            self._follow()
            module, dtype = self.partner if partner else self.shadow, self.dtype
        if not partner:
            return type(module).forward(module, *args, **kwargs)
        output = module.forward(*args, **kwargs)
        if isinstance(output, tuple):  # return_dict=False
            return tuple(_in_dtype(value, dtype) for value in output)
        for name, value in output.items():
            output[name] = _in_dtype(value, dtype)
        return output

    def _follow(self) -> None:
        """Follow or refuse whatever changed in the body since the last call (the module docstring)."""
        unit = self.unit
        if self.compiled is None:  # unpickled or deep-copied: held again, then the model as it is now checked
            self._hold_again()
        elif (written := self.files.written()) is not None:
            raise RuntimeError(written_under(written, self.RUNTIME))
        elif self.watch.unchanged():
            return
        if structure_of(unit) != self.structure or class_code(unit) != self.code:
            self._retake()  # a module or a tensor replaced, a class patched, a config value changed
            return
        if any(module.training for module in unit.modules()):
            raise RuntimeError(refusal(self, "Training (model.train())", "call model.eval() to run inference"))
        if hooked(unit):
            raise RuntimeError(refusal(self, "A forward hook inside the encoder (its graph would not run it)"))
        marker = unit._parameters.get(self.marker)
        if marker is None:
            raise RuntimeError(refusal(self, "Removing the model's weights", "change the model"))
        if marker.device.type != "cpu":  # the marker refuses a move itself; torch's future flags replace it
            back = ("call model.to_empty(device='cpu'), which brings the marker back without data, to go on here "
                    "with the weights the engine holds" if marker.device.type == "meta" else "call model.cpu() to "
                    "go on here")
            raise RuntimeError(refusal(self, f"Moving the model to {marker.device}", f"move the model (or {back})"))
        if marker.dtype not in self.FOLLOWS or (self.precision == "int8" and marker.dtype != torch.float32):
            raise RuntimeError(refusal(self, f"Moving the model to {marker.dtype}, which the engine at precision "
                                             f"{self.precision!r} does not compute in,",
                                       "move it (or call model.float() to go on here)"))
        if type(marker) is not HeldMarker:  # replaced by torch (its future flags): the marker that refuses writes
            unit._parameters[self.marker] = HeldMarker.of(self, marker.dtype, marker.requires_grad)
        if marker.dtype != self.dtype:  # model.to(torch.bfloat16) or .float(): follow
            self._move(marker.dtype)
        self.watch = self._watch()

    def _hold_again(self) -> None:
        """After a pickle or a deep copy: compiled from the shadow's tensors and shown in the body again."""
        self.code = class_code(self.unit)
        self._compile()
        self._expose()

    def _move(self, dtype: torch.dtype) -> None:
        """Follow `model.to(dtype)`: compiled at the precision the engine computes that dtype in from the weights as
        the move rounds them, and only then the shadow moved. Where the engine cannot compile it (OpenVINO's bf16 on
        a CPU without bf16 products), refused at this call and every later one until the model is moved back, the
        engine and its weights as they were (a shadow moved to bfloat16 and back would have lost their low bits)."""
        refused = self.unfollowed.get(dtype)
        if refused is None:
            try:
                built = self.build(tensors_of(self.shadow, dtype), self.FOLLOWS[dtype])
            except ValueError as error:
                refused = self.unfollowed[dtype] = refusal(
                    self, f"Moving the model to {dtype}", f"move it (or call model.float() to go on here): {str(error).rstrip('.')}")
        if refused is not None:
            raise RuntimeError(refused)
        self.precision, self.dtype = self.FOLLOWS[dtype], dtype
        self.shadow.to(dtype)
        self._compile(built=built)
        self._expose()

    # ---- the doors: state dicts, copies, pickling --------------------------------------------------------------

    def save(self, module, state_dict: dict, prefix: str, local_metadata) -> None:
        """`state_dict()`'s hook on the body: each held tensor the body would get back (`kept`) under its name there,
        as a view of the engine's tensor that refuses writes (`HeldTensor`): as PyTorch's state dict shares the
        model's memory, this one shares the engine's, so a write into it cannot pass unseen; `.clone()` gives a
        tensor to write, which `load_state_dict` loads. What was registered since in a held tensor's place is the
        body's own, which torch has written. In PyTorch's order (module by module)."""
        with self.lock:
            state_dict.pop(prefix + self.marker, None)
            for name, tensor, _, persistent in self.kept():
                if persistent:
                    state_dict[prefix + name] = HeldTensor.of(tensor, self)
            rank = {path: index for index, (path, _) in enumerate(self.unit.named_modules(remove_duplicate=False))}
            ours = sorted((key for key in state_dict if key.startswith(prefix)),
                          key=lambda key: rank.get(key[len(prefix):].rpartition(".")[0], len(rank)))
            for key in ours:  # the body's entries are the last ones written: re-added, they stay together
                state_dict[key] = state_dict.pop(key)

    def load(self, module, state_dict: dict, prefix: str, local_metadata, strict, missing_keys, unexpected_keys,
             error_msgs) -> None:
        """`load_state_dict()`'s hook on the body: the shadow's keys are taken out of `state_dict`, copied into the
        shadow as its new tensors (with or without `assign=`: the caller keeps its own), and the engine is compiled
        from them.

        A load that fails (a tensor of the wrong shape: PyTorch's `load_state_dict` loads every other tensor, then
        raises) is followed as PyTorch does it: the tensors that loaded are the shadow's, the engine is compiled from
        them, and the mismatches are reported in PyTorch's own words by the same raise. Every path then answers the
        model as PyTorch left it, never the old weights on one path and the new on another."""
        with self.lock:
            if self.compiled is None:  # unpickled or deep-copied, not called yet: what a call would do first
                self._hold_again()
            if structure_of(self.unit) != self.structure:  # a module replaced: its keys go to it, not the shadow
                self._retake()
            own = self.shadow.state_dict()
            mine = {name[len(prefix):]: state_dict.pop(name).detach().clone() for name in list(state_dict)
                    if name.startswith(prefix) and name[len(prefix):] in own}  # copies: the caller keeps its tensors
            misfits = {name: tensor for name, tensor in mine.items() if tensor.shape != own[name].shape}
            error_msgs.extend(f"size mismatch for {prefix + name}: copying a param with shape {tensor.shape} from "
                              f"checkpoint, the shape in current model is {own[name].shape}."
                              for name, tensor in misfits.items())
            try:
                # Assigned, not copied into: the memory the engine was compiled from (which it may read, not copy) is
                # never written, and a call running on the old compilation meanwhile answers the old weights whole.
                result = self.shadow.load_state_dict({name: tensor for name, tensor in mine.items()
                                                      if name not in misfits}, strict=False, assign=True)
                missing_keys.extend(prefix + name for name in result.missing_keys if name not in misfits)
            finally:  # whatever loaded, the engine computes it
                self.shadow.requires_grad_(False).to(self.dtype)
                self._compile()
                self._expose()
            marker = module._parameters.get(self.marker)
            if marker is not None:  # not in any checkpoint: loaded as itself
                state_dict[prefix + self.marker] = marker

    def __deepcopy__(self, memo):
        clone = object.__new__(type(self))
        vars(clone).update(vars(self))
        clone.unit, clone.shadow = copy.deepcopy(self.unit, memo), copy.deepcopy(self.shadow, memo)
        clone.lock, clone.local, clone.choice = threading.RLock(), threading.local(), copy.deepcopy(self.choice)
        clone.watch, clone.compiled, clone.files = None, None, None  # built at its first call, on the copy
        clone.sealed = []  # the tensors taken from the user's body are this engine's to give back
        return clone

    def __getstate__(self):
        """Pickled with the model: the shadow and the graph's bytes; compiled again at the first call."""
        return dict(vars(self), lock=None, local=None, compiled=None, watch=None, code=None, partner=None,
                    files=None, sealed=[])

    def __setstate__(self, state):
        vars(self).update(state)
        self.lock, self.local = threading.RLock(), threading.local()


def _in_dtype(value, dtype: torch.dtype):
    return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value


def hold(model, engine: type, precision: str, threads: int | None, cache_dir, call: str, **options):
    """Put `engine` (an OwnedEncoder class) in front of each encoder body of `model`, holding its weights at
    `precision` (one of its PRECISIONS, as the caller checked: runtimes/options.py), after the checks that leave the model whole when it cannot (the module docstring); engines already
    there are taken off first (`attached.take_off`), once the arguments are known good. `call` names the function in
    messages; `options` go to the engine's constructor. Returns `model`."""
    refuse_quantized(model, call)
    take_off(model)
    units = [module.base_model for module in model.modules() if isinstance(module, PreTrainedModel)
             and module.config.model_type == "vanilla_encoder" and not module.config.is_decoder]
    units = list({id(unit): unit for unit in units}.values())
    if not units:
        raise ValueError(f"{type(model).__name__} has no vanilla encoder body for {call} to hold: it takes a "
                         f"VanillaEncoder* model (encoder-decoders run on runtime='onnxruntime', weights fed).")
    if model.training:
        raise ValueError(f"{call} runs inference only: call model.eval() first.")
    inside = {id(tensor) for unit in units for tensor in [*unit.parameters(), *unit.buffers()]}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if tensor.device.type != "cpu" or tensor.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{call} takes a float32 or bfloat16 model on the CPU, and {name} is "
                             f"{tensor.dtype} on {tensor.device}: call model.float().cpu() first.")
    outside = [name for name, tensor in _outside(model, units) if id(tensor) in inside]
    computes = engine.PRECISIONS[precision]  # the dtype the engine holds the body in (None: the model's own)
    other = next(((name, tensor.dtype) for name, tensor in _outside(model, units)
                  if computes is not None and tensor.is_floating_point() and tensor.dtype != computes), None)
    if other is not None:  # the body's output would meet layers of another dtype ("mat1 and mat2 must have ...")
        keeps = [name for name, dtype in engine.PRECISIONS.items() if dtype is None]
        raise ValueError(f"{call} at precision {precision!r} holds the encoder in {computes}, and {other[0]} after "
                         f"it is {other[1]}: load the model in {computes} (from_pretrained(..., dtype={computes}), "
                         f"or model.to({computes})) first"
                         + (f", or ask for precision={keeps[0]!r}, which keeps the model's dtype." if keeps else "."))
    if outside:
        raise ValueError(f"{outside[0]} is shared with the encoder body that {call} would hold, and the two copies "
                         f"would part: run this model on runtime='onnxruntime' with its weights fed, or untie them.")
    cache = GraphCache(cache_dir)
    for module in model.modules():  # before the engines take their snapshot of the bodies
        if isinstance(module, PreTrainedModel):
            answer_for_held(module)
    for unit in units:
        engine(unit, precision, threads or torch.get_num_threads(), cache, **options)
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
