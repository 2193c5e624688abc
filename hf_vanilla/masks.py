"""Every mask in one module: what a 1/0 `attention_mask` may be, and the additive masks attention adds to its scores.

A padding mask travels from a head to attention in three steps, each a function here: its shape and values are
checked with the other inputs before anything runs (`check_mask_shape`, `check_mask_values`, called by
validation.check_inputs); whether it hides anything at all decides the path (`has_padding`: a mask of ones needs no
mask; packing.py runs a padded encoder batch without its padding); and the padded path turns it into the additive
mask of its attention (`self_attention_mask`, causal in the decoder; `cross_attention_mask` for the keys of the
source). transformers keeps its own in `masking_utils`; these are the model's, in one convention: 1/True attends,
0/False does not, converted to additive 0 / the dtype's minimum once (`additive_mask`).

The other padding-free format arrives packed already: sequences laid end to end in one row (transformers'
`DataCollatorWithFlattening`). packing.py runs it without a mask; where it cannot (tracing, attention maps, a cache),
the masks here keep each sequence to itself, given which sequence each token belongs to (packing.sequence_ids).
"""

import functools

import torch
from torch import nn

from .kernels import is_tracing


def additive_mask(mask, dtype, sdpa: bool = False):
    """1/0 (or bool) mask (..., S) -> 0 where attending is allowed, the dtype's minimum where it is not.

    A query that may attend to nothing (every query of an all-padding row; a left-padded row's first positions in a
    causal stack; a target reading an all-padding source) gets what transformers gives it, so that a loss or a
    pooled output over such a row agrees with transformers' models:
    - eager attention: a row of minima, which swamps every score (score + min rounds to min), so the softmax
      averages every key's value uniformly;
    - `sdpa` (the mask goes to torch's scaled_dot_product_attention): a row of -inf, for which torch's kernels
      return zeros, as they do for transformers' boolean masks.
    Two exceptions keep every output finite. A traced graph keeps the minima for sdpa too (another engine's softmax
    of an all -inf row may be NaN, and zero weights would spread a NaN value), and zeroes such a query's output after
    the kernel (`attends`), so an engine answers what PyTorch's sdpa does. In float16, outside sdpa's -inf, the row
    attends to every key, its scores unmasked: score + min < -65504 overflows to -inf there, and the softmax of an all
    -inf row is NaN."""
    allowed = mask.bool()
    empty = ~allowed.any(-1, keepdim=True)  # (..., 1): queries with no key to attend to
    additive = (~allowed).to(dtype) * torch.finfo(dtype).min
    if sdpa and not is_tracing():
        return additive.masked_fill(empty, float("-inf"))
    if dtype == torch.float16:
        return additive.masked_fill(empty, 0)
    return additive


def attends(attention_mask):
    """(B|1, 1, T|1, 1): True where a query of the additive `attention_mask` (B|1, 1, T|1, S) has a key to attend
    to, False where every key carries the dtype's minimum."""
    return (attention_mask > torch.finfo(attention_mask.dtype).min).any(-1, keepdim=True)


def self_attention_mask(attention_mask, query_length, past_length, key_length, causal: bool, dtype, device,
                        sequences=None, sdpa: bool = False):
    """The additive mask (B|1, 1, T|1, S) self-attention adds to its scores, or None when nothing is hidden.

    - A 4-D mask is the caller's final word: used as given (True/1 = attend, or already additive).
    - A 2-D padding mask (B, S) hides padding keys.
    - Causal (the decoder, section 3.2.3): query t, at absolute position past_length + t, sees keys
      0..past_length + t and never the future. A static cache holds `key_length` slots, the unused ones in the
      future of every query, so causality hides them too.
    - `sequences` (B, T), for sequences packed end to end in a row (packing.sequence_ids): a query sees only the
      keys of its own sequence.
    - `sdpa`: the mask goes to torch's scaled_dot_product_attention: a query with no key to attend to is given
      what sdpa gives it in transformers, zeros, rather than eager attention's average (`additive_mask`).
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return given_mask(attention_mask, dtype, sdpa)
    padded = has_padding(attention_mask)
    if not causal:
        if sequences is not None:  # no padding mask beside packed sequences (packing.sequence_ids refuses both)
            same = sequences[:, :, None] == sequences[:, None, :]  # (B, T, T)
            return additive_mask(same[:, None], dtype, sdpa)  # (B, 1, T, T)
        return additive_mask(attention_mask[:, None, None, :], dtype, sdpa) if padded else None  # (B, 1, 1, S)
    if query_length == 1 and not padded and isinstance(past_length, int) and key_length == past_length + 1:
        return None  # one new token may see every key: nothing to mask
    query_pos = torch.arange(query_length, device=device) + past_length  # (T,)
    allowed = torch.arange(key_length, device=device)[None, :] <= query_pos[:, None]  # (T, S)
    allowed = allowed[None, None]  # (1, 1, T, S)
    if sequences is not None:  # no cache before them: the T queries and the first T keys are the same tokens
        same = sequences[:, :, None] == sequences[:, None, :]  # (B, T, T)
        same = nn.functional.pad(same, (0, key_length - query_length))  # a static cache's unused slots
        allowed = allowed & same[:, None]  # (B, 1, T, S)
    if padded:
        keys = attention_mask.bool()  # (B, past + T)
        keys = nn.functional.pad(keys, (0, key_length - keys.shape[-1]))  # a static cache's unused slots
        allowed = allowed & keys[:, None, None, :]  # (B, 1, T, S)
    return additive_mask(allowed, dtype, sdpa)


def padded_path_masks(plan, attention_mask, encoder_attention_mask, *, past_length, cache, causal: bool, like,
                      sdpa: bool):
    """The padded path's additive masks from the stack's plan (packing.BatchPlan), in the dtype and on the device of
    `like` (the hidden states): self-attention's (B|1, 1, T|1, S) and cross-attention's; (None, None) on the
    padding-free path, where attention runs within each sequence. `sdpa`: made for torch's kernel rather than eager
    attention (what a query with no key gets: `additive_mask`)."""
    dtype, device = like.dtype, like.device
    if plan.packed is not None:
        return None, None
    T = plan.shape[1]
    key_length = cache.get_mask_sizes(T, 0)[0] if cache is not None else T  # a static cache's keys
    mask = self_attention_mask(attention_mask, T, past_length=past_length, key_length=key_length, causal=causal,
                               dtype=dtype, device=device, sequences=plan.sequences, sdpa=sdpa)
    return mask, cross_attention_mask(encoder_attention_mask, dtype, sequences=plan.sequences,
                                      encoder_sequences=plan.encoder_sequences, sdpa=sdpa)


@functools.lru_cache(maxsize=256)
def sequence_causal_mask(length: int, dtype, device, implementation: str):
    """The causal mask of one sequence of `length` tokens alone (section 3.2.3), as the padding-free path passes it
    to every call for sequences of that length, in the form the attention implementation reads: a `BlockMask` for
    flex_attention (transformers' flex function indexes a tensor mask per batch row, which crashes on CPU in torch
    2.13 when the mask is shared by the rows), else the additive (1, 1, L, L). Kept across calls: the same few
    lengths come back at every layer and every step."""
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(lambda b, h, q, k: q >= k, None, None, length, length, device=device)
    return self_attention_mask(None, query_length=length, past_length=0, key_length=length, causal=True, dtype=dtype,
                               device=device)


def given_mask(mask, dtype, sdpa: bool = False):
    """A 4-D mask (B|1, 1, T|1, S), the caller's final word, in the additive convention: a float mask is additive
    already (0 / a large negative number), a bool or 1/0 one is converted."""
    return mask.to(dtype) if mask.is_floating_point() else additive_mask(mask, dtype, sdpa)


def cross_attention_mask(encoder_attention_mask, dtype, sequences=None, encoder_sequences=None,
                         sdpa: bool = False):
    """The additive mask (B, 1, 1, S) cross-attention adds to its scores: the source's padding keys hidden (section
    3.2.3: every target position attends over all source positions), or None without a source mask. With packed
    sequences (`sequences` (B, T) for the target, `encoder_sequences` (B, S) for the source), target sequence i reads
    source sequence i alone: (B, 1, T, S). A 4-D source mask (B|1, 1, T|1, S) is used as given, target position t
    reading its row t, as transformers' encoder-decoders pass a custom 4-D mask on to cross-attention. `sdpa`: as in
    `self_attention_mask` (a target row reading an all-padding source has no key)."""
    if encoder_attention_mask is not None and encoder_attention_mask.dim() == 4:
        return given_mask(encoder_attention_mask, dtype, sdpa)
    if sequences is not None and encoder_sequences is not None:
        same = sequences[:, :, None] == encoder_sequences[:, None, :]  # (B, T, S)
        if encoder_attention_mask is not None:
            same = same & encoder_attention_mask.bool()[:, None, :]
        return additive_mask(same[:, None], dtype, sdpa)  # (B, 1, T, S)
    return None if encoder_attention_mask is None else additive_mask(encoder_attention_mask[:, None, None, :], dtype,
                                                                     sdpa)


def has_padding(mask) -> bool:
    """Whether a 1/0 `attention_mask` hides any token. A mask of ones needs no masking at all: attention then runs
    without a mask, bit for bit what it gives without `attention_mask`. (Always True while tracing, where the
    graph must not depend on the mask's values.)"""
    return mask is not None and (is_tracing() or not mask.all())


# ---- checks, before anything runs (validation.check_inputs) -------------------------------------------------------


def check_mask_shape(name, mask, shape, past_length, cache, ids_name):
    """A 2-D padding mask has one 1/0 per token (of the cache too, when decoding). A 4-D mask, as transformers'
    mask utilities and `generate` with a static cache build it, is (batch or 1, 1, length or 1, keys) and is used
    as given: True/1 (or an additive 0) where a query may attend, False/0 (or a large negative number) where not."""
    if mask is None:
        return
    if mask.is_complex():
        raise ValueError(f"{name} must be bool, integer or float, got {mask.dtype}: pass the tokenizer's mask.")
    if mask.dim() == 4:
        key_length = cache.get_mask_sizes(shape[1], 0)[0] if cache is not None else shape[1]
        if (mask.shape[0] not in (1, shape[0]) or mask.shape[1] != 1 or mask.shape[2] not in (1, shape[1])
                or mask.shape[3] != key_length):
            raise ValueError(
                f"A 4-D {name} must be (batch, 1, query length, key length) = ({shape[0]}, 1, {shape[1]}, "
                f"{key_length}) (batch and query length may be 1, to broadcast), got {tuple(mask.shape)}."
            )
        return
    with_cache = (shape[0], past_length + shape[1])
    if tuple(mask.shape) not in (shape, with_cache):
        expected = with_cache if past_length else shape
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but should be {expected}, one 1/0 per token of {ids_name} "
            f"{shape}{' and of the cache' if past_length else ''}: pass the tokenizer's attention_mask (or a 4-D "
            f"mask of shape (batch, 1, query length, key length))."
        )


def check_mask_values(name, mask):
    """Padding masks are 1 (token) / 0 (padding); any other value would be read differently by the padded and
    packed paths. A float 4-D mask is additive and taken as given."""
    if mask is None or mask.dtype == torch.bool or (mask.dim() == 4 and mask.is_floating_point()):
        return
    if mask.is_floating_point():
        valid = bool(((mask == 0) | (mask == 1)).all())
    else:  # integers hold nothing but 1 and 0 when their extremes do: one reduction
        low, high = (int(x) for x in torch.aminmax(mask))
        valid = low >= 0 and high <= 1
    if not valid:
        invalid = (mask != 0) & (mask != 1)
        raise ValueError(
            f"{name} must hold 1 (token) or 0 (padding), got {mask[invalid][0].item()}: pass the tokenizer's "
            f"attention_mask (an additive mask must be 4-D: (batch, 1, query length, key length))."
        )


__all__ = ["additive_mask", "check_mask_shape", "check_mask_values", "cross_attention_mask", "given_mask",
           "has_padding", "self_attention_mask", "sequence_causal_mask"]
