"""Greedy and beam-search decoding for the generative models, behind `generate()`: the loop as its arithmetic.

transformers' `generate` calls the model's whole forward (checks, plan, masks, a cache grown by concatenation) for
every new token. Here `generate` prepares as transformers does (generation config, encoder pass, processors,
stopping criteria) and hands the loop to this module where it covers the request, else to transformers' own loop.
Its step writes self-attention keys and values into a cache allocated once, where they stay (reordering beams
rewrites which slots each beam reads: `CachedDecoder`, hf_vanilla/cached_decoder.py); computes cross-attention keys
and values once per source, the beams of a source reading them side by side; and calls the decoder's own modules on
the new token of every row, so it reads the live weights at every call and keeps nothing derived from the model
(int8 and bf16 models take the same step). The loops are whole-batch tensor operations, step for step those of
transformers' `_sample` and `_beam_search`: the same scores, processors and top-k (exactly equal scores aside,
`_top_k`), hence transformers' tokens.

Covered: the seq2seq model and both causal LMs in eval mode with "sdpa" or "eager" attention, greedy and beam search
with the processors a generation config implies (`plan`, `covered_processors`); the table of what is covered and
what takes transformers' loop is in docs/hf_integration.md.
"""

import math

import torch
from transformers import GenerationMixin
from transformers.generation import (
    EosTokenCriteria, ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, GenerationMode,
    InfNanRemoveLogitsProcessor, LogitNormalization, MaxLengthCriteria, MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from .cached_decoder import CachedDecoder
from .compat import ordinary_decoding
from .transformer import VanillaStack

# `generate` arguments that take transformers' loop whatever the rest says: they change the loop itself, or reach it
# only through transformers' own decoding methods (a `custom_generate` callable is not handed them).
STEP_ASIDE_ARGUMENTS = (
    "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "streamer",
    "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "tokenizer", "assistant_tokenizer",
    "cache", "past_key_values", "inputs_embeds", "decoder_inputs_embeds", "decoder_attention_mask",
    "decoder_position_ids",
)
# Processors called as they are: whole-batch tensor operations, the same object transformers' loop would call.
CALLED_AS_THEY_ARE = (
    ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, InfNanRemoveLogitsProcessor, LogitNormalization,
)
MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH)


class VanillaGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin`, whose `generate` decodes in this module where it covers the request (the
    module docstring lists what it covers) and in transformers' loop otherwise, with the same tokens either way."""

    def generate(self, *args, **kwargs):
        """transformers' `generate` (same arguments, same tokens), its loop run here where this module covers it."""
        if len(args) > 2 or any(_given(kwargs.get(name)) for name in STEP_ASIDE_ARGUMENTS) or decoder_of(self) is None:
            return super().generate(*args, **kwargs)

        def decode(self, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
            run = plan(self, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                       config=generation_config, model_kwargs=model_kwargs)
            if run is not None:
                return beam_search(run) if run.beams > 1 else greedy_search(run)
            loop = ordinary_decoding(self, generation_config)
            if loop is None:  # a mode transformers loads from the Hub: its own `generate` says how
                return GenerationMixin.generate(self, *args, **kwargs)
            return loop(self, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                        generation_config=generation_config, **model_kwargs)

        return super().generate(*args, custom_generate=decode, **kwargs)


def _given(value) -> bool:
    """An argument that asks for something: set, and not an empty list (of processors or criteria) nor False."""
    return value is not None and value is not False and not (isinstance(value, list) and not value)


def decoder_of(model):
    """The decoder stack `model` generates with, where this module can step it: a decoder (causal) stack of
    hf_vanilla's, in eval mode, on an attention this step computes, with no hook on it or on the output projection
    (a hook on a module the step does not call, as Accelerate's offloading puts on layers, would be skipped), on a
    single process. Else None."""
    body = getattr(model, "base_model", None)
    name = "decoder" if model.config.is_encoder_decoder else getattr(body, "input_stack", None)
    stack, head = getattr(body, name or "", None), getattr(model, "lm_head", None)
    if not isinstance(stack, VanillaStack) or not stack.is_decoder or head is None or model.training:
        return None
    if model.config._attn_implementation not in ("sdpa", "eager"):
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    for module in (*stack.modules(), *head.modules()):
        if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return None
    return stack


# ---- the plan: what the request asks, and whether this module covers it -------------------------------------------


class Run:
    """One generation: the decoder with its cache, the prompt, and what the loop reads from the generation config."""

    def __init__(self, decoder, input_ids, *, processors, max_length, eos, pad, config):
        self.decoder, self.input_ids, self.processors = decoder, input_ids, processors
        self.max_length, self.eos, self.pad = max_length, eos, pad  # eos: (n,) ids or None; pad: an id or None
        self.beams, self.num_return_sequences = config.num_beams, config.num_return_sequences
        self.length_penalty, self.early_stopping = config.length_penalty, config.early_stopping

    def process(self, input_ids, scores):
        """The logits processors, in transformers' order, on (R, V) scores (written in place where they can be)."""
        for processor in self.processors:
            scores = processor(input_ids, scores)
        return scores

    def stops(self, input_ids):
        """transformers' MaxLengthCriteria | EosTokenCriteria on (R, length) ids: (R,) True where a row is done."""
        done = torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.max_length, device=input_ids.device)
        return done if self.eos is None else done | torch.isin(input_ids[:, -1], self.eos)


def plan(model, input_ids, *, logits_processor, stopping_criteria, config, model_kwargs):
    """A `Run` for this request, or None where this module does not cover it (the module docstring)."""
    if (config.get_generation_mode() not in MODES or config.return_dict_in_generate or not config.use_cache
            or any(getattr(config, name, None) for name in ("cache_implementation", "prefill_chunk_size",
                                                            "compile_config", "token_healing"))):
        return None
    criteria = {type(criterion): criterion for criterion in stopping_criteria}
    if set(criteria) - {MaxLengthCriteria, EosTokenCriteria} or MaxLengthCriteria not in criteria:
        return None
    max_length = criteria[MaxLengthCriteria].max_length
    eos = torch.as_tensor(criteria[EosTokenCriteria].eos_token_id).view(-1) if EosTokenCriteria in criteria else None
    vocab_size = model.config.vocab_size
    processors = covered_processors(logits_processor, vocab_size, input_ids.device)
    stack = decoder_of(model)
    table = stack.config.max_position_embeddings - stack.config.position_offset
    kept = max(2, 1 + (0 if eos is None else eos.numel())) * config.num_beams  # beam search's candidates per source
    if (processors is None or input_ids.shape[1] >= max_length or max_length > table or kept > vocab_size
            or input_ids.device != model.device):  # transformers moves inputs kept elsewhere at every step
        return None
    copies = max(config.num_beams, config.num_return_sequences)  # rows per source (transformers' expansion)
    decoder = CachedDecoder.for_request(model, stack, input_ids, length=max_length, model_kwargs=model_kwargs,
                                        group=config.num_beams, copies=copies)
    if decoder is None or decoder.cache is None:
        return None
    pad = config.pad_token_id if config.pad_token_id is not None or eos is None else int(eos[0])
    return Run(decoder, input_ids, processors=processors, max_length=max_length, eos=eos, pad=pad, config=config)


class Ban:
    """Scores of `ids` set to -inf, in place, while the sequence length is in [first, end): what transformers'
    processors that ban fixed tokens compute (NoBadWords with one-token words, SuppressTokens, SuppressTokensAtBegin,
    MinLength, MinNewTokensLength), without their copy of every score at every step."""

    def __init__(self, ids, vocab_size, device, first=0, end=math.inf):
        ids = torch.as_tensor(ids, device=device).view(-1).long()
        self.ids = ids[(ids >= 0) & (ids < vocab_size)]  # as torch.isin ignores the others
        self.first, self.end = first, end

    def __call__(self, input_ids, scores):
        if self.first <= input_ids.shape[-1] < self.end:
            scores.index_fill_(1, self.ids, -math.inf)
        return scores


def covered_processors(processors, vocab_size, device):
    """transformers' processors as this module applies them (a `Ban`, or the processor itself), or None where one
    is not covered."""
    covered = []
    for processor in processors:
        kind = type(processor)
        if kind is NoBadWordsLogitsProcessor and all(len(word) == 1 for word in processor.sequence_bias):
            if max(word[0] for word in processor.sequence_bias) >= vocab_size:
                return None  # transformers' processor raises the error
            covered.append(Ban([word[0] for word in processor.sequence_bias], vocab_size, device))
        elif kind in (*CALLED_AS_THEY_ARE, NoBadWordsLogitsProcessor):
            covered.append(processor)
        elif kind is SuppressTokensLogitsProcessor:
            covered.append(Ban(processor.suppress_tokens, vocab_size, device))
        elif kind is SuppressTokensAtBeginLogitsProcessor:
            begin = processor.begin_index
            covered.append(Ban(processor.begin_suppress_tokens, vocab_size, device, first=begin, end=begin + 1))
        elif kind is MinLengthLogitsProcessor:
            covered.append(Ban(processor.eos_token_id, vocab_size, device, end=processor.min_length))
        elif kind is MinNewTokensLengthLogitsProcessor:
            end = processor.prompt_length_to_skip + processor.min_new_tokens
            covered.append(Ban(processor.eos_token_id, vocab_size, device, end=end))
        else:
            return None
    return covered


# ---- the loops -----------------------------------------------------------------------------------------------------


def greedy_search(run):
    """transformers' `_sample` without sampling: the highest-scoring token of every row, padding after its end."""
    rows, prompt = run.input_ids.shape
    tokens = run.input_ids.new_empty(rows, run.max_length)  # (R, max_length), filled as the loop goes
    tokens[:, :prompt] = run.input_ids
    finished = torch.zeros(rows, dtype=torch.bool, device=tokens.device)
    logits, length = run.decoder.step(run.input_ids, 0), prompt
    while True:
        next_tokens = run.process(tokens.narrow(1, 0, length), logits.float()).argmax(-1)  # (R,)
        del logits  # before the next step's: one (R, V) buffer at a time, its memory reused rather than refaulted
        if run.eos is not None:  # a finished row continues with padding
            next_tokens.masked_fill_(finished, run.pad)
            finished |= torch.isin(next_tokens, run.eos)
        tokens[:, length] = next_tokens
        length += 1
        if length >= run.max_length or finished.all():  # transformers' MaxLengthCriteria, EosTokenCriteria
            return tokens[:, :length].clone()
        logits = run.decoder.step(next_tokens[:, None], length - 1)


class Beams:
    """Beam search's state, as transformers' `_beam_search` keeps it (batch B, beams K, `keep` candidates)."""

    def __init__(self, run, sources):
        B, K, prompt = sources, run.beams, run.input_ids.shape[1]
        device = run.input_ids.device
        self.keep = max(2, 1 + (0 if run.eos is None else run.eos.shape[0])) * K  # candidates kept per source
        self.top = torch.arange(self.keep, device=device) < K  # (keep,): the candidates that may finish a beam
        fill = (run.pad or int(run.eos[0])) if run.eos is not None else -1  # transformers' `pad or eos[0]`
        self.running = torch.full((B, K, run.max_length), fill, dtype=torch.long, device=device)
        self.running[:, :, :prompt] = run.input_ids.view(B, K, prompt)
        self.sequences = self.running.clone()  # the finished beams
        self.running_scores = torch.zeros(B, K, device=device)
        self.running_scores[:, 1:] = -1e9  # the first step extends the first beam alone
        self.scores = torch.full((B, K), -1e9, device=device)
        self.finished = torch.zeros(B, K, dtype=torch.bool, device=device)
        self.improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
        self.running_indices = torch.full((B, K, run.max_length - prompt), -1, dtype=torch.int32, device=device)
        self.indices = self.running_indices.clone()
        self.offsets = torch.arange(B, device=device)[:, None] * K  # (B, 1): a source's first row


def beam_search(run):
    """transformers' `_beam_search` without sampling, step for step (the same scores, top-k and order)."""
    rows, prompt = run.input_ids.shape
    B = rows // run.beams
    beams, length = Beams(run, B), prompt
    logits = run.decoder.step(run.input_ids, 0)
    while True:
        vocab_size = logits.shape[-1]
        top_scores, top = _best_candidates(run, beams, logits, length)  # (B, keep)
        del logits  # before the next step's: one (R, V) buffer at a time, its memory reused rather than refaulted
        origin = top // vocab_size  # (B, keep): the beam each candidate extends
        candidates = _gather(beams.running, origin)  # (B, keep, max_length)
        candidates[:, :, length] = top % vocab_size
        candidate_indices = _gather(beams.running_indices, origin)
        candidate_indices[:, :, length - prompt] = origin + beams.offsets
        hits = run.stops(candidates.view(B * beams.keep, -1)[:, :length + 1]).view(B, beams.keep)
        _keep_running(beams, top_scores, candidates, candidate_indices=candidate_indices, hits=hits)
        _keep_finished(run, beams, top_scores, candidates=candidates, candidate_indices=candidate_indices, hits=hits,
                       generated=length + 1 - prompt)
        run.decoder.reorder(beams.running_indices[..., length - prompt].reshape(-1), length)
        length += 1
        if not _continues(run, beams, hits, length - prompt):
            break
        logits = run.decoder.step(beams.running.view(rows, -1)[:, length - 1:length], length - 1)
    n = run.num_return_sequences
    sequences, indices = beams.sequences[:, :n].reshape(B * n, -1), beams.indices[:, :n].reshape(B * n, -1)
    return sequences[:, :prompt + int((indices + 1).bool().sum(dim=1).max())]


def _best_candidates(run, beams, logits, length):
    """Each source's `keep` best continuations over its K beams, as transformers chooses them: log-probabilities,
    processed, plus the beam's score, top-k over the source's K * V. The log-probabilities are written over the
    logits where those are float32, and each beam's `keep` best are found before its score is added (a source's
    best are among them): no other pass over the (R, V) scores. Returns (B, keep) scores and indices into K * V."""
    B, K, V = beams.running.shape[0], run.beams, logits.shape[-1]
    scores = logits.float()  # the logits themselves where they are float32
    log_probs = torch.log_softmax(scores, dim=-1, out=scores)
    log_probs = run.process(beams.running.view(B * K, -1)[:, :length], log_probs)  # (R, V)
    top_scores, top = _top_k(log_probs, beams.keep)  # (R, keep): each beam's best
    top_scores = top_scores.view(B, K, beams.keep) + beams.running_scores[:, :, None]
    best_scores, best = torch.topk(top_scores.view(B, K * beams.keep), k=beams.keep)  # (B, keep)
    tokens = top.view(B, K * beams.keep).gather(1, best)
    return best_scores, best // beams.keep * V + tokens  # the beam, times V, plus the token


def _top_k(scores, k: int, block: int = 128):
    """torch.topk(scores, k) over long rows (R, V), found in the k blocks of `block` entries with the highest maxima,
    where every one of the k best lies: one pass of maxima, then a top-k over k * block entries, where torch.topk of a
    long row copies it whole (over half the beam loop's time at 58k entries). Entries of exactly equal score may come
    in another order than torch.topk's, itself unspecified."""
    R, V = scores.shape
    blocks = V // block
    if blocks <= k:
        return torch.topk(scores, k)
    whole = scores[:, :blocks * block].view(R, blocks, block)  # the last V % block entries are candidates anyway
    chosen = whole.amax(-1).topk(k).indices  # (R, k)
    offsets = torch.arange(block, device=scores.device)
    values = torch.cat([whole.gather(1, chosen[..., None].expand(R, k, block)).view(R, k * block),
                        scores[:, blocks * block:]], dim=1)
    indices = torch.cat([(chosen[..., None] * block + offsets).view(R, k * block),
                         torch.arange(blocks * block, V, device=scores.device).expand(R, -1)], dim=1)
    top, where = values.topk(k)
    return top, indices.gather(1, where)


def _gather(tensor, indices):
    """`tensor` (B, K, ...) at beams `indices` (B, N): (B, N, ...)."""
    return torch.take_along_dim(tensor, indices.view(*indices.shape, *[1] * (tensor.dim() - 2)), dim=1)


def _keep_running(beams, top_scores, candidates, *, candidate_indices, hits):
    """The K best candidates that did not finish continue (transformers' `_get_running_beams_for_next_iteration`)."""
    scores = top_scores + hits.to(torch.float32) * -1.0e9
    best = torch.topk(scores, k=beams.running.shape[1])[1]  # K of them: (B, K)
    beams.running, beams.running_scores = _gather(candidates, best), _gather(scores, best)
    beams.running_indices = _gather(candidate_indices, best)


def _keep_finished(run, beams, top_scores, *, candidates, candidate_indices, hits, generated):
    """Candidates among the top K that finished join the finished beams where they score higher
    (transformers' `_update_finished_beams`)."""
    just_finished = hits & beams.top[None, :]
    scores = top_scores / (generated**run.length_penalty)
    full = torch.all(beams.finished, dim=-1, keepdim=True) & (run.early_stopping is True)
    scores += full.to(torch.float32) * -1.0e9
    scores += (~beams.improvable).to(torch.float32) * -1.0e9
    scores += (~just_finished) * -1.0e9
    merged_scores = torch.cat((beams.scores, scores), dim=1)
    best = torch.topk(merged_scores, k=run.beams)[1]
    beams.sequences = _gather(torch.cat((beams.sequences, candidates), dim=1), best)
    beams.scores = _gather(merged_scores, best)
    beams.indices = _gather(torch.cat((beams.indices, candidate_indices), dim=1), best)
    beams.finished = _gather(torch.cat((beams.finished, just_finished), dim=1), best)


def _continues(run, beams, hits, generated) -> bool:
    """Whether beam search goes on (transformers' `_check_early_stop_heuristic` and
    `_beam_search_has_unfinished_sequences`): a running beam may still beat a finished one, a source has an open
    beam (with `early_stopping=True`), and some candidate has not hit a stopping criterion."""
    if run.early_stopping == "never" and run.length_penalty > 0.0:
        best_length = run.max_length - (run.input_ids.shape[1])
    else:
        best_length = generated
    best_running = beams.running_scores[:, :1] / (best_length**run.length_penalty)
    worst_finished = torch.where(beams.finished, torch.min(beams.scores, dim=1, keepdim=True)[0], -1.0e9)
    beams.improvable = beams.improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
    open_beam = ~(torch.all(beams.finished) & (run.early_stopping is True))
    return bool(torch.any(beams.improvable) & open_beam & ~torch.all(hits))
