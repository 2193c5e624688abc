"""What an engine is fed and what it answers: the request read in numpy, padded rows grouped by length, the
engine's arrays as the module's own output class, and the check at attach that they are PyTorch's answer. `serve`
takes a call through those steps in order, each once, for every engine.

Padded batches keep the padding-free idea: a batch whose padding is at the end of each row is split into groups of
rows of similar length (rows sorted by length, grouped by a small dynamic programme that weighs a call's fixed cost
against the padding it would compute), and each group runs trimmed to its own longest row. Outputs at padding
positions are zeros, as on PyTorch's packed path. A batch with padding elsewhere (left padding, holes) runs whole,
with its mask, as PyTorch's padded path does.
"""

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

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


class Rules(NamedTuple):
    """What a request is read against and answered in, read off the module's config (`Rules.of`) once per check of
    the model: each engine reads it again whenever its watch sees the config change (hf_vanilla/runtimes/watch.py),
    so a call reads no config field (each is a few Python calls: ours and transformers' `__getattribute__`)."""

    vocab_size: int
    type_vocab_size: int
    positions: int  # the longest row the position table numbers
    output_attentions: bool
    output_hidden_states: bool
    return_dict: bool
    pooled: bool  # a BERT-style body, whose output class has the pooled output; else an encoder stack

    @classmethod
    def of(cls, config) -> "Rules":
        return cls(config.vocab_size, config.type_vocab_size, config.max_position_embeddings - config.position_offset,
                   bool(config.output_attentions), bool(config.output_hidden_states), bool(config.return_dict),
                   config.model_type == "vanilla_encoder")


def serve(rules: Rules, arguments: dict, token_types: bool, decisions, engine, pytorch, partner=None):
    """One call of a module an engine stands in front of, from its arguments (by name) to its output: the request
    read (`request_feeds`, against the module's `rules`), the path chosen (`choice.route`, and timed by
    `choice.timed` while `decisions` measures its size), the engine's arrays for it (rows grouped by length,
    `run_grouped`, unless the request has no padding) as the module's own output (`module_output`), or PyTorch's.
    What the engine says:

        pytorch()               the module's own answer (PyTorch), for every call the engine cannot or should not run
        engine(feeds, dense)    (run, output names, dtype): `run(feeds) -> [arrays]` its call, `dense` for a request
                                without padding of a size decided for the engine (its fastest call)
        partner                 (tokens, call): requests of at least `tokens` real tokens answered by `call()`, the
                                engine's partner (`OwnedEncoder.pair`); None: no partner
    """
    feeds = request_feeds(rules, arguments, token_types)
    if feeds is None:
        return pytorch()
    path, measuring = choice.route(decisions, feeds["attention_mask"], None if partner is None else partner[0])
    if path == "partner":
        return partner[1]()

    def answer():
        run, names, dtype = engine(feeds, path == "dense")
        outputs = run(feeds) if path == "dense" else run_grouped(run, feeds)
        return module_output(rules, dict(zip(names, outputs)), arguments.get("return_dict"), dtype)

    call = pytorch if path == "pytorch" else answer
    return call() if measuring is None else choice.timed(decisions, measuring, path, call)


def request_feeds(rules: Rules, arguments: dict, token_types: bool) -> dict | None:
    """The graph's inputs for a call of an encoder with `arguments` (its arguments by name), or None where PyTorch
    must answer it: the graph computes `input_ids` (not `inputs_embeds`) at default positions, one sequence a row
    (not transformers' packed format), no padding position's state asked for (a loss that reads them), no cache, no
    cross-attention, no attention maps or hidden states asked for (argument, else the config's `rules`), not while
    tracing, and input `feeds_for` plainly accepts. `token_types`: whether the graph reads segment ids (zeros where
    the call gives none; a call giving them to a graph that reads none goes to PyTorch). The one request check of
    every engine."""
    kwargs = arguments.get("kwargs")  # what a forward takes through **kwargs, when bound
    get = (arguments | kwargs).get if kwargs else arguments.get
    input_ids, token_type_ids = get("input_ids"), get("token_type_ids")
    if (
        input_ids is None or (token_type_ids is not None and not token_types)
        # A call naming only what the engine reads (a user's model(**batch)) asks nothing more of its own.
        or (rules.output_attentions or rules.output_hidden_states if arguments.keys() <= _READ else
            _asks_more(get, rules))
        or is_tracing()
    ):
        return None
    feeds = feeds_for(rules, input_ids, get("attention_mask"), token_type_ids)
    if feeds is not None and token_types and "token_type_ids" not in feeds:
        feeds["token_type_ids"] = _no_segments(feeds["input_ids"].shape)
    return feeds


_READ = frozenset({"input_ids", "attention_mask", "token_type_ids", "return_dict"})  # what the engine reads of a call


def _asks_more(get, rules: Rules) -> bool:
    """Whether a call's arguments (`get`, by name) ask what only PyTorch answers (`request_feeds`)."""
    output_attentions, output_hidden_states = get("output_attentions"), get("output_hidden_states")
    return (
        get("inputs_embeds") is not None or get("position_ids") is not None
        or any(get(name) is not None for name in FORMAT_KEYWORDS) or get("outputs_at_padding")
        or get("past_key_values") is not None or get("encoder_hidden_states") is not None
        or (rules.output_attentions if output_attentions is None else output_attentions)
        or (rules.output_hidden_states if output_hidden_states is None else output_hidden_states)
    )


_SEGMENTS: dict = {}  # (B, T) -> zeros, read-only: the segment ids of a call that gives none, made once per shape


def _no_segments(shape: tuple) -> np.ndarray:
    zeros = _SEGMENTS.get(shape)
    if zeros is None:
        if len(_SEGMENTS) >= 64:  # a few shapes come back; any number may come once
            _SEGMENTS.clear()
        zeros = _SEGMENTS[shape] = np.zeros(shape, np.int64)
        zeros.flags.writeable = False  # shared by every call of its shape: no engine writes its inputs
    return zeros


def feeds_for(rules: Rules, input_ids, attention_mask, token_type_ids) -> dict | None:
    """The graph's inputs as C-ordered int64 numpy arrays, or None unless every check PyTorch's path makes of an
    encoder's input (hf_vanilla/validation.py) plainly passes: 2-D int64/int32 ids in the vocabulary, no longer than
    the position table; a 2-D mask of their shape holding only 1 and 0 (bool, integer or float); int64/int32 segment
    ids of their shape (or one row) in range; each a tensor numpy reads in place (in CPU memory, not requiring grad).
    A subset of what PyTorch accepts, never more: what this refuses, PyTorch runs or refuses with its own message.
    Read in numpy from the start: each torch attribute read is a call into torch, and after an idle moment each
    costs the call as much as numpy's whole look."""
    ids = _array(input_ids)
    if ids is None or ids.dtype not in _ID_DTYPES or ids.ndim != 2:
        return None
    ids = np.ascontiguousarray(ids, dtype=np.int64)  # ONNX Runtime reads C-ordered int64
    B, T = ids.shape
    # Read as unsigned, a negative id is past any vocabulary: one pass over the ids checks both ends.
    if B == 0 or T == 0 or T > rules.positions or ids.view(np.uint64).max() >= rules.vocab_size:
        return None
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = _array(attention_mask)
        if mask is None or mask.shape != (B, T) or mask.dtype not in _MASK_DTYPES:
            return None
        if mask.dtype.kind in "iu":  # read as unsigned, a negative entry is past 1 too: one pass
            if mask.view(_UNSIGNED[mask.itemsize]).max() > 1:
                return None
        elif mask.dtype != np.bool_ and not ((mask == 0) | (mask == 1)).all():
            return None
        mask = np.ascontiguousarray(mask, dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    if token_type_ids is not None:
        types = _array(token_type_ids)
        if types is None or types.dtype not in _ID_DTYPES or types.ndim not in (1, 2) or types.shape[-1] != T \
                or (types.ndim == 2 and types.shape[0] not in (B, 1)):
            return None
        types = np.ascontiguousarray(np.broadcast_to(types, (B, T)), dtype=np.int64)
        if types.view(np.uint64).max() >= rules.type_vocab_size:
            return None
        feeds["token_type_ids"] = types
    return feeds


def _array(tensor) -> np.ndarray | None:
    """`tensor`'s memory as a numpy array, or None where numpy cannot read it in place: not a tensor, on another
    device, requiring grad, in a dtype numpy lacks (bfloat16)."""
    try:
        return tensor.numpy()
    except (AttributeError, TypeError, RuntimeError):
        return None


_ID_DTYPES = frozenset(map(np.dtype, (np.int64, np.int32)))
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # an integer mask's items, by size, as unsigned
_MASK_DTYPES = frozenset(map(np.dtype, (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16,
                                        np.float32, np.float64)))


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


def module_output(rules: Rules, outputs: dict, return_dict: bool | None, dtype: torch.dtype = torch.float32):
    """`outputs` (output name -> float32 array) as the module of `rules` itself returns them, in `dtype`: a
    BERT-style body's pooled output class (or its tuple, as `return_dict` or the config says), an encoder stack's
    hidden-state class. The arrays' memory, not a copy, at float32."""
    outputs = {name: torch.from_numpy(array) for name, array in outputs.items()}
    if dtype != torch.float32:
        outputs = {name: tensor.to(dtype) for name, tensor in outputs.items()}
    if not rules.pooled:
        return made(BaseModelOutputWithPastAndCrossAttentions, outputs)
    output = made(BaseModelOutputWithPoolingAndCrossAttentions, outputs)
    return output if (rules.return_dict if return_dict is None else return_dict) else output.to_tuple()


_FIELDS: dict = {}  # output class -> its fields' names where `made` makes what its constructor makes, else None


def made(cls, values: dict):
    """`cls(**values)` for a transformers output class (a dataclass over an OrderedDict), made as its constructor
    leaves it (every field an attribute, those not None also items, in field order) without what the constructor
    runs on the way: a `dataclasses.fields()` at each attribute it sets, and its checks of the first field, which
    were the largest part of what our code added to an engine's call on a short request. Checked against the
    constructor at a class's first use: a class it does not reproduce (another transformers) is made by its
    constructor."""
    names = _FIELDS.get(cls)
    if names is not None:
        return _made(cls, names, values)
    output = cls(**values)
    if cls not in _FIELDS:
        names = tuple(field.name for field in dataclasses.fields(cls))
        _FIELDS[cls] = names if _same(output, _made(cls, names, values)) else None
    return output


def _made(cls, names: tuple, values: dict):
    output = cls.__new__(cls)
    state = vars(output)
    for name in names:
        value = state[name] = values.get(name)
        if value is not None:
            OrderedDict.__setitem__(output, name, value)
    return output


def _same(one, other) -> bool:
    """Whether two output objects hold the same objects, as attributes and as items, in the same order."""
    def held(output):
        return type(output), [(k, id(v)) for k, v in vars(output).items()], [(k, id(v)) for k, v in output.items()]
    return held(one) == held(other)


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
