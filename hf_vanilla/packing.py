"""Padding-free execution of a padded batch.

A padded batch of natural text is often two-thirds padding. Everything in a transformer layer but attention works
on each position alone (embeddings, the Q/K/V/O projections, the feed-forward, LayerNorm), so it can run on the N
real tokens of the batch laid end to end as one (N, E) tensor, and skip the padding entirely. Attention mixes
positions, so it runs within each sequence: neighbouring sequences of equal length are one (count, H, L, D) view of
the packed tensor, without a copy, and share one kernel call (the rows are laid end to end shortest first where that
makes more of them neighbours), so a mostly full batch, or many sentences of a few lengths, costs a few calls rather
than one per row. The result is scattered back to (B, T, E) once, at the end.

What it guarantees: at every real token the output equals the padded computation's up to float32 rounding (the
same sums over the same keys, in another kernel); padding positions come back as zeros. It is used only where
nothing else can differ: an encoder (no causal mask, no cache), a 2-D padding mask whose every row starts with a
real token (what the heads read at position 0 is then a real token's state on both paths), no attention maps
asked for, and not while tracing or exporting (shapes here depend on the mask's values).

The other padding-free format (sequences packed end to end in one row, told apart by their positions) is a mask's
matter: masks.sequence_ids.
"""

import itertools

import torch

from .kernels import is_tracing


def can_pack(attention_mask, output_attentions: bool) -> bool:
    """Whether an encoder's batch runs padding-free (see the module docstring for the conditions)."""
    return (
        attention_mask is not None
        and attention_mask.dim() == 2
        and not output_attentions
        and not is_tracing()
        and not attention_mask.all()
        # Every row starts with a real token: right padding, as BERT-family tokenizers pad. Position 0 is what the
        # pooled heads read ([CLS]); on a left-padded row it is padding, which the padded path computes (as
        # transformers' BERT does) and the packed path would leave at zero, so that rows read the same whichever
        # path runs, a batch with a row that starts with padding (or is all padding) is not packed.
        and bool(attention_mask[:, 0].all())
    )


class PackedBatch:
    """Where the real tokens of a padded batch sit: `pack` gathers them, `unpack` scatters results back."""

    def __init__(self, attention_mask):
        self.batch_size, self.length = attention_mask.shape  # B, T
        keep = attention_mask.bool()
        lengths = keep.sum(1).tolist()  # every row has a token: `can_pack` packs no row that starts with padding
        if len(set(lengths)) < sum(1 for _ in itertools.groupby(lengths)):
            # Rows laid end to end shortest first: rows of equal length become neighbours, and each run of
            # neighbours is one attention call (attend_within_sequences). The 32 sentences of benchmarks/engines.py:
            # 20 calls a layer, not 32. Only where that merges calls: the reordering costs ~25 us a forward.
            order = torch.tensor(sorted(range(self.batch_size), key=lengths.__getitem__), device=keep.device)
            rows, columns = keep[order].nonzero().unbind(1)  # real tokens of the sorted rows, in order
            self.indices = order[rows] * self.length + columns  # (N,): where they sit in the flattened batch
            self.seq_lens = sorted(lengths)
        else:  # equal lengths are neighbours already
            self.indices = keep.flatten().nonzero().squeeze(1)
            self.seq_lens = lengths

    def pack(self, x):
        """(B, T, ...) -> (N, ...); None stays None."""
        return None if x is None else x.reshape(self.batch_size * self.length, *x.shape[2:])[self.indices]

    def unpack(self, x):
        """(N, E) -> (B, T, E), zeros at padding."""
        rows = x.new_zeros(self.batch_size * self.length, x.shape[-1]).index_copy_(0, self.indices, x)
        return rows.view(self.batch_size, self.length, -1)


def attend_within_sequences(attention_fn, module, query, key, value, seq_lens, dropout, scaling):
    """Attention for sequences laid end to end: query, key, value (N, H, D) -> context (N, H*D).

    Each run of equal-length neighbours is one (count, H, L, D) batch; 4-D inputs keep sdpa on its fused CPU
    kernels (3-D ones fall back to plain math)."""
    N, H, D = query.shape
    contexts, start = [], 0
    for length, run in itertools.groupby(seq_lens):
        count = len(list(run))
        end = start + count * length
        q, k, v = (x[start:end].view(count, length, H, D).transpose(1, 2) for x in (query, key, value))  # (c, H, L, D)
        context, _ = attention_fn(module, q, k, v, None, dropout=dropout, scaling=scaling)  # (count, L, H, D)
        contexts.append(context.reshape(end - start, H * D))  # (count * L, E): Concat(head_1..head_H)
        start = end
    return contexts[0] if len(contexts) == 1 else torch.cat(contexts)  # (N, E)


__all__ = ["PackedBatch", "attend_within_sequences", "can_pack"]
