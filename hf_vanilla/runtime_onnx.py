"""ONNX Runtime as the engine behind a vanilla encoder, with the model and its Hugging Face API left as they are.

    from transformers import AutoModel, pipeline
    from hf_vanilla.runtime_onnx import use_onnx_runtime

    model = use_onnx_runtime(AutoModel.from_pretrained(path))     # exports once, then cached on disk
    model(**batch)                                                # every encoder head, pipelines, generate's encoder

Why: at small requests an eager PyTorch forward spends most of its time between kernels (Python, dispatch, one
kernel launch per op); ONNX Runtime runs the same graph from C++ with fused kernels. Where that pays depends on the
CPU: `benchmarks/engines.py` measures it, and docs/performance.md has the figures.

What runs where. Every encoder of the model is exported with the repository's exporter
(`hf_vanilla.export.export_encoder`, torch.onnx with dynamic batch and sequence axes) as one graph: a BERT-style
`VanillaEncoderModel` (inside every `VanillaEncoder*` head) with its pooler, the encoder stack of an encoder-decoder
alone. From then on the encoder calls ONNX Runtime whenever it can give the same answer:

- inference only: autograd off (`no_grad`/`inference_mode`) or no parameter requiring grad, and `eval()` mode;
- `input_ids` given (not `inputs_embeds`), default positions, no cache, no hidden states or attention maps asked for;
- weights on the CPU in float32 and unchanged since the export. The parameters' identities and in-place versions are
  recorded at export; a weight that is later trained, loaded or replaced sends calls back to PyTorch, with a warning
  that names the fix (call `use_onnx_runtime` again);
- not while tracing or exporting.
Anything else runs PyTorch unchanged. The heads after the pooler (classifiers, the MLM projection) and the decoder
stay in PyTorch. A request costs one engine call: PyTorch work right after ONNX Runtime's, on the same cores, waits
for torch's threads to get them back (`encoder_units` has the measurement).

Which graph. ONNX Runtime's BERT optimizer (`onnxruntime.transformers.optimizer`, `model_type="bert"`) rewrites the
exported graph with fused LayerNorm and GELU kernels. Whether that is faster depends on the CPU: on the Intel Xeon of
issue 19 the fused graph ran MiniLM 1x16 at 3.57x transformers against the plain graph's 3.22x; on AMD Zen 4 the
plain graph won in every run (2.35x against 1.73x). So by default (`fuse="auto"`) both are built and timed against
each other on a short request (1 x 16 tokens, the case this runtime is for), paired calls in alternating order, and
the faster one is kept; `fuse=True` or `fuse=False` skips the measurement. The choice is in `runner.graph`, its
median ratio in `runner.fused_speedup`.

Padded batches keep the padding-free idea: a batch whose padding is at the end of each row is split into groups of
rows of similar length (rows sorted by length, grouped by a small dynamic programme that weighs a call's fixed cost
against the padding it would compute), and each group runs trimmed to its own longest row. Outputs at padding
positions are zeros, as on PyTorch's packed path. A batch with padding elsewhere (left padding, holes) runs whole,
with its mask, as PyTorch's padded path does.

The cache. Graphs are written to `cache_dir` (default `~/.cache/hf_vanilla/onnx`) under a key that hashes the
encoder's configuration and outputs, every weight's bytes and the torch / onnxruntime versions, so a fine-tuned copy
of a model never reuses another's graph. Writes are atomic (a temporary file, then a rename); nothing else in the
directory is touched. Hashing costs about 1 s per GB of weights on every call of `use_onnx_runtime`; exporting
(10-30 s for bert-base) and optimising are paid once per key; choosing the graph (`fuse="auto"`) costs 2 x 10 short
requests per call of `use_onnx_runtime`, measured anew each time since the CPU is the machine's, not the cache's.

Memory: ONNX Runtime holds its own copy of the weights (prepacked for its kernels), next to the PyTorch model's.
"""

import copy
import hashlib
import inspect
import json
import operator
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPoolingAndCrossAttentions,
)

from .kernels import is_tracing
from .modeling_vanilla import VanillaEncoderModel, VanillaStack
from .validation import check_inputs

CACHE_FORMAT = 1  # bump when the exported graph changes for the same weights
# The graph choice of fuse="auto": timed pairs (plain, fused) on a (1, CHOICE_TOKENS) request after one warm-up each.
CHOICE_PAIRS, CHOICE_TOKENS = 10, 16
# A call's fixed cost in tokens' worth of work: what grouping two rows must save in padding to pay for a second call.
CALL_COST_TOKENS = 32


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hf_vanilla" / "onnx"


def use_onnx_runtime(model, cache_dir=None, fuse: bool | str = "auto", threads: int | None = None):
    """Run every encoder of `model` (a vanilla model) on ONNX Runtime where it gives the same answer (see the module
    docstring), and return `model`. `fuse`: "auto" (time the plain and the BERT-optimized graph on this CPU and keep
    the faster), True or False. `threads`: ONNX Runtime's intra-op threads (default: torch's `get_num_threads()`, so
    both engines use what the process was given). Calling it again re-exports if the weights changed, and is cheap
    otherwise."""
    if fuse not in (True, False, "auto"):
        raise ValueError(f"fuse={fuse!r}: pass 'auto' (measure which graph is faster here), True or False.")
    units = encoder_units(model)
    if not units:
        raise ValueError(f"{type(model).__name__} has no vanilla encoder to run on ONNX Runtime; use_onnx_runtime "
                         f"takes a model from hf_vanilla (VanillaEncoder*, VanillaSeq2Seq*).")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    for unit in units:
        _remove_unit_runtime(unit)
        runner = OnnxEncoderRunner(unit, cache_dir, fuse, threads or torch.get_num_threads())
        unit.__class__ = _runtime_class(type(unit))
        unit._onnx_runner = runner
    return model


def encoder_units(model) -> list:
    """What runs as one graph: each BERT-style encoder (`VanillaEncoderModel`: embeddings, layers and its pooler),
    and each encoder stack outside one (the encoder of an encoder-decoder). Decoders, causal ones included, stay in
    PyTorch. The pooler belongs in the graph: a PyTorch op right after an ONNX Runtime call waits for torch's
    threads while ONNX Runtime's still hold the cores (measured: 5-14 ms for the 384 x 384 pooler of MiniLM on
    2 threads, 0.4 ms on one)."""
    models = [m for m in model.modules() if isinstance(m, VanillaEncoderModel) and not m.config.is_decoder]
    inside = {id(m.encoder) for m in models}
    stacks = [m for m in model.modules() if isinstance(m, VanillaStack) and not m.is_decoder and id(m) not in inside]
    return models + stacks


def remove_onnx_runtime(model):
    """Undo `use_onnx_runtime`: every encoder runs in PyTorch again. Returns `model`."""
    for module in model.modules():
        _remove_unit_runtime(module)
    return model


def _remove_unit_runtime(unit) -> None:
    if "_onnx_runner" in unit.__dict__:
        del unit._onnx_runner
        unit.__class__ = type(unit).__mro__[1]


_RUNTIME_CLASSES = {}


def _runtime_class(base):
    """`base` with a forward that tries ONNX Runtime first. A subclass (not an instance attribute) so that
    `copy.deepcopy` gives the copy a forward bound to the copy; the copy's parameters are new objects, so it
    falls back to PyTorch until `use_onnx_runtime` is called on it."""
    if base not in _RUNTIME_CLASSES:
        def forward(self, *args, **kwargs):
            # Keyword calls (every Hugging Face caller's) need no binding: 6 us of a 3 ms request.
            arguments = self._onnx_runner.signature.bind(*args, **kwargs).arguments if args else kwargs
            output = self._onnx_runner(self, arguments)
            return output if output is not None else base.forward(self, *args, **kwargs)

        _RUNTIME_CLASSES[base] = type(f"OnnxRuntime{base.__name__}", (base,), {"forward": forward})
    return _RUNTIME_CLASSES[base]


class OnnxEncoderRunner:
    """An ONNX Runtime session for one encoder (see `encoder_units`), and the test of whether a call may use it."""

    def __init__(self, unit, cache_dir: Path, fuse: bool | str, threads: int):
        import onnxruntime

        self.signature = inspect.signature(unit.forward)  # bound: without `self`
        self.unit = unit
        self.outputs = ("last_hidden_state",) + (("pooler_output",) if getattr(unit, "pooler", None) is not None
                                                 else ())
        self.tensors = _Tensors(unit)
        self.warned = False
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        graphs = {"plain": False, "fused": True} if fuse == "auto" else {"fused" if fuse else "plain": fuse}
        key = _cache_key(unit, self.outputs)
        paths = {graph: _cached_graph(unit, self.outputs, cache_dir, key, fused) for graph, fused in graphs.items()}
        sessions = {graph: onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                    for graph, path in paths.items()}
        self.token_types = "token_type_ids" in {i.name for i in next(iter(sessions.values())).get_inputs()}
        self.fused_speedup = None
        if len(sessions) == 2:
            self.fused_speedup = _speedup(sessions["plain"], sessions["fused"], self._probe(unit.config))
        self.graph = "fused" if fuse is True or (self.fused_speedup or 0) > 1 else "plain"
        self.path, self.session = paths[self.graph], sessions[self.graph]

    def _probe(self, config) -> dict:
        """The feeds of a short request: (1, CHOICE_TOKENS) ids spread over the vocabulary."""
        ids = (torch.arange(CHOICE_TOKENS) * 7919 % config.vocab_size)[None, :]
        feeds = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.token_types:
            feeds["token_type_ids"] = torch.zeros_like(ids)
        return {name: value.numpy() for name, value in feeds.items()}

    def __deepcopy__(self, memo):
        """The same session (it cannot be copied), still bound to the original unit: the copy, whose parameters are
        new objects, runs in PyTorch and warns once for itself."""
        clone = copy.copy(self)
        clone.warned = False
        return clone

    def __call__(self, unit, arguments: dict):
        """The unit's output computed by ONNX Runtime, or None where PyTorch must run it."""
        get = arguments.get
        input_ids, attention_mask, token_type_ids = get("input_ids"), get("attention_mask"), get("token_type_ids")
        config = unit.config
        if (
            input_ids is None or get("inputs_embeds") is not None or get("position_ids") is not None
            or get("past_key_values") is not None or get("encoder_hidden_states") is not None
            or (config.output_attentions if get("output_attentions") is None else get("output_attentions"))
            or (config.output_hidden_states if get("output_hidden_states") is None else get("output_hidden_states"))
            or unit.training or is_tracing() or input_ids.device.type != "cpu"
            or (attention_mask is not None and attention_mask.dim() != 2)  # a 4-D mask: the caller's own
            or (token_type_ids is not None and not self.token_types)
        ):
            return None
        stack = unit.encoder if isinstance(unit, VanillaEncoderModel) else unit
        weight = stack.embeddings.word_embeddings.weight  # `.to()` keeps identities and versions: check its result
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        if torch.is_grad_enabled() and any(p.requires_grad for p in unit.parameters()):
            return None
        if unit is not self.unit or not self.tensors.unchanged():
            if not self.warned:
                warnings.warn("The encoder's weights changed after use_onnx_runtime exported them: it runs in "
                              "PyTorch now. Call hf_vanilla.runtime_onnx.use_onnx_runtime(model) again to export "
                              "the new weights.", stacklevel=4)
                self.warned = True
            return None
        # The same checks, with the same messages, as PyTorch's path (ids in range, shapes, mask values), asked only
        # when a quick look in numpy finds something to refuse: torch ops right before ONNX Runtime's call cost
        # 0.5-0.7 ms after an idle moment (bert-base 1 x 16, AMD Zen 4), nearly what numpy spends on the whole look.
        feeds = _feeds(config, input_ids, attention_mask, token_type_ids if self.token_types else None)
        if feeds is None:
            check_inputs(config, is_decoder=False, input_ids=input_ids, inputs_embeds=None,
                         token_type_ids=token_type_ids, position_ids=None, attention_mask=attention_mask)
            # Valid after all, in a form the quick look does not take (a float or uint8 mask, one row of segments).
            feeds = _feeds(config, input_ids, None if attention_mask is None else attention_mask.long(),
                           None if token_type_ids is None or not self.token_types
                           else token_type_ids.long().expand(input_ids.shape))
            if feeds is None:
                return None
        if self.token_types and "token_type_ids" not in feeds:
            feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
        outputs = dict(zip(self.outputs, (torch.from_numpy(array) for array in self.run(feeds))))
        if isinstance(unit, VanillaStack):
            return BaseModelOutputWithPastAndCrossAttentions(**outputs)
        return unit._output(BaseModelOutputWithPoolingAndCrossAttentions, None, get("return_dict"), **outputs)

    def run(self, feeds: dict) -> list[np.ndarray]:
        """The graph's outputs, (B, T, E) hidden states first: one call for a batch without end-padding to trim,
        else one per group of rows, scattered back."""
        mask = feeds["attention_mask"]
        B, T = mask.shape
        lengths = mask.sum(1)
        if lengths.min() in (0, T) or not (mask == (np.arange(T)[None, :] < lengths[:, None])).all():
            return self._session_run(feeds)  # dense, a row of padding only, or padding not at the ends
        outputs = None
        for rows, length in length_groups(lengths.tolist()):
            index = np.asarray(rows)
            group = self._session_run({name: value[index, :length] for name, value in feeds.items()})
            if outputs is None:  # hidden states (B, T, E), then per-row outputs (B, ...)
                outputs = [np.zeros((B, T, group[0].shape[-1]), group[0].dtype)]
                outputs += [np.zeros((B, *out.shape[1:]), out.dtype) for out in group[1:]]
            outputs[0][index, :length] = group[0]
            for whole, part in zip(outputs[1:], group[1:]):
                whole[index] = part
        outputs[0][mask == 0] = 0.0
        return outputs

    def _session_run(self, feeds: dict) -> list[np.ndarray]:
        return self.session.run(None, feeds)


def _feeds(config, input_ids, attention_mask, token_type_ids) -> dict | None:
    """The session's inputs as int64 numpy arrays, or None unless every check `check_inputs` makes of an encoder's
    input plainly passes: 2-D integer ids in the vocabulary, no longer than the position table; a 2-D 0/1 integer or
    bool mask of their shape; integer segment ids of their shape (or one row) in range. A subset of what
    `check_inputs` accepts, never more: what this refuses goes to `check_inputs`, which raises its own message."""
    def integer(tensor):
        return tensor.dtype in (torch.int64, torch.int32, torch.bool)

    if not integer(input_ids) or input_ids.dtype == torch.bool or input_ids.dim() != 2:
        return None
    ids = np.ascontiguousarray(input_ids.numpy(), dtype=np.int64)  # ONNX Runtime reads C-ordered int64
    B, T = ids.shape
    limit = config.max_position_embeddings - config.position_offset
    if B == 0 or T == 0 or T > limit or ids.min() < 0 or ids.max() >= config.vocab_size:
        return None
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        if not integer(attention_mask) or tuple(attention_mask.shape) != (B, T):
            return None
        mask = np.ascontiguousarray(attention_mask.numpy(), dtype=np.int64)
        if mask.min() < 0 or mask.max() > 1:
            return None
    feeds = {"input_ids": ids, "attention_mask": mask}
    if token_type_ids is not None:
        if not integer(token_type_ids) or token_type_ids.dtype == torch.bool or token_type_ids.dim() != 2 \
                or token_type_ids.shape[1] != T or token_type_ids.shape[0] not in (B, 1):
            return None
        types = np.ascontiguousarray(np.broadcast_to(token_type_ids.numpy(), (B, T)), dtype=np.int64)
        if types.min() < 0 or types.max() >= config.type_vocab_size:
            return None
        feeds["token_type_ids"] = types
    return feeds


def _speedup(plain, fused, feeds: dict) -> float:
    """Median over paired calls of t_plain / t_fused (above 1: the fused graph is faster), each pair in alternating
    order, so that a busy moment on a shared machine and the cache left by the previous call hit both."""
    for session in (plain, fused):
        session.run(None, feeds)  # the first run allocates and prepacks
    ratios = []
    for pair in range(CHOICE_PAIRS):
        seconds = {}
        for session in (plain, fused)[:: 1 if pair % 2 == 0 else -1]:
            start = time.perf_counter()
            session.run(None, feeds)
            seconds[session] = time.perf_counter() - start
        ratios.append(seconds[plain] / seconds[fused])
    return statistics.median(ratios)


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


class _Tensors:
    """Every parameter and buffer of a unit: the registry (a module's `_parameters` or `_buffers`) and name it sits
    under, and its in-place version at export."""

    def __init__(self, unit):
        entries = [(registry, name, tensor) for module in unit.modules()
                   for registry in (module._parameters, module._buffers) for name, tensor in registry.items()
                   if tensor is not None]
        self.registries, self.names, self.tensors = (tuple(column) for column in zip(*entries))
        self.versions = tuple(map(_VERSION, self.tensors))

    def unchanged(self) -> bool:
        """No tensor replaced (another object under its name) or written in place (a new version: any training
        step, `load_state_dict` or `copy_`) since the export. It runs on every call, so the loops are `map`s, run in
        C: 20 us of Python for MiniLM's 100 tensors became a few."""
        return (all(map(operator.is_, map(dict.get, self.registries, self.names), self.tensors))
                and tuple(map(_VERSION, self.tensors)) == self.versions)


_VERSION = operator.attrgetter("_version")


def _cache_key(unit, outputs: tuple) -> str:
    import onnxruntime

    digest = hashlib.sha256()
    meta = {"format": CACHE_FORMAT, "outputs": outputs, "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__, "config": unit.config.to_diff_dict()}
    digest.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name, tensor in unit.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:32]


def _cached_graph(unit, outputs: tuple, cache_dir: Path, key: str, fuse: bool) -> Path:
    """The unit's graph from the cache, exported (and for `fuse`, optimised from the plain graph) into it first if
    absent: the export, the slow step, is shared by both graphs."""
    path = cache_dir / f"encoder-{key}-{'fused' if fuse else 'plain'}.onnx"
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    config = unit.config
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".export-") as staging:
        if fuse:
            from onnxruntime.transformers.optimizer import optimize_model

            optimized = optimize_model(str(_cached_graph(unit, outputs, cache_dir, key, fuse=False)), model_type="bert",
                                       num_heads=config.num_attention_heads, hidden_size=config.hidden_size)
            graph = Path(staging, "model_fused.onnx")
            optimized.save_model_to_file(str(graph))
        else:
            from .export import export_encoder

            input_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if config.type_vocab_size > 0 else [])
            graph = Path(staging, "model.onnx")
            was_training = unit.training
            unit.eval()
            try:
                with torch.no_grad():
                    export_encoder(unit, graph, input_names, outputs)
            finally:
                unit.train(was_training)
        os.replace(graph, path)  # atomic: a reader sees the whole graph or none
    return path
