"""ONNX Runtime as the engine behind a vanilla encoder, with the model and its Hugging Face API left as they are.

    from transformers import AutoModel, pipeline
    from hf_vanilla.runtime_onnx import use_onnx_runtime

    model = use_onnx_runtime(AutoModel.from_pretrained(path))     # exports once, then cached on disk
    model(**batch)                                                # every encoder head, pipelines, generate's encoder

Why: at small requests an eager PyTorch forward spends most of its time between kernels (Python, dispatch, one
kernel launch per op); ONNX Runtime runs the same graph from C++ with fused kernels. Where that pays depends on the
CPU: `benchmarks/engines.py` measures it, and docs/performance.md has the figures.

What runs where. Every encoder stack of the model (`VanillaStack` that is not a decoder: the encoder of
`VanillaEncoder*` heads and of the encoder-decoder) is exported with the repository's exporter
(`conversion.onnx_export.export_encoder`, torch.onnx with dynamic batch and sequence axes), optionally rewritten by
ONNX Runtime's BERT optimizer (`fuse=True`), and from then on calls ONNX Runtime whenever it can give the same answer:

- inference only: autograd off (`no_grad`/`inference_mode`) or no parameter requiring grad, and `eval()` mode;
- `input_ids` given (not `inputs_embeds`), default positions, no cache, no hidden states or attention maps asked for;
- weights on the CPU in float32 and unchanged since the export. The parameters' identities and in-place versions are
  recorded at export; a weight that is later trained, loaded or replaced sends calls back to PyTorch, with a warning
  that names the fix (call `use_onnx_runtime` again);
- not while tracing or exporting.
Anything else runs the PyTorch stack unchanged. Heads (pooler, classifiers, the MLM projection) and the decoder stay
in PyTorch.

Padded batches keep the padding-free idea: a batch whose padding is at the end of each row is split into groups of
rows of similar length (rows sorted by length, grouped by a small dynamic programme that weighs a call's fixed cost
against the padding it would compute), and each group runs trimmed to its own longest row. Outputs at padding
positions are zeros, as on PyTorch's packed path. A batch with padding elsewhere (left padding, holes) runs whole,
with its mask, as PyTorch's padded path does.

The cache. Graphs are written to `cache_dir` (default `~/.cache/hf_vanilla/onnx`) under a key that hashes the
stack's configuration, every weight's bytes and the torch / onnxruntime versions, so a fine-tuned copy of a model
never reuses another's graph. Writes are atomic (a temporary file, then a rename); nothing else in the directory is
touched. Hashing costs about 1 s per GB of weights on every call of `use_onnx_runtime`; exporting (10-30 s for
bert-base) and optimising are paid once per key.

Memory: ONNX Runtime holds its own copy of the weights (prepacked for its kernels), next to the PyTorch model's.
"""

import copy
import hashlib
import inspect
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from .kernels import is_tracing
from .modeling_vanilla import VanillaStack
from .validation import check_inputs

CACHE_FORMAT = 1  # bump when the exported graph changes for the same weights
# A call's fixed cost in tokens' worth of work: what grouping two rows must save in padding to pay for a second call.
CALL_COST_TOKENS = 32


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hf_vanilla" / "onnx"


def use_onnx_runtime(model, cache_dir=None, fuse: bool = True, threads: int | None = None):
    """Run every encoder stack of `model` (a vanilla model) on ONNX Runtime where it gives the same answer (see the
    module docstring), and return `model`. `threads`: ONNX Runtime's intra-op threads (default: torch's
    `get_num_threads()`, so both engines use what the process was given). Calling it again re-exports if the
    weights changed, and is cheap otherwise."""
    stacks = [m for m in model.modules() if isinstance(m, VanillaStack) and not m.is_decoder]
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no vanilla encoder stack to run on ONNX Runtime; "
                         f"use_onnx_runtime takes a model from hf_vanilla (VanillaEncoder*, VanillaSeq2Seq*).")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    for stack in stacks:
        remove_stack_runtime(stack)
        runner = OnnxStackRunner(stack, cache_dir, fuse, threads or torch.get_num_threads())
        stack.__class__ = _runtime_class(type(stack))
        stack._onnx_runner = runner
    return model


def remove_onnx_runtime(model):
    """Undo `use_onnx_runtime`: every stack runs in PyTorch again. Returns `model`."""
    for module in model.modules():
        if isinstance(module, VanillaStack):
            remove_stack_runtime(module)
    return model


def remove_stack_runtime(stack) -> None:
    if "_onnx_runner" in stack.__dict__:
        del stack._onnx_runner
        stack.__class__ = type(stack).__mro__[1]


_RUNTIME_CLASSES = {}


def _runtime_class(base):
    """`base` with a forward that tries ONNX Runtime first. A subclass (not an instance attribute) so that
    `copy.deepcopy` gives the copy a forward bound to the copy; the copy's parameters are new objects, so it
    falls back to PyTorch until `use_onnx_runtime` is called on it."""
    if base not in _RUNTIME_CLASSES:
        def forward(self, *args, **kwargs):
            arguments = self._onnx_runner.signature.bind(*args, **kwargs).arguments
            output = self._onnx_runner(self, arguments)
            return output if output is not None else base.forward(self, *args, **kwargs)

        _RUNTIME_CLASSES[base] = type(f"OnnxRuntime{base.__name__}", (base,), {"forward": forward})
    return _RUNTIME_CLASSES[base]


class OnnxStackRunner:
    """An ONNX Runtime session for one encoder stack, and the test of whether a call may use it."""

    def __init__(self, stack, cache_dir: Path, fuse: bool, threads: int):
        import onnxruntime

        self.signature = inspect.signature(stack.forward)  # bound: without `self`
        self.fingerprint = _fingerprint(stack)
        self.warned = False
        self.path = _cached_graph(stack, cache_dir, fuse)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self.session = onnxruntime.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        self.token_types = "token_type_ids" in {i.name for i in self.session.get_inputs()}

    def __deepcopy__(self, memo):
        """The same session (it cannot be copied); the copy's parameters are new objects, so they fail the
        fingerprint test and the copy warns once for itself."""
        clone = copy.copy(self)
        clone.warned = False
        return clone

    def __call__(self, stack, arguments: dict):
        """The stack's output computed by ONNX Runtime, or None where PyTorch must run it."""
        get = arguments.get
        input_ids, attention_mask, token_type_ids = get("input_ids"), get("attention_mask"), get("token_type_ids")
        config = stack.config
        if (
            input_ids is None or get("inputs_embeds") is not None or get("position_ids") is not None
            or get("past_key_values") is not None or get("encoder_hidden_states") is not None
            or (config.output_attentions if get("output_attentions") is None else get("output_attentions"))
            or (config.output_hidden_states if get("output_hidden_states") is None else get("output_hidden_states"))
            or stack.training or is_tracing() or input_ids.device.type != "cpu"
            or (attention_mask is not None and attention_mask.dim() != 2)  # a 4-D mask: the caller's own
            or (token_type_ids is not None and not self.token_types)
        ):
            return None
        weight = stack.embeddings.word_embeddings.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        if torch.is_grad_enabled() and any(p.requires_grad for p in stack.parameters()):
            return None
        if _fingerprint(stack) != self.fingerprint:
            if not self.warned:
                warnings.warn("The encoder's weights changed after use_onnx_runtime exported them: it runs in "
                              "PyTorch now. Call hf_vanilla.runtime_onnx.use_onnx_runtime(model) again to export "
                              "the new weights.", stacklevel=4)
                self.warned = True
            return None
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # The same checks, with the same messages, as PyTorch's path (ids in range, shapes, mask values).
        check_inputs(config, is_decoder=False, input_ids=input_ids, inputs_embeds=None, token_type_ids=token_type_ids,
                     position_ids=None, attention_mask=attention_mask)
        if self.token_types:
            token_type_ids = (torch.zeros_like(input_ids) if token_type_ids is None
                              else token_type_ids.expand(B, T))
        # int64, as traced: a bool or float mask means the same and ONNX Runtime would refuse it.
        feeds = {"input_ids": input_ids.long(), "attention_mask": attention_mask.long(),
                 "token_type_ids": None if token_type_ids is None else token_type_ids.long()}
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=self.run(feeds))

    def run(self, feeds: dict) -> torch.Tensor:
        """(B, T, E) hidden states: one call for a batch without end-padding to trim, else one per group."""
        mask = feeds["attention_mask"]
        B, T = mask.shape
        lengths = mask.sum(1)
        right_padded = torch.equal(mask.bool(), torch.arange(T)[None, :] < lengths[:, None])
        if not right_padded or int(lengths.min()) == 0 or int(lengths.min()) == T:
            return self._session_run(feeds)
        hidden = None
        for rows, length in length_groups(lengths.tolist()):
            index = torch.tensor(rows)
            out = self._session_run({name: v[index, :length] for name, v in feeds.items() if v is not None})
            if hidden is None:
                hidden = out.new_zeros(B, T, out.shape[-1])
            hidden[index, :length] = out
        return hidden.masked_fill_(~mask.bool()[:, :, None], 0.0)

    def _session_run(self, feeds: dict) -> torch.Tensor:
        arrays = {name: value.contiguous().numpy() for name, value in feeds.items() if value is not None}
        return torch.from_numpy(self.session.run(None, arrays)[0])


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


def _fingerprint(stack) -> tuple:
    """Which tensors the stack holds and how often each was written in place: any training step, `load_state_dict`
    or `copy_` changes a version; a replaced parameter changes an identity."""
    return tuple((id(t), t._version) for t in (*stack.parameters(), *stack.buffers()))


def _cache_key(stack, fuse: bool) -> str:
    import onnxruntime

    digest = hashlib.sha256()
    meta = {"format": CACHE_FORMAT, "fuse": fuse, "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "config": stack.config.to_diff_dict()}
    digest.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name, tensor in stack.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:32]


def _cached_graph(stack, cache_dir: Path, fuse: bool) -> Path:
    """The stack's graph from the cache, exported (and optimised) into it first if absent."""
    path = cache_dir / f"encoder-{_cache_key(stack, fuse)}.onnx"
    if path.is_file():
        return path
    from hf_vanilla.conversion.onnx_export import export_encoder

    cache_dir.mkdir(parents=True, exist_ok=True)
    config = stack.config
    input_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if config.type_vocab_size > 0 else [])
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".export-") as staging:
        graph = Path(staging, "model.onnx")
        was_training = stack.training
        stack.eval()
        try:
            with torch.no_grad():
                export_encoder(stack, graph, input_names, ("last_hidden_state",))
        finally:
            stack.train(was_training)
        if fuse:
            from onnxruntime.transformers.optimizer import optimize_model

            heads = config.num_attention_heads
            optimized = optimize_model(str(graph), model_type="bert", num_heads=heads, hidden_size=config.hidden_size)
            graph = Path(staging, "model_fused.onnx")
            optimized.save_model_to_file(str(graph))
        os.replace(graph, path)  # atomic: a reader sees the whole graph or none
    return path
