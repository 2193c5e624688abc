"""The engine: an `OwnedEncoder` in front of a BERT-style body's forward, holding the body's weights.

Why own them. OpenVINO's lead on short requests is that it lays each weight out for its kernels once, when it
compiles (docs/performance.md: its profile on Zen 3 spent 11.5 of 12.3 ms in `FullyConnected`; fed the weights as
inputs on every call, as `runtime="onnxruntime"` does, it is 2.3-4.4x slower at 16 tokens). A compiled copy can only
be trusted while nothing else writes the weights, and nothing short of reading every weight tells a `.data` or numpy
write from no write. So the engine takes them: at attach the body's parameters and buffers move into a private
copy of the body (`shadow`), and the body the user holds keeps its modules, config and code but no tensor
(`model.parameters()` has none of them; `layer.weight` is an AttributeError). Every change then comes through a
door the engine keeps:
- `state_dict()` / `save_pretrained` write the shadow's tensors (copies) under the body's names, so any class
  loads the checkpoint whole; `load_state_dict` (also `assign=True`) loads into the shadow and recompiles;
- a module replaced or added, a method patched on a class, a config value changed (the body compared with what was
  compiled on every call, `hf_vanilla.runtimes.watch`): the tensors go back into the body, and it is traced and
  compiled again (seconds), with the new modules' own tensors;
- `model.to(torch.bfloat16)` / `.float()`: the engine follows (the shadow moves, OpenVINO recompiles at that
  precision); to another device, or anything else, it refuses, naming `remove_openvino`;
- training (`model.train()`) and forward hooks inside the body, which the graph would not run, are refused, naming
  `remove_openvino`, which gives the tensors back to the body.

What runs where. OpenVINO answers what the graph computes: `input_ids` (not `inputs_embeds`), default positions,
no cache, no hidden states or attention maps asked for, input PyTorch would accept. The shadow (eager PyTorch, the
same weights) answers everything else, and, per request size, whichever of the two measured faster
(hf_vanilla/runtimes/choice.py; on AMD Zen 5 OpenVINO won every size of benchmarks/engines.py, padded batches
included, which it runs as groups of rows of similar length as `runtime="onnxruntime"` does).
Both answer within the parity rule of each other at float32; at bfloat16 and int8 OpenVINO's kernels round
differently from PyTorch's (the tests hold each to its precision's rule).

Precisions. "f32"; "bf16" (the weights rounded to bfloat16, as `model.to(torch.bfloat16)` rounds them: the shadow
holds and saves bfloat16, and OpenVINO computes its products in bfloat16); "int8" (each projection's weight as int8
per output row with a float32 scale, OpenVINO's compressed-weight products; embeddings, norms and biases float32;
the shadow keeps and saves the float32 weights, and PyTorch's path runs them in float32).
"""

import copy
import functools
import inspect
import os
import threading

import numpy as np
import openvino
import torch
from openvino import opset13 as ops

from ...export import example_inputs
from ...kernels import is_tracing
from .. import choice
from ..batches import PROBE_TOLERANCE, feeds_for, grouping, module_output, probe, run_grouped
from ..cache import GraphCache, cache_key, export_graph
from ..watch import Watch, class_code, hooked, structure_of

PRECISIONS = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}  # the shadow's dtype
# The one tensor the body still has: an empty parameter of the engine's dtype, so that model.to(...) tells the engine
# where the model was moved, and model.dtype / model.device (read off the parameters) still answer. Never saved.
MARKER = "_openvino_marker"


class OwnedEncoder:
    """A body's `forward` while OpenVINO runs it: the body's weights held in `shadow`, OpenVINO compiled from them."""

    def __init__(self, unit, precision: str, threads: int, cache: GraphCache):
        self.unit, self.precision, self.threads, self.cache = unit, precision, threads, cache
        self.lock = threading.RLock()  # one rebuild at a time; calls check the body under it
        self.choice = choice.engine_or_pytorch("openvino")
        self._take()

    # ---- taking the weights, and giving them back -------------------------------------------------------------

    def _take(self) -> None:
        """Move the body's tensors into a private copy of it, trace it (or find its graph), compile, and put the
        engine in front of the body's forward, with its state-dict doors."""
        unit = self.unit
        # Its own tensors, the body's own forward (the engine is not in front yet), and the body's config object: what
        # a user sets on model.config reaches both (a field the graph baked in is a change the watch sees).
        shadow = copy.deepcopy(unit, {id(unit.config): unit.config})
        dtype = PRECISIONS[self.precision]
        self.shadow, self.dtype = shadow.requires_grad_(False).to(dtype), dtype
        self.signature = inspect.signature(type(shadow).forward.__get__(shadow))
        # Traced and compiled before the body gives anything up: a failure leaves it whole.
        self.graph, checked = self._graph()
        self.compiled, self.local = self._compile(checked), threading.local()
        self.frozen = {name for name, parameter in unit.named_parameters() if not parameter.requires_grad}
        for module in unit.modules():  # the body keeps its modules and code, no tensor
            if module._parameters or module._buffers:
                module.extra_repr = held_repr  # torch's own reads the weights (Linear: `bias=...`)
            module._parameters.clear()
            module._buffers.clear()
            module._non_persistent_buffers_set.clear()
        unit.register_parameter(MARKER, torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False))
        unit.forward = self
        unit.register_state_dict_post_hook(functools.partial(OwnedEncoder.save, self))  # torch marks the hook:
        unit.register_load_state_dict_pre_hook(functools.partial(OwnedEncoder.load, self))  # not a bound method
        self.structure, self.code = structure_of(unit), class_code(unit)
        self.watch = self._watch()

    def give_back(self) -> None:
        """Put the shadow's tensors back into the body's modules, by path (modules added since keep their own), and
        the body's own forward and state-dict methods."""
        unit, own = self.unit, dict(self.shadow.named_modules())
        vars(unit).pop("forward", None)
        for hooks in (unit._state_dict_hooks, unit._load_state_dict_pre_hooks):
            for key in [key for key, hook in hooks.items() if getattr(getattr(hook, "hook", hook), "args", ())[:1]
                        == (self,)]:
                del hooks[key]
        unit._parameters.pop(MARKER, None)
        for path, module in unit.named_modules():
            source = own.get(path)
            if source is None or type(source) is not type(module) or module._parameters or module._buffers:
                continue  # new since attach (or the marker's): it holds its own tensors
            vars(module).pop("extra_repr", None)
            module._parameters.update(source._parameters)
            module._buffers.update(source._buffers)
            module._non_persistent_buffers_set.update(source._non_persistent_buffers_set)
        for name, parameter in unit.named_parameters():
            parameter.requires_grad_(name not in self.frozen)

    # ---- the graph and its compilation ------------------------------------------------------------------------

    def _graph(self) -> tuple:
        """(the shadow's graph reading its weights as inputs, from the cache or traced, OpenVINO's float32
        compilation of it that was checked against PyTorch (`batches.probe`))."""
        shadow = self.shadow.float() if self.dtype != torch.float32 else self.shadow
        try:
            structure = structure_of(shadow)
            inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if shadow.config.type_vocab_size else [])
            outputs = ("last_hidden_state",) + (("pooler_output",) if getattr(shadow, "pooler", None) is not None
                                                 else ())
            key = cache_key(shadow, structure, inputs, outputs)
            for fresh in (False, True):
                graph = self.cache.load(key) if not fresh else export_graph(shadow, inputs, outputs, key)
                if graph is None:
                    continue
                checked = compile_graph(graph, _tensors(shadow), "f32", self.threads)
                worst = probe(shadow.config, type(shadow).forward.__get__(shadow), _runner(checked),
                              "token_type_ids" in inputs)
                if worst <= PROBE_TOLERANCE:
                    if fresh:
                        self.cache.store(key, graph)
                    return graph, checked
                self.cache.discard(key)
            raise RuntimeError(f"OpenVINO's graph of {type(shadow).__name__} differs from PyTorch by {worst:.2e} x "
                               f"max(1, |output|): runtime='openvino' cannot run this model; use PyTorch or "
                               f"runtime='onnxruntime'.")
        finally:
            shadow.to(self.dtype)

    def _compile(self, checked=None):
        """OpenVINO compiled from the shadow's tensors at the engine's precision and run once on a short request: a
        precision its CPU plugin has no kernel for on this machine fails here, before the body gives anything up.
        `checked`: the float32 compilation `_graph` has just run against PyTorch, which is this one at "f32"."""
        if checked is not None and self.precision == "f32":
            compiled = checked
        else:
            try:
                compiled = compile_graph(self.graph, _tensors(self.shadow), self.precision, self.threads)
                inputs = example_inputs(self.shadow.config, [i.get_any_name() for i in compiled.inputs])
                compiled.create_infer_request().infer({name: value.numpy() for name, value in inputs.items()})
            except RuntimeError as error:
                said, capped = str(error).strip().splitlines()[-1], os.environ.get("ONEDNN_MAX_CPU_ISA")
                why = (f"; ONEDNN_MAX_CPU_ISA={capped} caps the oneDNN inside OpenVINO's CPU plugin, which picks "
                       f"its kernels by the CPU it finds") if capped else ""
                raise ValueError(f"OpenVINO cannot run precision {self.precision!r} on this machine ({said}): use "
                                 f"precision='f32'{why}.") from error
        self.names = [output.get_any_name() for output in compiled.outputs]
        self.token_types = any(i.get_any_name() == "token_type_ids" for i in compiled.inputs)
        return compiled

    # ---- calls ------------------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        arguments = self.signature.bind(*args, **kwargs).arguments if args else kwargs
        feeds = self._feeds(arguments)
        if feeds is None:
            return self._pytorch(args, kwargs)
        B, T = feeds["input_ids"].shape
        tokens = int(feeds["attention_mask"].sum())
        if tokens == B * T and self.compiled is not None and (
                choice.CHOICE == "engine" or self.choice.decision(choice.key_of(B, tokens))):
            return self._hot(feeds, arguments)
        return choice.answer(self.choice, feeds["attention_mask"], lambda: self._answer(feeds, arguments),
                             lambda: self._pytorch(args, kwargs))

    def _hot(self, feeds: dict, arguments: dict):
        """The path of what an embedding service sends most: one request without padding, of a size decided for
        OpenVINO. OpenVINO writes straight into the output's memory, and is called as start + wait, which answers
        0.5-0.9 ms sooner than `infer()` after an idle moment (MiniLM 1x16, AMD Zen 5; docs/performance.md). The
        checks run first, all of them: run beside OpenVINO's threads on a 2-core machine they slowed both."""
        with self.lock:
            self._follow()
            compiled = self.compiled
        request = self._request(compiled, hot=True)
        B, T = feeds["input_ids"].shape
        width = self.shadow.config.hidden_size
        outputs = [np.empty((B, T, width), np.float32)] + [np.empty((B, width), np.float32)] * (len(self.names) - 1)
        for index, array in enumerate(outputs):
            request.set_output_tensor(index, openvino.Tensor(array, shared_memory=True))
        request.start_async(feeds, share_inputs=True)
        request.wait()
        return module_output(self.shadow, dict(zip(self.names, outputs)), arguments.get("return_dict"), self.dtype)

    def _request(self, compiled, hot: bool = False):
        """This thread's infer request of `compiled` (one per thread: a request is not thread-safe), a second one for
        the hot path, whose outputs it points at its own arrays."""
        local = self.local
        if getattr(local, "compiled", None) is not compiled:
            local.compiled, local.requests = compiled, {}
        if hot not in local.requests:
            local.requests[hot] = compiled.create_infer_request()
        return local.requests[hot]

    def _watch(self) -> Watch:
        """The per-call check of the body (hf_vanilla/runtimes/watch.py), its marker the one tensor it follows."""
        return Watch(self.unit, list(self.unit._parameters.values()))

    def _pytorch(self, args, kwargs):
        """The shadow's answer: eager PyTorch on the engine's own copy of the weights."""
        with self.lock:
            self._follow()
            shadow = self.shadow
        return type(shadow).forward(shadow, *args, **kwargs)

    def _follow(self) -> None:
        """Follow or refuse whatever changed in the body since the last call (the module docstring)."""
        unit = self.unit
        if self.compiled is None:  # unpickled or deep-copied: compile from the shadow's tensors
            self.code, self.watch = class_code(unit), self._watch()
            self.compiled, self.local = self._compile(), threading.local()
        if self.watch.unchanged():
            return
        if structure_of(unit) != self.structure or class_code(unit) != self.code:
            self.give_back()  # a module replaced, a class patched, a config value changed: compile it anew
            self._take()
            return
        if any(module.training for module in unit.modules()):
            raise RuntimeError("runtime='openvino' runs inference only and holds the encoder's weights: call "
                               "model.eval(), or hf_vanilla.runtimes.openvino.remove_openvino(model) to train.")
        if hooked(unit):
            raise RuntimeError("Forward hooks are set inside an encoder whose weights runtime='openvino' holds, and "
                               "its graph would not run them: call hf_vanilla.runtimes.openvino.remove_openvino(model)"
                               " first.")
        marker = unit._parameters.get(MARKER)
        moved = marker is None or marker.device.type != "cpu" or marker.dtype not in (torch.float32, torch.bfloat16)
        if moved or (self.precision == "int8" and marker.dtype != torch.float32):
            where = "lost its marker" if marker is None else f"moved to {marker.dtype} on {marker.device}"
            raise RuntimeError(f"The model {where} after runtime='openvino' took its encoder's weights, which stay in "
                               f"OpenVINO on the CPU at precision {self.precision!r}: call model.float() to go on, "
                               f"or hf_vanilla.runtimes.openvino.remove_openvino(model) first.")
        if marker.dtype != self.dtype:  # model.to(torch.bfloat16) or .float(): follow
            self.precision = "bf16" if marker.dtype == torch.bfloat16 else "f32"
            self.dtype = PRECISIONS[self.precision]
            self.shadow.to(self.dtype)
            self.compiled, self.local = self._compile(), threading.local()
        self.watch = self._watch()

    def _feeds(self, arguments: dict):
        """The graph's inputs, or None where PyTorch (the shadow) must answer."""
        get = arguments.get
        config = self.shadow.config
        if (
            get("input_ids") is None or get("inputs_embeds") is not None or get("position_ids") is not None
            or get("past_key_values") is not None or get("encoder_hidden_states") is not None
            or (config.output_attentions if get("output_attentions") is None else get("output_attentions"))
            or (config.output_hidden_states if get("output_hidden_states") is None else get("output_hidden_states"))
            or is_tracing()
        ):
            return None
        feeds = feeds_for(config, get("input_ids"), get("attention_mask"), get("token_type_ids"))
        if feeds is not None and config.type_vocab_size and "token_type_ids" not in feeds:
            feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
        return feeds

    def _answer(self, feeds: dict, arguments: dict):
        """The body's output for `feeds`, computed by OpenVINO (rows grouped by length, as `runtime="onnxruntime"`
        groups them), in the shadow's dtype."""
        with self.lock:
            self._follow()
            compiled = self.compiled
        request = self._request(compiled)

        def run(part):
            request.start_async(part, share_inputs=True)
            request.wait()
            return [request.get_output_tensor(index).data.copy() for index in range(len(self.names))]

        outputs = run_grouped(run, feeds, grouping(feeds))
        return module_output(self.shadow, dict(zip(self.names, outputs)), arguments.get("return_dict"), self.dtype)

    # ---- the doors: state dicts, copies, pickling --------------------------------------------------------------

    def save(self, module, state_dict: dict, prefix: str, local_metadata) -> None:
        """`state_dict()`'s hook on the body: the shadow's tensors, copied (a write into them must not reach the
        engine unseen)."""
        with self.lock:
            state_dict.pop(prefix + MARKER, None)
            for name, tensor in self.shadow.state_dict().items():
                state_dict[prefix + name] = tensor.detach().clone()

    def load(self, module, state_dict: dict, prefix: str, local_metadata, strict, missing_keys, unexpected_keys,
             error_msgs) -> None:
        """`load_state_dict()`'s hook on the body: the shadow's keys are taken out of `state_dict`, loaded into the
        shadow (as `load_state_dict` would, `assign=` included), and OpenVINO is compiled from them."""
        with self.lock:
            if structure_of(self.unit) != self.structure:  # a module replaced: its keys go to it, not the shadow
                self.give_back()
                self._take()
            own = self.shadow.state_dict()
            mine = {name[len(prefix):]: state_dict.pop(name).detach().clone() for name in list(state_dict)
                    if name.startswith(prefix) and name[len(prefix):] in own}  # copies: the caller keeps its tensors
            result = self.shadow.load_state_dict(mine, strict=False,
                                                 assign=local_metadata.get("assign_to_params_buffers", False))
            missing_keys.extend(prefix + name for name in result.missing_keys)
            marker = module._parameters.get(MARKER)
            if marker is not None:  # not in any checkpoint: loaded as itself
                state_dict[prefix + MARKER] = marker
            self.shadow.requires_grad_(False).to(self.dtype)
            self.compiled, self.local = self._compile(), threading.local()

    def __deepcopy__(self, memo):
        clone = object.__new__(type(self))
        vars(clone).update(vars(self))
        clone.unit, clone.shadow = copy.deepcopy(self.unit, memo), copy.deepcopy(self.shadow, memo)
        clone.lock, clone.local, clone.choice = threading.RLock(), threading.local(), copy.deepcopy(self.choice)
        clone.watch, clone.compiled = None, None  # built at its first call, on the copy
        return clone

    def __getstate__(self):
        """Pickled with the model: the shadow and the graph's bytes; compiled again at the first call."""
        return dict(vars(self), lock=None, local=None, compiled=None, watch=None, code=None)

    def __setstate__(self, state):
        vars(self).update(state)
        self.lock, self.local = threading.RLock(), threading.local()


def held_repr() -> str:
    """What `print(model)` shows of a module whose tensors the engine holds."""
    return "weights held by OpenVINO: hf_vanilla.runtimes.openvino.remove_openvino(model) gives them back"


def _tensors(shadow) -> dict:
    """The shadow's tensors by the names the graph reads them, as float32 numpy arrays."""
    return {name: tensor.detach().float().numpy() for name, tensor in [*shadow.named_parameters(),
                                                                       *shadow.named_buffers()]}


def compile_graph(graph: bytes, tensors: dict, precision: str, threads: int):
    """OpenVINO's compiled model of `graph` with `tensors` as its constants: each weight input replaced by a
    Constant (int8 per output row for the projections' weights at precision "int8"), laid out for its kernels once."""
    core = openvino.Core()
    model = core.read_model(model=graph, weights=openvino.Tensor(np.zeros(0, np.uint8)))
    projections = {name for name, array in tensors.items() if array.ndim == 2 and "embeddings" not in name}
    for parameter in list(model.get_parameters()):
        name = parameter.get_friendly_name()
        if name not in tensors:
            continue  # a request input
        array = tensors[name]
        if precision == "int8" and name in projections:
            scale = np.maximum(np.abs(array).max(axis=1, keepdims=True), np.finfo(np.float32).tiny) / 127.0
            quantized = np.clip(np.rint(array / scale), -127, 127).astype(np.int8)
            node = ops.multiply(ops.convert(ops.constant(quantized), openvino.Type.f32),
                                ops.constant(scale.astype(np.float32)))
        else:
            node = ops.constant(np.ascontiguousarray(array))
        for target in list(parameter.output(0).get_target_inputs()):
            target.replace_source_output(node.output(0))
        model.remove_parameter(parameter)
    model.validate_nodes_and_infer_types()
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads,
              "INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32"}
    return core.compile_model(model, "CPU", config)


def _runner(compiled):
    """`run(feeds) -> {output name: array}` on a fresh infer request of `compiled` (for `batches.probe`)."""
    request = compiled.create_infer_request()
    return lambda feeds: {output.get_any_name(): array for output, array in request.infer(feeds).items()}
