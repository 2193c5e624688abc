"""What an engine is fed and what it answers: the request read in numpy, padded rows grouped by length, the
engine's arrays as the module's own output class, and the check at attach that they are PyTorch's answer. `serve`
takes a call through those steps in order, each once, for every engine.

Padded batches keep the padding-free idea: a batch whose padding is at the end of each row is split into groups of
rows of similar length (rows sorted by length, grouped by a small dynamic programme that weighs a call's fixed cost
against the padding it would compute), and each group runs trimmed to its own longest row. Outputs at padding
positions are zeros, as on PyTorch's packed path. A batch with padding elsewhere (left padding, holes) runs whole,
with its mask, as PyTorch's padded path does.
"""

import numpy as np
import torch
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPoolingAndCrossAttentions,
)

from ..export import example_inputs
from ..kernels import is_tracing
from ..packing import FORMAT_KEYWORDS
from . import choice

# The check at attach: a right-padded (2, PROBE_TOKENS) request, both ways, within PROBE_TOLERANCE x max(1, |output|).
# It tells this model's graph from another's (one of other weights or another model is off by 1e-2 and more), with
# room for any CPU's summation order: ten times the parity rule (conversion/parity.py), which the tests hold the
# engines' answers to.
PROBE_TOKENS, PROBE_TOLERANCE = 16, 1e-4
# A call's fixed cost in tokens' worth of work: what grouping two rows must save in padding to pay for a second call.
CALL_COST_TOKENS = 32


def serve(config, arguments: dict, token_types: bool, decisions, engine, pytorch, prepare=None, partner=None):
    """One call of a module an engine stands in front of, from its arguments (by name) to its output: the request
    read (`request_feeds`), the path chosen (`choice.route`, and timed by `choice.timed` while `decisions` measures
    its size), the engine's arrays for it (rows grouped by length, `run_grouped`, unless the request has no padding)
    as the module's own output (`module_output`), or PyTorch's. What the engine says:

        pytorch()               the module's own answer (PyTorch), for every call the engine cannot or should not run
        prepare(feeds)          what its call needs beside the checked request, or None where PyTorch must answer
                                (default: the feeds themselves)
        engine(request, dense)  (run, output names, dtype): `run(feeds) -> [arrays]` its call, `dense` for a request
                                without padding of a size decided for the engine (its fastest call)
        partner                 (tokens, call): requests of at least `tokens` real tokens answered by `call()`, the
                                engine's partner (`OwnedEncoder.pair`); None: no partner
    """
    feeds = request_feeds(config, arguments, token_types)
    request = None if feeds is None else feeds if prepare is None else prepare(feeds)
    if request is None:
        return pytorch()
    path, measuring = choice.route(decisions, feeds["attention_mask"], None if partner is None else partner[0])
    if path == "partner":
        return partner[1]()

    def answer():
        run, names, dtype = engine(request, path == "dense")
        outputs = run(feeds) if path == "dense" else run_grouped(run, feeds)
        return module_output(config, dict(zip(names, outputs)), arguments.get("return_dict"), dtype)

    call = pytorch if path == "pytorch" else answer
    return call() if measuring is None else choice.timed(decisions, measuring, path, call)


def request_feeds(config, arguments: dict, token_types: bool) -> dict | None:
    """The graph's inputs for a call of an encoder with `arguments` (its arguments by name), or None where PyTorch
    must answer it: the graph computes `input_ids` (not `inputs_embeds`) at default positions, one sequence a row
    (not transformers' packed format), no padding position's state asked for (a loss that reads them), no cache, no
    cross-attention, no attention maps or hidden states asked for (argument, else `config`), not while tracing,
    and input `feeds_for` plainly accepts. `token_types`: whether the graph reads segment ids (zeros where the call
    gives none; a call giving them to a graph that reads none goes to PyTorch). The one request check of every
    engine."""
    get = (arguments | (arguments.get("kwargs") or {})).get  # what a forward takes through **kwargs, when bound
    input_ids, token_type_ids = get("input_ids"), get("token_type_ids")
    if (
        input_ids is None or get("inputs_embeds") is not None or get("position_ids") is not None
        or any(get(name) is not None for name in FORMAT_KEYWORDS) or get("outputs_at_padding")
        or get("past_key_values") is not None or get("encoder_hidden_states") is not None
        or (config.output_attentions if get("output_attentions") is None else get("output_attentions"))
        or (config.output_hidden_states if get("output_hidden_states") is None else get("output_hidden_states"))
        or is_tracing() or (token_type_ids is not None and not token_types)
    ):
        return None
    feeds = feeds_for(config, input_ids, get("attention_mask"), token_type_ids)
    if feeds is not None and token_types and "token_type_ids" not in feeds:
        feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
    return feeds


def feeds_for(config, input_ids, attention_mask, token_type_ids) -> dict | None:
    """The graph's inputs as C-ordered int64 numpy arrays, or None unless every check PyTorch's path makes of an
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


def grouping(feeds: dict) -> list[tuple[list[int], int]] | None:
    """How a request runs: None for one call of the whole batch (no end-padding to trim, a row of padding only, or
    padding not at the ends), else its groups of rows by length (`length_groups`)."""
    mask = feeds["attention_mask"]
    T = mask.shape[1]
    lengths = mask.sum(1)
    if lengths.min() in (0, T) or not (mask == (np.arange(T)[None, :] < lengths[:, None])).all():
        return None
    return length_groups(lengths.tolist())


def run_grouped(run, feeds: dict) -> list[np.ndarray]:
    """The graph's outputs, (B, T, E) hidden states first, from `run(feeds) -> [outputs]` (the engine's call): one
    call where `grouping` says so, else one per group of rows, scattered back."""
    groups = grouping(feeds)
    if groups is None:
        return run(feeds)
    mask = feeds["attention_mask"]
    B, T = mask.shape
    outputs = None
    for rows, length in groups:
        index = np.asarray(rows)
        group = run({name: value[index, :length] for name, value in feeds.items()})
        if outputs is None:  # hidden states (B, T, E), then per-row outputs (B, ...)
            outputs = [np.zeros((B, T, group[0].shape[-1]), group[0].dtype)]
            outputs += [np.zeros((B, *out.shape[1:]), out.dtype) for out in group[1:]]
        outputs[0][index, :length] = group[0]
        for whole, part in zip(outputs[1:], group[1:]):
            whole[index] = part
    outputs[0][mask == 0] = 0.0
    return outputs


def module_output(config, outputs: dict, return_dict: bool | None, dtype: torch.dtype = torch.float32):
    """`outputs` (output name -> float32 array) as the module of `config` itself returns them, in `dtype`: a
    BERT-style body's pooled output class (or its tuple, as `return_dict` or the config says), an encoder stack's
    hidden-state class."""
    outputs = {name: torch.from_numpy(array) for name, array in outputs.items()}
    if dtype != torch.float32:
        outputs = {name: tensor.to(dtype) for name, tensor in outputs.items()}
    if config.model_type != "vanilla_encoder":
        return BaseModelOutputWithPastAndCrossAttentions(**outputs)
    output = BaseModelOutputWithPoolingAndCrossAttentions(**outputs)
    return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


def probe(config, forward, run, token_types: bool) -> float:
    """max |engine - PyTorch| / max(1, |PyTorch|) over the engine's outputs, at the real tokens of a right-padded
    (2, PROBE_TOKENS) request: `forward` is the module's own (PyTorch), `run(feeds) -> {output name: array}` the
    engine's call, `token_types` whether the graph reads segment ids (fed as zeros)."""
    inputs = example_inputs(config, ["input_ids", "attention_mask"], length=PROBE_TOKENS)
    with torch.inference_mode():
        expected = forward(**inputs, return_dict=True)
    feeds = {name: value.numpy() for name, value in inputs.items()}
    if token_types:
        feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
    real = inputs["attention_mask"].bool().numpy()
    worst = 0.0
    for name, array in run(feeds).items():
        reference = getattr(expected, name).numpy()
        if array.shape != reference.shape:
            return float("inf")
        if name == "last_hidden_state":
            array, reference = array[real], reference[real]
        worst = max(worst, float(np.abs(array - reference).max()) / max(1.0, float(np.abs(reference).max())))
    return worst if worst == worst else float("inf")  # NaN: no answer
