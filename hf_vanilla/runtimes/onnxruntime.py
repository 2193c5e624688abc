"""ONNX Runtime as the engine behind a vanilla model's encoders, with the model and its Hugging Face API left as they
are.

    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, runtime="onnxruntime")  # use_onnx_runtime(AutoModel.from_pretrained(path))
    model(**batch)                                                  # every encoder head, pipelines, generate's encoder

Why: at small requests an eager PyTorch forward spends most of its time between kernels (Python, dispatch, one
kernel launch per op); ONNX Runtime runs the same graph from C++ with fused kernels. Where that pays depends on the
CPU: `benchmarks/engines.py` measures it, and docs/performance.md has the figures.

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
get them back (`encoder_units` has the measurement).

Which engine answers. Where both can, the faster does, measured in the process per request size (rows and real
tokens, each rounded up to a power of two, and the thread count): the first calls of a size are answered by ONNX
Runtime and PyTorch in turn, both timed, and after `CHOICE_CALLS` timed calls of each (past each one's first) the
size runs ONNX Runtime only if PyTorch took at least `CHOICE_MIN_GAIN` times as long. Fed the model's weights,
ONNX Runtime is much faster than eager PyTorch on short requests and no faster, sometimes slower, on long or padded
batches, where PyTorch skips the padding (docs/performance.md); the choice makes `runtime="onnxruntime"` the faster
of the two at every size instead of a bet. Both give the same answer within the parity rule, so which one ran never
shows in the output. `HF_VANILLA_RUNTIME_CHOICE=engine` sends every call ONNX Runtime can answer to it.

Which weights. The graph holds none (`hf_vanilla.export.export_encoder_reading_weights`): each parameter and buffer
is a graph input, fed on every call with the model's own tensor memory (a numpy view, no copy). A write into that
memory by any route (an optimizer step, `load_state_dict`, `p.data.mul_()`, a numpy view of a weight) is what the
next call computes with: there is nothing to detect. What replaces memory or changes the model is detected by a
check on every call (`_Watch`: the identity of every module's attributes, registries, class and forward hooks, of
the config's fields and torch's global hooks, and the data pointer, shape, stride, dtype and device of every weight
fed). When it sees a change, the model is compared by value with what the graph was traced from (`_structure`):
equal (tensors replaced by others of the same shape: `p.data = ...`, `vector_to_parameters`, `half().float()`, a
deep copy), the new memory is fed; different (a layer removed, a module replaced as LoRA does, a config value the
graph baked in), PyTorch runs, with a warning naming the fix: call `use_onnx_runtime` again. Forward hooks on the
modules inside the encoder (or torch's global ones), which the graph would not run, send calls to PyTorch while they
are set. ONNX Runtime keeps no copy of the weights, and the graph is the same for every checkpoint of one
architecture.

Padded batches keep the padding-free idea: a batch whose padding is at the end of each row is split into groups of
rows of similar length (rows sorted by length, grouped by a small dynamic programme that weighs a call's fixed cost
against the padding it would compute), and each group runs trimmed to its own longest row. Outputs at padding
positions are zeros, as on PyTorch's packed path. A batch with padding elsewhere (left padding, holes) runs whole,
with its mask, as PyTorch's padded path does.

The cache. Graphs are kept in `cache_dir`, else $HF_VANILLA_ONNX_CACHE, else `$XDG_CACHE_HOME/hf_vanilla/onnx` (by
default `~/.cache/hf_vanilla/onnx`), as `encoder-<key>-<digest>.onnx`. The key hashes what the graph was traced
from (`_structure`: classes, attributes, shapes, config), the source files of the model's code and the versions of
torch, transformers, onnx and onnxscript; the digest is the file's own sha256, and the key is also written inside
the graph. A file is used only when its bytes match its digest, its key is the one asked for, and it gives
PyTorch's answer on a short padded request; anything else (truncated, emptied, replaced) is removed and exported
again. Writes are atomic (`.export-<host>-<pid>-<8 hex>.onnx`, then a rename); such leftovers of processes that died
are removed. The cache removes nothing else: only regular files named as it names them (`GRAPH_NAME`,
`STAGING_NAME`), never a folder, a link or another file, since the folder it points at may be the user's (a
directory in a graph's place is left, and the graph is then kept in memory, with the warning below). A cache that cannot be written is used read-only, with a one-line warning: the
graph is then exported in memory by every process that needs it. Exporting takes 10-30 s per architecture (once);
attaching a cached graph, a few hundred milliseconds.
"""

import copy
import hashlib
import inspect
import json
import operator
import os
import re
import socket
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import onnxscript
import torch
import transformers
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPoolingAndCrossAttentions,
)

from ..export import export_encoder_reading_weights
from .. import measure

CACHE_FORMAT = 2  # bump when the exported graph changes for the same key (2: weights are graph inputs)
CACHE_ENV = "HF_VANILLA_ONNX_CACHE"
PROVIDERS = ["CPUExecutionProvider"]
KEY_METADATA = "hf_vanilla.cache_key"
# A call's fixed cost in tokens' worth of work: what grouping two rows must save in padding to pay for a second call.
CALL_COST_TOKENS = 32
# Which of ONNX Runtime and PyTorch answers a request size: "measure" (the default) times both on the first calls of
# each size and keeps the faster; "engine" sends every call the engine can answer to ONNX Runtime (the tests use it,
# to test the engine itself). Read at import from HF_VANILLA_RUNTIME_CHOICE.
CHOICE = os.environ.get("HF_VANILLA_RUNTIME_CHOICE", "measure")
if CHOICE not in ("measure", "engine"):
    raise ValueError(f"HF_VANILLA_RUNTIME_CHOICE={CHOICE!r}: use measure (the default) or engine.")
CHOICE_CALLS = 3  # timed calls of each path per request size, after its first
CHOICE_MIN_GAIN = 1.05  # ONNX Runtime must be this much faster: noise can only leave a size on PyTorch
# The check at attach: a right-padded (2, PROBE_TOKENS) batch, both ways, within PROBE_TOLERANCE x max(1, |output|).
# It tells this model's graph from another's (one of other weights or another model is off by 1e-2 and more), with
# room for any CPU's summation order: ten times the parity rule (conversion/parity.py), which the tests hold the
# runtime's answers to.
PROBE_TOKENS, PROBE_TOLERANCE = 16, 1e-4
# Leftovers of an export whose process cannot be checked (another host) go after a day.
STALE_SECONDS = 24 * 3600


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


def runtime_choices(model) -> dict[tuple, bool | None]:
    """Per request size (rows and real tokens rounded up to powers of two, threads) seen by `model`'s encoders: True
    where ONNX Runtime answers, False where PyTorch does, None while the first calls still measure the two."""
    choices = {}
    for module in model.modules():
        engine = vars(module).get("forward")
        if isinstance(engine, OnnxEncoder):
            choices.update(engine.choice.decisions(pending=True))
    return choices


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


class OnnxEncoder:
    """A unit's `forward` while the engine runs it: ONNX Runtime where that gives the unit's own answer, else the
    unit's own forward. It holds the unit and reads it through its public API."""

    @classmethod
    def attach(cls, unit, cache: "GraphCache", threads: int) -> None:
        """Trace `unit` (or find its graph in `cache`), check the graph against PyTorch on a short request, and put
        the engine in front of the unit's forward. A graph that fails the check leaves the unit on PyTorch, with a
        warning."""
        if any(module.training for module in unit.modules()):
            raise ValueError("use_onnx_runtime runs inference only: call model.eval() first.")
        for name, tensor in _named_tensors(unit):
            if not _feedable(tensor):
                raise ValueError(f"use_onnx_runtime reads float32 weights in CPU memory, each one contiguous block, "
                                 f"and {name} is {tensor.dtype} on {tensor.device}"
                                 f"{'' if tensor.is_contiguous() else ', strided'}: call model.float().cpu() first "
                                 f"(and .contiguous() on a strided weight).")
        structure = _structure(unit)
        outputs = ("last_hidden_state",) + (("pooler_output",) if getattr(unit, "pooler", None) is not None else ())
        inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if unit.config.type_vocab_size > 0 else [])
        key = _cache_key(unit, structure, inputs, outputs)
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
        data = _export(unit, inputs, outputs, key)
        cache.store(key, data)
        engine = cls(unit, structure, data, threads)
        difference = engine.probe()
        if difference > PROBE_TOLERANCE:
            warnings.warn(f"ONNX Runtime's graph of {type(unit).__name__} differs from PyTorch by {difference:.2e} "
                          f"x max(1, |output|) (more than {PROBE_TOLERANCE:g}): it runs in PyTorch.", stacklevel=3)
            return
        unit.forward = engine

    def __init__(self, unit, structure: dict, graph: bytes, threads: int):
        self.unit = unit
        self.forward = unit.forward  # the unit's own: PyTorch, wherever ONNX Runtime cannot answer
        self.signature = inspect.signature(self.forward)
        self.structure = structure  # what the graph was traced from
        self.code = _class_code(unit)  # and the code it ran: every class attribute of every module's classes
        self.graph, self.threads = graph, threads  # the graph holds no weight: a few hundred kB
        self.session = session = _session(graph, threads)
        shapes = {i.name: i.shape for i in session.get_inputs()}
        self.token_types = "token_type_ids" in shapes
        self.weights = [name for name in shapes if name not in ("input_ids", "attention_mask", "token_type_ids")]
        named = dict(_named_tensors(unit))
        if any(name not in named or list(named[name].shape) != shapes[name] for name in self.weights):
            raise ValueError(f"This graph reads weights {type(unit).__name__} does not have.")
        self.outputs = tuple(o.name for o in session.get_outputs())
        self.body = unit.config.model_type == "vanilla_encoder"  # a body, with its output class; else a stack
        self.state = None  # (_Watch, {weight name: numpy view} or None where PyTorch must run), from `_verify`
        self.warned = False
        # Per request size (`_size_key`): ONNX Runtime (the challenger) or PyTorch, measured by `_measure`.
        self.choice = measure.MeasuredChoice("runtime: ONNX Runtime?", ("onnxruntime", "pytorch"), "onnxruntime",
                                             CHOICE_CALLS, CHOICE_MIN_GAIN, warmup=1)

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
        self.session = _session(self.graph, self.threads)

    def _reattach(self) -> None:
        """After loading a pickled model: find the unit's forward and code again, and check that the graph is still
        the one this code and these versions would export (`_cache_key`); where it is not (another hf_vanilla,
        torch or transformers, a patched class), the unit runs in PyTorch, with a warning naming the fix."""
        unit = self.unit
        if self.forward is None:
            self.forward = getattr(type(unit), "forward").__get__(unit)
        self.signature, self.code = inspect.signature(self.forward), _class_code(unit)
        inputs = [i.name for i in self.session.get_inputs() if i.name not in self.weights]
        if _written_key(self.graph) != _cache_key(unit, self.structure, inputs, self.outputs):
            self.structure = {}  # never equal again: every call runs PyTorch
            warnings.warn(f"The ONNX Runtime graph pickled with this {type(unit).__name__} is not the one this "
                          f"code and these versions export: it runs in PyTorch. Call "
                          f"hf_vanilla.runtimes.onnxruntime.use_onnx_runtime(model) again.", stacklevel=4)
            self.warned = True

    def __call__(self, *args, **kwargs):
        if self.code is None:  # the first call after unpickling
            self._reattach()
        # Keyword calls (every Hugging Face caller's) need no binding: 6 us of a 3 ms request.
        arguments = self.signature.bind(*args, **kwargs).arguments if args else kwargs
        request = self._request(arguments)
        if request is None:
            return self.forward(*args, **kwargs)
        if CHOICE == "engine":
            return self._answer(request, arguments)
        key = _size_key(request[0]["attention_mask"])
        engine = self.choice.decision(key)
        if engine is None:
            return self._measure(key, request, arguments, args, kwargs)
        return self._answer(request, arguments) if engine else self.forward(*args, **kwargs)

    def _measure(self, key, request, arguments, args, kwargs):
        """A call of a request size not decided yet: ONNX Runtime and PyTorch answer in turn (the same answer within
        the parity rule), each timed (hf_vanilla/measure.py), until each has `CHOICE_CALLS` + 1 timings (the first of
        each is left out: allocations); then the size runs ONNX Runtime only if PyTorch's median time is at least
        `CHOICE_MIN_GAIN` times ONNX Runtime's. A PyTorch call that also measured its products' kernels (kernels.py
        computes two products where it times one) is not counted: it would make PyTorch look slower than it will
        be."""
        path = self.choice.turn(key)
        if path == "onnxruntime":
            return self.choice.time(key, path, self._answer, request, arguments)
        measured = measure.timed_calls()
        start = measure.clock()
        output = self.forward(*args, **kwargs)
        if measure.timed_calls() == measured:  # PyTorch's call did not also time kernels (kernels.py)
            self.choice.record(key, path, measure.clock() - start)
        return output

    def _request(self, arguments: dict):
        """(the session's inputs, the weights to feed), or None where PyTorch must run the call."""
        get = arguments.get
        input_ids, attention_mask, token_type_ids = get("input_ids"), get("attention_mask"), get("token_type_ids")
        config = self.unit.config
        if (
            input_ids is None or get("inputs_embeds") is not None or get("position_ids") is not None
            or get("past_key_values") is not None or get("encoder_hidden_states") is not None
            or (config.output_attentions if get("output_attentions") is None else get("output_attentions"))
            or (config.output_hidden_states if get("output_hidden_states") is None else get("output_hidden_states"))
            or _is_tracing() or input_ids.device.type != "cpu"
            or (token_type_ids is not None and not self.token_types)
        ):
            return None
        state = self.state
        if state is None or not state[0].unchanged():
            state = self.state = self._verify()
        watch, weights = state
        if weights is None or (torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, watch.tensors))):
            return None
        # Read in numpy; what this quick look does not plainly accept goes to PyTorch, which answers or refuses it
        # with its own message: torch ops right before ONNX Runtime's call cost 0.5-0.7 ms after an idle moment
        # (bert-base 1 x 16, AMD Zen 4), nearly what numpy spends on the whole look.
        feeds = _feeds(config, input_ids, attention_mask, token_type_ids)
        if feeds is None:
            return None
        if self.token_types and "token_type_ids" not in feeds:
            feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
        return feeds, weights

    def _answer(self, request: tuple, arguments: dict):
        """The unit's output for `request`, computed by ONNX Runtime."""
        feeds, weights = request
        outputs = dict(zip(self.outputs, map(torch.from_numpy, self.run(feeds, weights))))
        if not self.body:
            return BaseModelOutputWithPastAndCrossAttentions(**outputs)
        output = BaseModelOutputWithPoolingAndCrossAttentions(**outputs)
        return_dict = arguments.get("return_dict")
        return output if (self.unit.config.return_dict if return_dict is None else return_dict) else output.to_tuple()

    def _verify(self) -> tuple:
        """(watch, weights): the unit compared by value with what the graph was traced from, and where it is the
        same, its weights as numpy views (no copy) for the graph's inputs; None where PyTorch must run."""
        unit = self.unit
        structure, code = _structure(unit), _class_code(unit)
        if structure != self.structure or code != self.code:
            if not self.warned:
                difference = _difference(self.structure, structure) if structure != self.structure else next((
                    f"{cls.__qualname__}.{name}" for cls, attributes in code.items()
                    for name in set(attributes) | set(self.code.get(cls, {}))
                    if attributes.get(name) is not self.code.get(cls, {}).get(name)), "a class attribute")
                warnings.warn(f"{type(unit).__name__} changed after use_onnx_runtime traced it "
                              f"({difference}): it runs in PyTorch. Call "
                              f"hf_vanilla.runtimes.onnxruntime.use_onnx_runtime(model) again to run it on ONNX "
                              f"Runtime.", stacklevel=5)
                self.warned = True
            return _Watch(unit, []), None
        named = dict(_named_tensors(unit))
        tensors = [named[name] for name in self.weights]
        watch = _Watch(unit, tensors)
        if _hooked(unit) or any(module.training for module in unit.modules()) or not all(map(_feedable, tensors)):
            return watch, None  # hooks to run, training, weights moved off float32 CPU memory: documented, no warning
        return watch, {name: tensor.detach().numpy() for name, tensor in zip(self.weights, tensors)}

    def probe(self) -> float:
        """max |ONNX Runtime - PyTorch| / max(1, |PyTorch|) over the graph's outputs, at the real tokens of a
        right-padded (2, PROBE_TOKENS) request."""
        config = self.unit.config
        input_ids = (torch.arange(2 * PROBE_TOKENS).view(2, PROBE_TOKENS) * 7919 + 5) % config.vocab_size
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, PROBE_TOKENS // 2:] = 0
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        with torch.inference_mode():
            expected = self.forward(**inputs, return_dict=True)
        named = dict(_named_tensors(self.unit))
        weights = {name: named[name].detach().numpy() for name in self.weights}
        feeds = {name: value.numpy() for name, value in inputs.items()}
        if self.token_types:
            feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
        got = self.session.run(None, feeds | weights)
        real = attention_mask.bool().numpy()
        worst = 0.0
        for name, array in zip(self.outputs, got):
            reference = getattr(expected, name).numpy()
            if array.shape != reference.shape:
                return float("inf")
            if name == "last_hidden_state":
                array, reference = array[real], reference[real]
            worst = max(worst, float(np.abs(array - reference).max()) / max(1.0, float(np.abs(reference).max())))
        return worst if worst == worst else float("inf")  # NaN: no answer

    def run(self, feeds: dict, weights: dict) -> list[np.ndarray]:
        """The graph's outputs, (B, T, E) hidden states first: one call for a batch without end-padding to trim,
        else one per group of rows, scattered back."""
        mask = feeds["attention_mask"]
        B, T = mask.shape
        lengths = mask.sum(1)
        if lengths.min() in (0, T) or not (mask == (np.arange(T)[None, :] < lengths[:, None])).all():
            return self.session.run(None, feeds | weights)  # dense, a row of padding only, or padding not at the ends
        outputs = None
        for rows, length in length_groups(lengths.tolist()):
            index = np.asarray(rows)
            group = self.session.run(None, {name: value[index, :length] for name, value in feeds.items()} | weights)
            if outputs is None:  # hidden states (B, T, E), then per-row outputs (B, ...)
                outputs = [np.zeros((B, T, group[0].shape[-1]), group[0].dtype)]
                outputs += [np.zeros((B, *out.shape[1:]), out.dtype) for out in group[1:]]
            outputs[0][index, :length] = group[0]
            for whole, part in zip(outputs[1:], group[1:]):
                whole[index] = part
        outputs[0][mask == 0] = 0.0
        return outputs


def _hooked(unit) -> bool:
    """Whether forward hooks would run inside the unit (its own run around the engine either way)."""
    return any(_GLOBAL_HOOKS) or any(module._forward_hooks or module._forward_pre_hooks
                                     for module in unit.modules() if module is not unit)


def _is_tracing() -> bool:
    """Inside torch.compile, torch.export or torch.jit.trace: the module's own forward is what gets traced."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


def _named_tensors(unit) -> list[tuple[str, torch.Tensor]]:
    return [*unit.named_parameters(), *unit.named_buffers()]


def _feedable(tensor) -> bool:
    """Memory ONNX Runtime can read as the graph's float32 input, in place."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous()


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_META = operator.attrgetter("shape", "dtype", "is_cpu")


class _Watch:
    """Whether anything but the weights' values changed since it was made: the check on every call.

    Every module's attribute dict and its parameter, buffer, submodule and forward hook registries, the config's
    fields, torch's global forward hooks and the attribute dicts of the modules' classes are compared with shallow copies (the same objects, so a dict compares
    by identity, in C); the attribute dicts themselves, the modules' classes likewise; and the tensors fed to the
    graph by data pointer, shape, stride, dtype and device. A change that bypasses all of these leaves the graph's
    answer right: a write into the weights' memory is what the graph reads. Every comparison is a `map` over a flat
    list, run in C (MiniLM: 531 dicts, 103 tensors; docs/performance.md has the cost)."""

    def __init__(self, unit, tensors: list):
        modules = list(unit.modules())
        configs = {id(m.config): m.config for m in modules if isinstance(getattr(m, "config", None),
                                                                          transformers.PretrainedConfig)}
        self.owners = modules + list(configs.values())  # whose attribute dict must stay the same object
        self.states = list(map(vars, self.owners))
        self.dicts = self.states + [registry for m in modules for registry in (
            m._parameters, m._buffers, m._modules, m._forward_hooks, m._forward_pre_hooks)] + list(_GLOBAL_HOOKS) \
            + list(map(vars, _classes(self.owners)))  # a method patched on a class (the graph runs the old one)
        self.copies = list(map(dict, self.dicts))
        self.types = list(map(type, self.owners))
        self.tensors, self.meta = tensors, _tensor_meta(tensors)

    def unchanged(self) -> bool:
        try:
            return (all(map(operator.eq, self.dicts, self.copies)) and list(map(type, self.owners)) == self.types
                    and all(map(operator.is_, map(vars, self.owners), self.states))
                    and _tensor_meta(self.tensors) == self.meta)
        except (RuntimeError, ValueError):  # an attribute replaced by a tensor or array: == is elementwise
            return False


def _classes(objects) -> list:
    """Every class in the MROs of `objects`' classes but `object`."""
    return list({cls: None for obj in objects for cls in type(obj).__mro__ if cls is not object})


def _class_code(unit) -> dict:
    """What the unit's modules' classes (and their bases) hold, each attribute by identity: a method patched on a
    class after tracing (`VanillaFeedForward.forward = patched`) changes what PyTorch runs but not the graph."""
    return {cls: dict(vars(cls)) for cls in _classes(unit.modules())}


def _tensor_meta(tensors: list) -> tuple:
    return (list(map(torch.Tensor.data_ptr, tensors)), list(map(torch.Tensor.stride, tensors)),
            list(map(_META, tensors)))


# torch's global forward hooks run around every module's forward: inside the graph they would not run.
_GLOBAL_HOOKS = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks)
# What a module's attribute dict holds besides what it computes with: registries (walked apart), hooks and the
# training flag (documented reasons to run PyTorch, checked apart), and where the weights came from.
_MODULE_BOOKKEEPING = {"_parameters", "_buffers", "_modules", "training", "_is_full_backward_hook", "_backward_hooks",
                       "_backward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
                       "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                       "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                       "_load_state_dict_post_hooks", "name_or_path"}
# Config fields read on every call rather than traced (the engine checks them itself, or they choose among kernels
# of the same function), and where the weights came from.
_CONFIG_PER_CALL = {"output_hidden_states", "_output_attentions", "return_dict", "use_cache",
                    "_attn_implementation_internal", "_experts_implementation_internal", "_name_or_path"}


def _structure(unit) -> dict:
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
                {name: field for name, field in vars(value).items() if name not in _CONFIG_PER_CALL}, configs)}
        return configs[id(value)]
    if isinstance(value, type) or inspect.isroutine(value):
        return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', value.__name__)}"
    return f"<{type(value).__module__}.{type(value).__qualname__} object {id(value)}>"


def _difference(reference: dict, current: dict) -> str:
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


def _cache_key(unit, structure: dict, inputs: list, outputs: tuple) -> str:
    """What the graph depends on: the structure, the source files of every class in it that torch and transformers
    do not ship (their versions stand for theirs), the exporter's versions, and the graph's inputs and outputs."""
    code, files = hashlib.sha256(), set()
    for cls in {type(m) for m in unit.modules()}:
        module = sys.modules[cls.__module__]
        if module.__name__.split(".")[0] in ("torch", "transformers"):
            continue
        source = getattr(module, "__file__", None)
        if source is None:  # defined interactively: its code cannot be read back, so its graph is this process's
            code.update(f"{cls.__qualname__}:{id(cls)}".encode())
        elif module.__package__:  # a package's helpers run too (this one: kernels.py, packing.py, validation.py)
            files.update(Path(source).parent.glob("*.py"))
        else:
            files.add(Path(source))
    for path in sorted(files):
        code.update(f"{path.name}:".encode() + path.read_bytes())
    meta = {"format": CACHE_FORMAT, "inputs": inputs, "outputs": outputs, "structure": structure,
            "code": code.hexdigest(), "versions": [torch.__version__, transformers.__version__, onnx.__version__,
                                                   onnxscript.__version__]}
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]


def _export(unit, inputs: list, outputs: tuple, key: str) -> bytes:
    """The unit's graph reading its weights as inputs, with `key` written inside."""
    with torch.no_grad():
        proto = export_encoder_reading_weights(unit, inputs, outputs)
    onnx.helper.set_model_props(proto, {KEY_METADATA: key})
    return proto.SerializeToString()


class GraphCache:
    """Graphs on disk, `encoder-<key>-<sha256 of the file, 16 hex>.onnx`, checked before use and repaired when
    they fail the check (see the module docstring)."""

    def __init__(self, directory=None):
        self.error = None
        if directory is None:
            directory = os.environ.get(CACHE_ENV) or None
        if directory is None:
            try:
                directory = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_vanilla" / "onnx"
            except RuntimeError as error:  # no home directory to be found
                self.error = error
        self.directory = Path(directory) if directory is not None else None
        self.warned = False

    def load(self, key: str) -> bytes | None:
        """The graph of `key` if a cached file passes the checks of bytes and key; files that fail are removed."""
        if self.directory is None or not self.directory.is_dir():
            return None
        self._remove_stale_exports()
        for path in sorted(self.directory.glob(f"encoder-{key}-*.onnx")):
            try:
                data = path.read_bytes() if _ours(path, GRAPH_NAME) else None
            except OSError:  # unreadable: as good as absent
                continue
            if data is not None and path.stem.endswith(hashlib.sha256(data).hexdigest()[:16]) \
                    and _written_key(data) == key:
                return data
            self._remove(path)
        return None

    def store(self, key: str, data: bytes) -> None:
        """Write the graph atomically; a cache that cannot be written is left as it is, with a warning."""
        if self.directory is None:
            self._cannot_write(self.error)
            return
        final = self.directory / f"encoder-{key}-{hashlib.sha256(data).hexdigest()[:16]}.onnx"
        staging = self.directory / f".export-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}.onnx"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            try:
                staging.write_bytes(data)
                os.replace(staging, final)  # atomic: a reader sees the whole graph or none
            finally:
                staging.unlink(missing_ok=True)
        except OSError as error:
            self._cannot_write(error)

    def discard(self, key: str) -> None:
        for path in self.directory.glob(f"encoder-{key}-*.onnx"):
            self._remove(path)

    def _remove(self, path: Path) -> None:
        """Remove `path` if this cache can tell it wrote it (`_ours`): a folder the cache points at may be the
        user's own, and a directory, a link or a file of another name in it is theirs."""
        if not (_ours(path, GRAPH_NAME) or _ours(path, STAGING_NAME)):
            return
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            self._cannot_write(error)

    def _remove_stale_exports(self) -> None:
        """Remove this cache's own `.export-<host>-<pid>-<8 hex>.onnx` files of processes that died mid-write: this
        host's, when their process is gone; another host's, once a day old."""
        host = socket.gethostname()
        for path in self.directory.glob(".export-*.onnx"):
            match = STAGING_NAME.fullmatch(path.name)
            if not match or not _ours(path, STAGING_NAME):
                continue
            try:
                if match[1] == host:
                    stale = not _process_alive(int(match[2]))
                else:
                    stale = time.time() - path.lstat().st_mtime > STALE_SECONDS
            except OSError:
                continue  # removed meanwhile
            if stale:
                self._remove(path)

    def _cannot_write(self, error) -> None:
        if not self.warned:
            warnings.warn(f"The ONNX graph cache {self.directory} cannot be written ({error}): graphs are exported in "
                          f"memory by every process. Set ${CACHE_ENV} or runtime_options={{'cache_dir': ...}} to a "
                          f"writable folder.", stacklevel=5)
            self.warned = True


# The only names the cache writes, and so the only ones it removes: regular files, never folders or links.
GRAPH_NAME = re.compile(r"encoder-[0-9a-f]{32}-[0-9a-f]{16}\.onnx")
STAGING_NAME = re.compile(r"\.export-(.+)-(\d+)-[0-9a-f]{8}\.onnx")


def _ours(path: Path, name: re.Pattern) -> bool:
    """Whether `path` is a file this cache writes: a regular file (not a folder, not a link) named as it names them."""
    return bool(name.fullmatch(path.name)) and path.is_file() and not path.is_symlink()


def _session(graph: bytes, threads: int):
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return onnxruntime.InferenceSession(graph, options, providers=PROVIDERS)


def _written_key(data: bytes) -> str | None:
    try:
        model = onnx.load_from_string(data)
    except Exception:  # noqa: BLE001  (any damage: protobuf's errors have no common class)
        return None
    return {prop.key: prop.value for prop in model.metadata_props}.get(KEY_METADATA)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _size_key(mask: np.ndarray) -> tuple:
    """What the choice between the engines is made per: rows and real tokens, each rounded up to a power of two,
    and torch's thread count (both engines use it)."""
    rows, tokens = mask.shape[0], max(int(mask.sum()), 1)
    return 1 << (rows - 1).bit_length(), 1 << (tokens - 1).bit_length(), torch.get_num_threads()


def _feeds(config, input_ids, attention_mask, token_type_ids) -> dict | None:
    """The session's inputs as C-ordered int64 numpy arrays, or None unless every check PyTorch's path makes of an
    encoder's input (hf_vanilla/validation.py) plainly passes: 2-D int64/int32 ids in the vocabulary, no longer than
    the position table; a 2-D mask of their shape holding only 1 and 0 (bool, integer or float); int64/int32 segment
    ids of their shape (or one row) in range. A subset of what PyTorch accepts, never more: what this refuses,
    PyTorch runs or refuses with its own message."""
    def ids_like(tensor):
        return tensor.dtype in (torch.int64, torch.int32) and tensor.device.type == "cpu"

    if not ids_like(input_ids) or input_ids.dim() != 2:
        return None
    ids = np.ascontiguousarray(input_ids.numpy(), dtype=np.int64)  # ONNX Runtime reads C-ordered int64
    B, T = ids.shape
    limit = config.max_position_embeddings - config.position_offset
    if B == 0 or T == 0 or T > limit or ids.min() < 0 or ids.max() >= config.vocab_size:
        return None
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        if (tuple(attention_mask.shape) != (B, T) or attention_mask.device.type != "cpu"
                or attention_mask.dtype not in _MASK_DTYPES):
            return None
        mask = attention_mask.detach().numpy()
        if mask.dtype != np.bool_ and not ((mask == 0) | (mask == 1)).all():
            return None
        mask = np.ascontiguousarray(mask, dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    if token_type_ids is not None:
        if not ids_like(token_type_ids) or token_type_ids.dim() not in (1, 2) or token_type_ids.shape[-1] != T \
                or (token_type_ids.dim() == 2 and token_type_ids.shape[0] not in (B, 1)):
            return None
        types = np.ascontiguousarray(np.broadcast_to(token_type_ids.numpy(), (B, T)), dtype=np.int64)
        if types.min() < 0 or types.max() >= config.type_vocab_size:
            return None
        feeds["token_type_ids"] = types
    return feeds


_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.float32, torch.float64)


def length_groups(lengths: list[int], call_cost: int = CALL_COST_TOKENS) -> list[tuple[list[int], int]]:
    """Partition rows into groups, each run trimmed to its longest row: [(row indices, length), ...].

    Rows sorted by length are cut into consecutive groups minimising sum(call_cost + rows * longest) over groups,
    the tokens computed padding included plus a call's fixed cost (dynamic programming, O(B^2))."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sorted_lengths = [lengths[i] for i in order]
    best = [0.0] + [float("inf")] * len(order)  # best[j]: cost of the first j rows
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        longest = sorted_lengths[j - 1]
        for i in range(j):
            cost = best[i] + call_cost + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append((order[cut[j]:j], sorted_lengths[j - 1]))
        j = cut[j]
    return groups[::-1]
