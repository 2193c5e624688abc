"""What the heads compute from their body's states and their labels: scores over the vocabulary (on the real tokens
alone, where the body ran padding-free), the losses, and what labels ask of the body (teacher forcing's shifted
target, the padded path where a loss reads padding positions, no cache while training).

Each is a function of tensors and of the batch's plan (packing.BatchPlan, carried by the body's output as `plan`);
the heads (`modeling_encoder.py`, `modeling_seq2seq.py`, `modeling_decoder.py`) call them by name. Shapes follow
`transformer.py`'s key (B, T, N, E, V).
"""

from typing import NamedTuple

import torch
from torch import nn

from .kernels import is_tracing
from .packing import sequence_ids
from .validation import check_labels


class TokenLogits(NamedTuple):
    """A language-model head's scores at every position, `all` (B, T, V), and, where the padding-free path left
    padding positions exactly zero, the real tokens' own rows: `packed` (N, V) at the flattened (B * T) index
    `real` (N,), in order."""

    all: torch.Tensor
    packed: torch.Tensor | None = None
    real: torch.Tensor | None = None

    def labels_at_real_tokens(self, labels):
        """(N,): the labels (B, T) of the real tokens, the rows of `packed`."""
        return labels.flatten()[self.real.to(labels.device)]


def token_logits(lm_head, hidden_states, plan=None):
    """`lm_head` at every position, (B, T, E) -> TokenLogits, computed on the real tokens alone where the body ran
    padding-free (`plan`, the body's packing.BatchPlan, gives their index): its padding positions hold exact zeros,
    which all score `lm_head(0)`, computed once. With a large vocabulary the output projection costs as much per
    token as the layers: scoring padding would spend on it what the padding-free layers saved. The loss then reads
    the N real rows alone."""
    real = None if plan is None else plan.real_tokens()  # (N,)
    if real is None:
        return TokenLogits(lm_head(hidden_states))
    B, T, E = hidden_states.shape
    real = real.to(hidden_states.device)
    packed = lm_head(hidden_states.flatten(0, 1)[real])  # (N, V)
    logits = lm_head(hidden_states.new_zeros(1, E)).expand(B * T, -1).clone()  # (B * T, V): lm_head(0) everywhere
    logits[real] = packed
    return TokenLogits(logits.view(B, T, -1), packed, real)


def token_cross_entropy(logits: TokenLogits, labels):
    """`cross_entropy` of a language-model head's `TokenLogits`: over the real tokens' rows alone where it has them
    (the others carry no label, or the padded path would score them the same)."""
    if labels is None or logits.real is None:
        return cross_entropy(logits.all, labels)
    return cross_entropy(logits.packed, logits.labels_at_real_tokens(labels))


def causal_lm_loss(loss_function, vocab_size, logits: TokenLogits, labels, shift_labels=None):
    """Next-token cross-entropy (transformers' `loss_function` of a causal LM): position t against labels[t + 1],
    or against `shift_labels[t]` when the caller shifted them already (as sequence and context parallelism must,
    each process holding a slice). Over the real tokens' rows alone where `logits` has them."""
    if labels is None and shift_labels is None:
        return None
    check_labels(shift_labels, vocab_size, "vocab_size")
    shift_labels = next_tokens(labels, shift_labels)
    scores = logits.all
    if logits.real is not None:  # (1, N, V) and (1, N): the real tokens alone
        scores, shift_labels = logits.packed[None], logits.labels_at_real_tokens(shift_labels)[None]
    return loss_function(scores, None, vocab_size=vocab_size, shift_labels=shift_labels)


def cross_entropy(logits, labels):
    """Cross-entropy of (..., C) logits against (...) class ids, -100 skipped: the loss of every head that picks
    one class per position or per sequence (masked and generated tokens, entities, next sentence, choices)."""
    if labels is None:
        return None
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device))


def span_logits(qa_outputs, hidden_states):
    """Extractive QA: a start and an end score per token, (B, T, E) -> two (B, T); the answer is the best span."""
    start_logits, end_logits = qa_outputs(hidden_states).unbind(-1)  # (B, T, 2) -> 2 x (B, T)
    return start_logits.contiguous(), end_logits.contiguous()


def replaced_token_loss(logits, labels, attention_mask):
    """ELECTRA's loss: binary cross-entropy of the (B, T) logits against 1 (replaced) / 0 (original), over real
    tokens only: padding is neither original nor replaced."""
    if labels is None:
        return None
    labels = labels.to(logits.device)
    real = torch.ones_like(labels, dtype=torch.bool) if attention_mask is None else attention_mask == 1
    return nn.functional.binary_cross_entropy_with_logits(logits[real], labels[real].to(logits.dtype))


# ---- what labels ask of the body ------------------------------------------------------------------------------


def next_tokens(labels, shift_labels=None):
    """(B, T): the label a causal language model scores position t against: labels[t + 1] (-100 at the last
    position), or `shift_labels[t]` where the caller shifted them already. None without either."""
    if shift_labels is not None or labels is None:
        return shift_labels
    return nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # (B, T): position t's next token


def reads_padding(labels, attention_mask) -> bool:
    """Whether a loss scores padding positions: `labels` (B, T), one per position whose output the loss reads, hold
    a label other than -100 where the 2-D `attention_mask` holds 0. transformers' models score those positions with
    the outputs the padded computation gives them (each padding position attending to its row's real tokens); the
    padding-free path leaves them at zero, so the body is asked for the padded path (`outputs_at_padding`)."""
    if labels is None or attention_mask is None or attention_mask.dim() != 2 or is_tracing():
        return False
    if tuple(labels.shape) != tuple(attention_mask.shape):  # e.g. a cache's keys counted in the mask: not packed
        return False
    return bool(((labels.to(attention_mask.device) != -100) & ~attention_mask.bool()).any())


def no_cache_for_labels(use_cache, labels):
    """A forward with labels and no word on the cache builds none, as BART's generation head does: a training step
    reads no cache, and without one a padded batch runs padding-free (packing.py)."""
    return False if use_cache is None and labels is not None else use_cache


def shift_tokens_right(labels, pad_token_id: int, decoder_start_token_id: int, position_ids=None):
    """Teacher forcing: the decoder reads the target shifted one step right, starting from the start token, and
    learns to predict the unshifted target. -100 (ignored) label positions are read as padding. Targets packed end
    to end (`position_ids` restarting, transformers' packed format) each start from the start token."""
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    sequences = sequence_ids(labels.shape, position_ids) if position_ids is not None else None
    if sequences is not None:
        starts = torch.ones_like(sequences, dtype=torch.bool)
        starts[:, 1:] = sequences[:, 1:] != sequences[:, :-1]  # (B, T): the first token of each packed target
        shifted = shifted.masked_fill(starts, decoder_start_token_id)
    return shifted.masked_fill(shifted == -100, pad_token_id)


def labelled_prefix(labels):
    """(B, T) 1/0: the decoder positions up to each row's last label. Computed with it as the decoder's
    attention_mask, every labelled position reads what it reads without it (the rest is in its future), and a
    padded target batch runs padding-free (packing.py)."""
    labelled = labels != -100
    last = torch.where(labelled, torch.arange(labels.shape[-1], device=labels.device), -1).amax(-1)  # (B,)
    return (torch.arange(labels.shape[-1], device=labels.device) <= last[:, None]).long()


__all__ = ["TokenLogits", "causal_lm_loss", "cross_entropy", "labelled_prefix", "next_tokens", "no_cache_for_labels", "reads_padding",
           "replaced_token_loss", "shift_tokens_right", "span_logits", "token_cross_entropy", "token_logits"]
