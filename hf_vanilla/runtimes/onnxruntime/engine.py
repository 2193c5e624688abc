"""The engine: an `OnnxEncoder` in front of an encoder's forward.

What runs where. Each encoder of the model is one graph: a BERT-style body (`base_model` of a `vanilla_encoder`)
with its pooler, or the encoder stack of an encoder-decoder (`get_encoder()`). The engine is an `OnnxEncoder` put
in front of that module's `forward` (as accelerate's hooks are); the model's class, modules and weights stay as they
are. It calls ONNX Runtime whenever that gives the module's own answer:
- inference only: autograd off (`no_grad`/`inference_mode`) or no weight requiring grad, every module in `eval()`;
- `input_ids` given (not `inputs_embeds`), default positions, no cache, no hidden states or attention maps asked for,
  input PyTorch would accept (anything else goes to PyTorch, which answers or refuses it with its own message);
- float32 weights on the CPU, each one contiguous block; not while tracing, compiling or exporting;
- the model as it was traced (below).
Anything else runs the module's own forward. The heads after the pooler and the decoder stay in PyTorch. A request
costs one engine call: PyTorch work right after ONNX Runtime's, on the same cores, waits for torch's threads to
get them back (`encoder_units`).

Which engine answers. Where both can, the faster does, measured in the process per request size
(hf_vanilla/runtimes/choice.py). Fed the model's weights, ONNX Runtime is much faster than eager PyTorch on short
requests and no faster, sometimes slower, on long or padded batches, where PyTorch skips the padding
(docs/performance.md); the choice makes `runtime="onnxruntime"` the faster of the two at every size instead of a bet.
"""

import copy
import functools
import inspect
import operator
import warnings

import onnxruntime
import torch

from .. import choice
from ..attached import Engine
from ..batches import PROBE_TOLERANCE, Rules, probe, serve
from ..cache import GraphCache, cache_key, export_graph, graph_io, written_key
from ..watch import Watch, class_code, difference, hooked, structure_of

PROVIDERS = ["CPUExecutionProvider"]


class OnnxEncoder(Engine):
    """A unit's `forward` while the engine runs it: ONNX Runtime where that gives the unit's own answer, else the
    unit's own forward. It holds the unit and reads it through its public API."""

    @classmethod
    def attach(cls, unit, cache: "GraphCache", threads: int) -> None:
        """Trace `unit` (or find its graph in `cache`), check the graph against PyTorch on a short request, and put
        the engine in front of the unit's forward. A graph that fails the check leaves the unit on PyTorch, with a
        warning."""
        if any(module.training for module in unit.modules()):
            raise ValueError("use_onnx_runtime runs inference only: call model.eval() first.")
        for name, tensor in named_tensors(unit):
            if not _feedable(tensor):
                raise ValueError(f"use_onnx_runtime reads float32 weights in CPU memory, each one contiguous block, "
                                 f"and {name} is {tensor.dtype} on {tensor.device}"
                                 f"{'' if tensor.is_contiguous() else ', strided'}: call model.float().cpu() first "
                                 f"(and .contiguous() on a strided weight).")
        structure = structure_of(unit)
        inputs, outputs = graph_io(unit)
        key = cache_key(unit, structure, inputs, outputs)
        cached = cache.load(key)
        if cached is not None:
            try:  # its bytes and key check out; it must still read this unit's tensors and give its answer
                engine = cls(unit, structure, cached, threads)
                if engine.probe() <= PROBE_TOLERANCE:
                    unit.forward = engine
                    return
            except Exception:  # noqa: BLE001  (ONNX Runtime's errors share no class but Exception; a bug of ours
                pass  # raises again below, from the fresh export)
            cache.discard(key)  # not this model's graph: export anew
        data = export_graph(unit, inputs, outputs, key)
        cache.store(key, data)
        engine = cls(unit, structure, data, threads)
        worst = engine.probe()
        if worst > PROBE_TOLERANCE:
            warnings.warn(f"ONNX Runtime's graph of {type(unit).__name__} differs from PyTorch by {worst:.2e} "
                          f"x max(1, |output|) (more than {PROBE_TOLERANCE:g}): it runs in PyTorch.", stacklevel=3)
            return
        unit.forward = engine

    def __init__(self, unit, structure: dict, graph: bytes, threads: int):
        self.unit = unit
        self.forward = unit.forward  # the unit's own: PyTorch, wherever ONNX Runtime cannot answer
        self.signature = inspect.signature(self.forward)
        self.structure = structure  # what the graph was traced from
        self.code = class_code(unit)  # and the code it ran: every class attribute of every module's classes
        self.graph, self.threads = graph, threads  # the graph holds no weight: a few hundred kB
        self.session = session = session_for(graph, threads)
        shapes = {i.name: i.shape for i in session.get_inputs()}
        self.token_types = "token_type_ids" in shapes
        self.weights = [name for name in shapes if name not in ("input_ids", "attention_mask", "token_type_ids")]
        named = dict(named_tensors(unit))
        if any(name not in named or list(named[name].shape) != shapes[name] for name in self.weights):
            raise ValueError(f"This graph reads weights {type(unit).__name__} does not have.")
        self.outputs = tuple(o.name for o in session.get_outputs())
        self.state = None  # (Watch, {weight name: numpy view} and Rules, or None where PyTorch must run): `_verify`
        self.warned = False
        # Per request size: ONNX Runtime (the challenger) or PyTorch, whichever measured faster (../choice.py).
        self.choice = choice.engine_or_pytorch("onnxruntime")

    def give_back(self) -> None:
        if self.state is not None:
            self.state[0].release()  # the unit's modules get their plain registries back
        vars(self.unit).pop("forward", None)

    def __deepcopy__(self, memo):
        """The copy's engine: the same session (it cannot be copied, and needs not: the graph holds no weight),
        bound to the copy of the unit, whose weights it feeds once it has checked them (first call)."""
        clone = object.__new__(type(self))
        vars(clone).update(vars(self))  # not copy.copy, which would pickle (and rebuild) the session
        clone.unit = copy.deepcopy(self.unit, memo)  # from `memo`: the copy being made
        clone.forward = copy.deepcopy(self.forward, memo)
        clone.state, clone.warned = None, False
        clone.choice = copy.deepcopy(self.choice)  # the same machine: the sizes decided stay decided
        return clone

    def __getstate__(self):
        """Pickled with the model (`torch.save(model)`): the graph's bytes instead of the session, which cannot be
        pickled; the unit's own forward and its classes' code are found again at the first call after loading."""
        own = self.forward
        if inspect.ismethod(own) and own.__self__ is self.unit and own.__func__ is getattr(type(self.unit),
                                                                                           "forward", None):
            own = None  # pickled as getattr(unit, "forward"), it would come back as this engine
        return dict(vars(self), forward=own, session=None, signature=None, code=None, state=None, warned=False)

    def __setstate__(self, state):
        vars(self).update(state)
        self.session = session_for(self.graph, self.threads)

    def _reattach(self) -> None:
        """After loading a pickled model: find the unit's forward and code again, and check that the graph is still
        the one this code and these versions would export (`_cache_key`); where it is not (another hf_vanilla,
        torch or transformers, a patched class), the unit runs in PyTorch, with a warning naming the fix."""
        unit = self.unit
        if self.forward is None:
            self.forward = getattr(type(unit), "forward").__get__(unit)
        self.signature, self.code = inspect.signature(self.forward), class_code(unit)
        inputs = [i.name for i in self.session.get_inputs() if i.name not in self.weights]
        if written_key(self.graph) != cache_key(unit, self.structure, inputs, self.outputs):
            self.structure = {}  # never equal again: every call runs PyTorch
            warnings.warn(f"The ONNX Runtime graph pickled with this {type(unit).__name__} is not the one this "
                          f"code and these versions export: it runs in PyTorch. Call "
                          f"hf_vanilla.runtimes.onnxruntime.use_onnx_runtime(model) again.", stacklevel=4)
            self.warned = True

    def __call__(self, *args, **kwargs):
        if self.code is None:  # the first call after unpickling
            self._reattach()
        # Keyword calls (every Hugging Face caller's) need no binding (`Signature.bind` walks the parameters in Python).
        arguments = self.signature.bind(*args, **kwargs).arguments if args else kwargs
        pytorch = functools.partial(self.forward, *args, **kwargs)
        weights, rules = self._weights()
        if weights is None:
            return pytorch()
        return serve(rules, arguments, token_types=self.token_types, decisions=self.choice,
                     engine=functools.partial(self._engine, weights), pytorch=pytorch)

    def _weights(self) -> tuple:
        """(the weights to feed beside the request, as numpy views; the rules the request is read against), after the
        check of every change, or (None, None) where PyTorch must run the call. Read before the request, so that a
        config change (hidden states asked for) is seen by the call that follows it."""
        state = self.state
        if state is None or not state[0].unchanged():
            state = self.state = self._verify()
        watch, weights, rules = state
        if weights is None or (torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, watch.tensors))):
            return None, None
        return weights, rules

    def _engine(self, weights: dict, feeds: dict, dense: bool):
        """(run, output names, dtype) for `batches.serve`: ONNX Runtime's session fed `weights`; one call for every
        path."""
        return (lambda feeds: self.session.run(None, feeds | weights)), self.outputs, torch.float32

    def _verify(self) -> tuple:
        """(watch, weights, rules): the unit compared by value with what the graph was traced from, and where it is
        the same, its weights as numpy views (no copy) for the graph's inputs, and what a request is read against
        (`batches.Rules`); weights None where PyTorch must run."""
        unit, before = self.unit, self.state[0] if self.state is not None else None
        structure, code = structure_of(unit), class_code(unit)
        if structure != self.structure or code != self.code:
            if not self.warned:
                changed = difference(self.structure, structure) if structure != self.structure else next((
                    f"{cls.__qualname__}.{name}" for cls, attributes in code.items()
                    for name in set(attributes) | set(self.code.get(cls, {}))
                    if attributes.get(name) is not self.code.get(cls, {}).get(name)), "a class attribute")
                warnings.warn(f"{type(unit).__name__} changed after use_onnx_runtime traced it "
                              f"({changed}): it runs in PyTorch. Call "
                              f"hf_vanilla.runtimes.onnxruntime.use_onnx_runtime(model) again to run it on ONNX "
                              f"Runtime.", stacklevel=5)
                self.warned = True
            return Watch(unit, [], before=before), None, None
        named = dict(named_tensors(unit))
        tensors = [named[name] for name in self.weights]
        watch = Watch(unit, tensors, before=before)
        if hooked(unit) or any(module.training for module in unit.modules()) or not all(map(_feedable, tensors)):
            return watch, None, None  # hooks to run, training, weights moved off float32 CPU memory: no warning
        return (watch, {name: tensor.detach().numpy() for name, tensor in zip(self.weights, tensors)},
                Rules.of(unit.config))

    def probe(self) -> float:
        """How far ONNX Runtime's answer is from PyTorch's at attach (`batches.probe`), fed the unit's weights."""
        named = dict(named_tensors(self.unit))
        weights = {name: named[name].detach().numpy() for name in self.weights}
        return probe(self.unit.config, self.forward,
                     lambda feeds: dict(zip(self.outputs, self.session.run(None, feeds | weights))), self.token_types)


def named_tensors(unit) -> list[tuple[str, torch.Tensor]]:
    return [*unit.named_parameters(), *unit.named_buffers()]


def _feedable(tensor) -> bool:
    """Memory ONNX Runtime can read as the graph's float32 input, in place."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous()


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def session_for(graph: bytes, threads: int, options=None):
    """ONNX Runtime's session of `graph` on `threads` threads; `options`, SessionOptions set up beforehand."""
    options = options or onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return onnxruntime.InferenceSession(graph, options, providers=PROVIDERS)
