"""Padding-free execution: sequences laid end to end, attention within each.

A padded batch of natural text is often two-thirds padding. Everything in a transformer layer but attention works
on each position alone (embeddings, the Q/K/V/O projections, the feed-forward, LayerNorm), so it can run on the N
real tokens of the batch laid end to end as one (N, E) tensor, and skip the padding entirely. Attention mixes
positions, so it runs within each sequence: neighbouring sequences of equal length are one (count, H, L, D) view of
the packed tensor, without a copy, and share one kernel call (the sequences are laid end to end shortest first where
that makes more of them neighbours), so a mostly full batch, or many sentences of a few lengths, costs a few calls
rather than one per sequence. On a CUDA GPU in half precision, where each call waits on Python, the whole batch is
one flash-attention call instead (`one_kernel_call`). The result is scattered back to (B, T, E) once, at the end.

A stack decides all this once per batch, in a `BatchPlan` (which sequence each token belongs to, its positions, the
padding-free layout and with it the real tokens' index), which every step after reads: the embeddings and layers,
the padded path's masks, and the heads, to which the body's output carries it.

Two inputs arrive this way:
- a padded batch: a 2-D `attention_mask` whose every row starts with a real token (right padding, as BERT-family
  tokenizers pad); each row's real tokens are one sequence;
- transformers' padding-free format (`DataCollatorWithFlattening`): sequences end to end in one row, no
  attention_mask, told apart by `position_ids` starting again (at 0, or at the collator's `position_ids_start`), or
  by the flash-attention keywords `cu_seq_lens_q/k` (cumulative lengths over the flattened tokens) or `seq_idx`
  (the sequence of each token). position_ids that are not in that layout are positions, never boundaries.
  transformers' sdpa and eager models honour that format only in causal masks; an encoder run there attends across
  sequences. Here every family honours it, in every attention implementation, and a combination that cannot be
  told apart (an attention_mask beside explicit boundaries, boundaries that disagree) is refused.

What it guarantees: at every real token the output equals the padded computation's up to float32 rounding (the
same sums over the same keys, in another kernel); padding positions come back as zeros. A causal stack attends to
the past of its own sequence; cross-attention reads the source sequence of the same index (the same row of a padded
batch, or the i-th source of a packed one). It is used only where nothing else can differ: no key/value cache, no
attention maps asked for, no loss that reads padding positions, and not while tracing or exporting (shapes here
depend on the mask's values). There, the packed format still holds through a mask (masks.self_attention_mask's
`sequences`): quadratic in the row, but never across sequences.

A loss reads padding positions where extractive QA's softmax runs over every position, or where a label other than
-100 sits at padding. The padded computation (and transformers) computes those positions from the padding tokens,
each attending to its row's real tokens; computing them here would cost what the padded path costs (every layer's
feed-forward at every position), so such a batch takes the padded path (`can_pack`'s `outputs_at_padding`).
"""

import itertools
from dataclasses import dataclass

import torch

from .compat import varlen_attention
from .kernels import is_tracing
from .masks import sequence_causal_mask

# The keywords of transformers' padding-free format besides `position_ids` (FlashAttentionKwargs and `seq_idx`).
FORMAT_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def packed_format(kwargs):
    """transformers' packed-format keywords among a forward's `kwargs` (FORMAT_KEYWORDS), for the body."""
    return {name: kwargs[name] for name in FORMAT_KEYWORDS if name in kwargs}


def plan_of(body_output):
    """The plan (BatchPlan) a body's output carries: how its stack ran the batch, where it ran in PyTorch
    outside tracing; None elsewhere (an engine's output, a traced graph's), where every position was computed."""
    return getattr(body_output, "plan", None)


def sequence_ids(shape, position_ids, attention_mask=None, packed_format=None):
    """Which sequence each token belongs to, (B, T) (equal ids in a row: one sequence), for transformers'
    padding-free format; None for an ordinary batch (one sequence per row).

    The boundaries are read from, in this order, `cu_seq_lens_q/k` (cumulative lengths over the B*T flattened
    tokens), `seq_idx` (B, T), and `position_ids` (B, T) in the collator's layout (`_restarts`: counting up by one
    and starting again from the row's first position), only without an attention_mask, as transformers reads them.
    Where several are given they must agree. E.g. position_ids [[0, 1, 2, 0, 1]] -> [[0, 0, 0, 1, 1]], while
    [[0, 2, 4, 6]] or [[0, 0, 1, 1]] are positions of one sequence. While tracing the boundaries come from
    position_ids alone and are always a tensor (a graph must not branch on values)."""
    packed_format = {k: v for k, v in (packed_format or {}).items() if k in FORMAT_KEYWORDS and v is not None}
    explicit = {k: packed_format[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx") if k in packed_format}
    if explicit and attention_mask is not None:
        raise ValueError(
            f"Got both attention_mask and {', '.join(explicit)}: a padded batch or transformers' padding-free format "
            "(DataCollatorWithFlattening), not both. Drop attention_mask for packed sequences, or the packed "
            "keywords for a padded batch."
        )
    if position_ids is None and not explicit:
        return None
    if position_ids is not None:
        position_ids = position_ids.expand(shape)
    if is_tracing():
        if position_ids is None:  # boundaries read from values alone cannot be traced
            raise ValueError(f"While tracing or exporting, packed sequences are told apart by position_ids (restarting "
                             f"at each sequence), not by {', '.join(explicit)}: pass position_ids.")
        return None if attention_mask is not None else _restarts(position_ids)
    candidates = []  # (name, ids (B, T))
    cu_q, cu_k = packed_format.get("cu_seq_lens_q"), packed_format.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is not None and cu_k is not None and not torch.equal(cu_q.cpu(), cu_k.cpu()):
            raise ValueError(
                "cu_seq_lens_q and cu_seq_lens_k differ: in self-attention a sequence's queries are its keys. (An "
                "encoder-decoder takes its source and target boundaries from position_ids and decoder_position_ids.)"
            )
        cu = (cu_q if cu_q is not None else cu_k).flatten().long()
        candidates.append(("cu_seq_lens", _from_cumulative(cu, shape)))
    if "seq_idx" in explicit:
        candidates.append(("seq_idx", _from_seq_idx(explicit["seq_idx"], shape)))
    if position_ids is not None and attention_mask is None:
        candidates.append(("position_ids", _restarts(position_ids)))
    if not candidates:
        return None
    (name, ids), *others = candidates
    for other, other_ids in others:
        if other_ids.shape != ids.shape or not torch.equal(_starts(other_ids), _starts(ids)):
            raise ValueError(f"{name} and {other} mark different sequence boundaries: pass one of them, or both "
                             "from the same DataCollatorWithFlattening batch.")
    return ids if bool(ids[:, -1].any()) or len(candidates) > 1 or name != "position_ids" else None


def batch_sequences(shape, position_ids, attention_mask, packed_format, past_length, encoder_hidden_states=None,
                    encoder_position_ids=None, encoder_attention_mask=None):
    """Which sequence each token belongs to in transformers' packed format (`sequence_ids`): the target's (B, T) and,
    for cross-attention, the source's (B, S); None for an ordinary batch, and while decoding with a cache (the
    prompt's sequences are in the cache already). A packed target reads a packed source, sequence i from sequence i."""
    if not (isinstance(past_length, int) and past_length == 0):
        return None, None
    sequences = sequence_ids(shape, position_ids, attention_mask, packed_format)
    if encoder_hidden_states is None:
        return sequences, None
    encoder_sequences = sequence_ids(encoder_hidden_states.shape[:2], encoder_position_ids, encoder_attention_mask)
    if (sequences is None) != (encoder_sequences is None):
        raise ValueError(
            "Packed sequences on one side only: a packed target (decoder_position_ids restarting) reads a packed "
            "source (position_ids restarting), target i from source i. Pack both, or neither."
        )
    return sequences, encoder_sequences


def positions_within(sequences):
    """Each token's position counted from the start of its sequence, (B, T): the positions of packed sequences
    given by cu_seq_lens or seq_idx alone."""
    starts = _starts(sequences)  # (B, T) bool
    index = torch.arange(sequences.shape[-1], device=sequences.device).expand_as(sequences)
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values  # (B, T)
    return index - start_index


def _starts(ids):
    """(B, T) bool: where a new sequence starts (every row starts one)."""
    return torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), ids[:, 1:] != ids[:, :-1]], dim=-1)


def _restarts(position_ids):
    """(B, T) sequence ids of the rows in DataCollatorWithFlattening's layout, zeros for the other rows.

    A row is in that layout where each position is its predecessor's plus one or starts again from the row's first
    position (0, or the collator's `position_ids_start`: 2 for RoBERTa's table), as flash attention reads packed
    positions (`prepare_fa_kwargs_from_position_ids`). Any other step ([0, 0, 1, 1], [0, 2, 4, 6], [0, 1, 2, 3, 3])
    makes the row's position_ids plain positions of one sequence, as BertModel reads them: explicit positions are
    boundaries only in the packed layout."""
    start = position_ids[:, :1]  # (B, 1): where every sequence of the row starts
    follows = position_ids[:, 1:] == position_ids[:, :-1] + 1  # (B, T - 1)
    restarts = ~follows & (position_ids[:, 1:] == start)  # (B, T - 1): a new sequence starts here
    packed = (follows | restarts).all(-1, keepdim=True)  # (B, 1): no other step in the row
    ids = torch.cat([torch.zeros_like(start), restarts.long().cumsum(-1)], dim=-1)  # (B, T)
    return ids * packed


def _from_cumulative(cu, shape):
    total = shape[0] * shape[1]
    if cu.dim() != 1 or len(cu) < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seq_lens must run from 0 up to the {total} tokens of the batch {tuple(shape)}, never decreasing "
            f"(as DataCollatorWithFlattening(return_flash_attn_kwargs=True) builds them), got {cu.tolist()}."
        )
    tokens = torch.arange(total, device=cu.device)
    return (torch.searchsorted(cu, tokens, right=True) - 1).view(shape)  # (B, T)


def _from_seq_idx(seq_idx, shape):
    if tuple(seq_idx.shape) != tuple(shape) or bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        raise ValueError(f"seq_idx must be {tuple(shape)}, one id per token, never decreasing along a row (each "
                         f"sequence's tokens together), got shape {tuple(seq_idx.shape)}.")
    return seq_idx.long()


def can_pack(attention_mask, sequences, output_attentions: bool, cached: bool,
             outputs_at_padding: bool = False) -> bool:
    """Whether a stack's batch runs padding-free (see the module docstring for the conditions). `outputs_at_padding`:
    the caller reads the padding positions' outputs (a loss that scores them), which the padded path computes and
    the padding-free one leaves at zero."""
    if output_attentions or cached or outputs_at_padding or is_tracing():
        return False
    if sequences is not None:
        return attention_mask is None
    return (
        attention_mask is not None
        and attention_mask.dim() == 2
        and not attention_mask.all()
        # Every row starts with a real token: right padding, as BERT-family tokenizers pad. Position 0 is what the
        # pooled heads read ([CLS]); on a left-padded row it is padding, which the padded path computes (as
        # transformers' BERT does) and the packed path would leave at zero, so that rows read the same whichever
        # path runs, a batch with a row that starts with padding (or is all padding) is not packed.
        and bool(attention_mask[:, 0].all())
    )


def can_pack_source(encoder_attention_mask) -> bool:
    """Whether cross-attention can read the source packed: every row has a key (an all-padding row is computed
    over every key on the padded path, see masks.additive_mask)."""
    return encoder_attention_mask is None or (encoder_attention_mask.dim() == 2
                                              and bool(encoder_attention_mask.any(-1).all()))


class PackedBatch:
    """Where the tokens of each sequence sit in a (B, T) batch: `pack` gathers them end to end, `unpack` scatters
    results back. `keep` (B, T) marks the real tokens (all of them when None); `sequences` (B, T) splits a row into
    several sequences (transformers' packed format; one per row when None). Without either, every token of the
    batch (on `device`) is real, a sequence a row."""

    def __init__(self, shape, keep=None, sequences=None, device=None):
        self.batch_size, self.length = shape  # B, T
        if keep is None and sequences is None:
            keep = torch.ones(shape, dtype=torch.bool, device=device)
        keep = None if keep is None else keep.bool()  # a float or integer mask marks real tokens by nonzero values
        if sequences is None and keep is not None:
            self.indices = keep.flatten().nonzero().squeeze(1)  # (N,): real tokens in the flattened batch
            self.seq_lens = keep.sum(1).tolist()  # rows are sequences; `can_pack` packs no row without a token
        else:
            group = torch.arange(self.batch_size, device=sequences.device)[:, None] * sequences.numel() + sequences
            group = group.flatten()  # (B * T,): one id per sequence, non-decreasing
            self.indices = torch.arange(group.numel(), device=group.device)
            if keep is not None:
                self.indices = self.indices[keep.flatten()]
                group = group[self.indices]
            self.seq_lens = torch.unique_consecutive(group, return_counts=True)[1].tolist()

    def shortest_first(self, key_lens=None):
        """The order (a list) that lays sequences of equal length next to each other (and of equal `key_lens`, the
        source lengths cross-attention pairs them with), or None where they are neighbours already."""
        keys = list(zip(self.seq_lens, key_lens or self.seq_lens))
        if len(set(keys)) == sum(1 for _ in itertools.groupby(keys)):
            return None
        # The 32 sentences of benchmarks/engines.py: 20 calls a layer, not 32. Only where that merges calls: the
        # reordering has a cost of its own every forward.
        return sorted(range(len(keys)), key=keys.__getitem__)

    def reorder(self, order):
        """Lay the sequences end to end in `order` (a list of sequence numbers)."""
        if order is None:
            return self
        if len(order) != len(self.seq_lens):
            raise ValueError(f"{len(self.seq_lens)} source sequences for {len(order)} target sequences: each target "
                             "sequence reads the source of the same index.")
        lengths = torch.tensor(self.seq_lens, device=self.indices.device)
        starts = lengths.cumsum(0) - lengths  # (count,): where each sequence starts among the packed tokens
        order_t = torch.tensor(order, device=self.indices.device)
        new_lengths = lengths[order_t]
        new_starts = new_lengths.cumsum(0) - new_lengths
        shift = torch.repeat_interleave(starts[order_t] - new_starts, new_lengths)  # (N,)
        self.indices = self.indices[torch.arange(len(shift), device=shift.device) + shift]
        self.seq_lens = new_lengths.tolist()
        return self

    def pack(self, x):
        """(B, T, ...) -> (N, ...); None stays None."""
        return None if x is None else x.reshape(self.batch_size * self.length, *x.shape[2:])[self.indices]

    def unpack(self, x):
        """(N, E) -> (B, T, E), zeros at padding."""
        rows = x.new_zeros(self.batch_size * self.length, x.shape[-1]).index_copy_(0, self.indices, x)
        return rows.view(self.batch_size, self.length, -1)


def neighbours(packed, source=None):
    """`packed` and cross-attention's `source` (PackedBatch, or None) laid out so that sequences of equal lengths
    (and of equal source lengths) are neighbours, target sequence i beside source sequence i."""
    if source is not None and len(source.seq_lens) != len(packed.seq_lens):
        raise ValueError(f"{len(packed.seq_lens)} target sequences for {len(source.seq_lens)} source sequences: "
                         "each target sequence reads the source sequence of the same index.")
    order = packed.shortest_first(source.seq_lens if source is not None else None)
    return packed.reorder(order), source.reorder(order) if source is not None else None


@dataclass
class BatchPlan:
    """How a stack runs one batch, decided once before its embeddings (`VanillaStack._plan`) and read by every step
    after it: the embeddings and the layers, the masks of the padded path, and the heads (a body's output carries it
    as `plan`, outside tracing).

    shape ............. (B, T)
    positions ......... (B, T): each token's row in the position table
    sequences ......... (B, T): which sequence each token belongs to in transformers' packed format
                        (`sequence_ids`); None where each row is one sequence
    encoder_sequences . (B, S): the same for the source cross-attention reads
    packed ............ the padding-free layout (`PackedBatch`: the real tokens' index, each sequence's length), or
                        None where the padded path runs, with the masks masks.py builds from this plan
    source ............ the source's padding-free layout, sequence i beside the target's sequence i
    """

    shape: tuple[int, int]
    positions: torch.Tensor
    sequences: torch.Tensor | None = None
    encoder_sequences: torch.Tensor | None = None
    packed: PackedBatch | None = None
    source: PackedBatch | None = None

    @property
    def seq_lens(self) -> list[int] | None:
        return None if self.packed is None else self.packed.seq_lens

    @property
    def source_seq_lens(self) -> list[int] | None:
        return None if self.source is None else self.source.seq_lens

    def pack(self, x):
        """(B, T, ...) -> (N, ...) on the padding-free path; as given on the padded one (None stays None)."""
        return x if self.packed is None else self.packed.pack(x)

    def pack_source(self, encoder_hidden_states):
        """(B, S, E) -> (M, E): the source's real tokens, in the target's order of sequences (or as given)."""
        return encoder_hidden_states if self.source is None else self.source.pack(encoder_hidden_states)

    def unpack(self, x):
        """(N, E) -> (B, T, E), zeros at padding, on the padding-free path; as given on the padded one."""
        return x if self.packed is None else self.packed.unpack(x)

    def real_tokens(self):
        """(N,): the flattened (B * T) index of the real tokens, in order, where the padding-free path left the
        padding positions' states at zero; None where every position was computed (the padded path, or no padding)."""
        if self.packed is None or len(self.packed.indices) == self.shape[0] * self.shape[1]:
            return None
        return self.packed.indices.sort().values

    def refuse_packed_rows(self, reader: str):
        """Refuse transformers' packed format for `reader`, a head that reads one state per row ([CLS])."""
        if self.sequences is not None:
            raise ValueError(
                f"{reader} reads one [CLS] state per row, and these inputs pack several sequences in a row "
                "(transformers' DataCollatorWithFlattening: position_ids restarting, cu_seq_lens or seq_idx). Pass a "
                "padded batch (DataCollatorWithPadding): it runs padding-free here already."
            )

    def first_states(self, hidden_states):
        """Each sequence's first-token ([CLS]) state, what a pooled head reads: (B, E) a row each, or (count, E)
        for transformers' packed format."""
        if self.sequences is None:
            return hidden_states[:, 0]
        return hidden_states.flatten(0, 1)[_starts(self.sequences).flatten().nonzero().squeeze(1)]


def plan_batch(*, tokens, position_ids, attention_mask, packed_format, past_length, cached, output_attentions,
               outputs_at_padding, encoder_hidden_states, encoder_attention_mask, encoder_position_ids,
               positions) -> BatchPlan:
    """A stack's batch plan, made once per forward: each token's sequence and position, and where the padding-free
    path runs (`can_pack`), where the tokens of each sequence (and of its source) sit. `positions(position_ids,
    sequences, past_length, shape=, device=)` is the stack's rule for each token's row in its position table."""
    shape = tuple(tokens.shape[:2])
    sequences, encoder_sequences = batch_sequences(
        shape, position_ids, attention_mask, packed_format=packed_format, past_length=past_length,
        encoder_hidden_states=encoder_hidden_states, encoder_position_ids=encoder_position_ids,
        encoder_attention_mask=encoder_attention_mask)
    plan = BatchPlan(shape, positions(position_ids, sequences, past_length, shape=shape, device=tokens.device),
                     sequences, encoder_sequences)
    if not (can_pack(attention_mask, sequences, output_attentions, cached=cached, outputs_at_padding=outputs_at_padding)
            and (encoder_hidden_states is None or can_pack_source(encoder_attention_mask))):
        return plan
    packed = PackedBatch(shape, attention_mask if sequences is None else None, sequences)
    source = None if encoder_hidden_states is None else PackedBatch(  # no mask: every source token is a key
        encoder_hidden_states.shape[:2], encoder_attention_mask, encoder_sequences, encoder_hidden_states.device)
    plan.packed, plan.source = neighbours(packed, source)
    return plan


def attend_within_sequences(attention_fn, module, query, key, value, seq_lens, key_lens, causal, dropout, scaling):
    """Attention for sequences laid end to end: query (N, H, D), key, value (M, H, D) -> context (N, H*D).

    Query sequence i attends to key sequence i (`key_lens`: the same as `seq_lens` in self-attention), to its past
    alone when `causal`. Each run of neighbours of equal lengths is one (count, H, L, D) batch; 4-D inputs keep sdpa
    on its fused CPU kernels (3-D ones fall back to plain math)."""
    N, H, D = query.shape
    if one_kernel_call(module, query, seq_lens, dropout):
        context = attention_in_one_call(query, key, value, seq_lens=seq_lens, key_lens=key_lens, causal=causal,
                                        scaling=scaling)
        if context is not None:
            return context.reshape(N, H * D)  # (N, H, D) -> (N, E)
    contexts, start, key_start = [], 0, 0
    for (length, key_length), run in itertools.groupby(zip(seq_lens, key_lens)):
        count = len(list(run))
        end, key_end = start + count * length, key_start + count * key_length
        q = query[start:end].view(count, length, H, D).transpose(1, 2)  # (c, H, L, D)
        k, v = (x[key_start:key_end].view(count, key_length, H, D).transpose(1, 2) for x in (key, value))
        mask = sequence_causal_mask(length, q.dtype, q.device, module.config._attn_implementation) if causal else None
        context, _ = attention_fn(module, q, k, v, mask, dropout=dropout, scaling=scaling)  # (count, L, H, D)
        contexts.append(context.reshape(end - start, H * D))  # (count * L, E): Concat(head_1..head_H)
        start, key_start = end, key_end
    return contexts[0] if len(contexts) == 1 else torch.cat(contexts)  # (N, E)


def one_kernel_call(module, query, seq_lens, dropout) -> bool:
    """Whether attention over sequences of several lengths runs as one flash-attention call over the packed tokens
    (`attention_in_one_call`) rather than one call per run of equal lengths: on a CUDA GPU of compute capability 8 or
    more, in bfloat16 or float16, under sdpa (whose fastest CUDA kernel flash attention is), without attention
    dropout, at a head size flash attention takes. A GPU waits for each call's Python and launch: on bert-base in bf16,
    64 rows of 52 lengths made 624 calls a forward, several times slower than transformers' padded forward, where the
    same tokens at one length were faster than it. The CPU keeps the calls per length: its
    kernels take the 4-D batches (`attend_within_sequences`)."""
    D = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and len(set(seq_lens)) > 1
            and module.config._attn_implementation == "sdpa" and not dropout and D % 8 == 0 and D <= 256
            and torch.cuda.get_device_capability(query.device) >= (8, 0))


def attention_in_one_call(query, key, value, *, seq_lens, key_lens, causal, scaling):
    """Attention of every packed sequence in one call: query (N, H, D), key, value (M, H, D) -> (N, H, D), or None
    where the installed torch has no varlen attention (compat.varlen_attention)."""
    def cumulative(lengths):  # (count + 1,): where each sequence starts, then the total
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=query.device)

    return varlen_attention(query, key, value, cu_seq_q=cumulative(seq_lens), cu_seq_k=cumulative(key_lens),
                            max_q=max(seq_lens), max_k=max(key_lens), causal=causal, scale=scaling)


__all__ = ["FORMAT_KEYWORDS", "BatchPlan", "PackedBatch", "attend_within_sequences", "batch_sequences", "can_pack",
           "can_pack_source", "neighbours", "positions_within", "sequence_ids"]
