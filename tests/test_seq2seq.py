"""The encoder-decoder of "Attention Is All You Need": causality, padding, the key/value cache under `generate()`,
attention maps, the loss, saving and loading, and a tutorial-style reference written head by head.

Random tiny models with the default initialisation generate degenerate text (one token repeated), against which a
broken cache can look right. The generation tests therefore use a random model with large weights, pre-LN and an
untied output projection, whose outputs vary from source to source and from step to step; a test checks that.
"""

import copy
import math

import pytest
import torch
from hf_references import single_thread  # noqa: F401  (fixture)
from numerics import assert_close
from torch.nn import functional as F
from transformers import AutoModelForSeq2SeqLM

from hf_vanilla import VanillaSeq2SeqConfig, VanillaSeq2SeqForConditionalGeneration
from hf_vanilla.losses import shift_tokens_right
from hf_vanilla.transformer import sinusoidal_position_table

PAD, BOS, EOS = 0, 1, 2  # BOS is also the decoder start token
DIGIT = 3  # digit d is token d + 3
VOCAB = DIGIT + 10
ATTENTION = ["eager", "sdpa"]
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.generation]
# Invariance claims (causality, padding, the cache) are exact in float64, where they are checked at its 1e-12; in
# float32 another shape sums in another order, so they hold at the float32 rule (tests/numerics.py).
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])


def tiny_config(**overrides) -> VanillaSeq2SeqConfig:
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, decoder_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0, pad_token_id=PAD,
        bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
        initializer_range=0.2,  # larger than BERT's 0.02, so that attention is far from uniform
    )
    fields.update(overrides)
    return VanillaSeq2SeqConfig(**fields)


def random_model(attn_implementation="sdpa", seed=0, dtype=torch.float32,
                 **overrides) -> VanillaSeq2SeqForConditionalGeneration:
    torch.manual_seed(seed)
    model = VanillaSeq2SeqForConditionalGeneration(tiny_config(**overrides)).eval().to(dtype)
    model.set_attn_implementation(attn_implementation)
    return model


def digit_batch(lengths, seed=0):
    """Random digit strings -> source (B, S) ending in EOS and right-padded, its mask, and the reversed targets
    (B, T) ending in EOS with -100 on padding."""
    generator = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths) + 1
    input_ids, labels = torch.full((B, S), PAD), torch.full((B, S), -100)
    for i, n in enumerate(lengths):
        digits = torch.randint(0, 10, (n,), generator=generator) + DIGIT
        input_ids[i, :n], input_ids[i, n] = digits, EOS
        labels[i, :n], labels[i, n] = digits.flip(0), EOS
    return input_ids, (input_ids != PAD).long(), labels


@pytest.fixture(scope="module")
def generator_model():
    """A random model whose generations vary with the source and along the output (see the module docstring)."""
    # (transformers ties nothing once tie_word_embeddings=False, so the embeddings are stated separate too.)
    return random_model(initializer_range=1.0, pre_norm=True, tie_word_embeddings=False,
                        share_encoder_decoder_embeddings=False, scale_embeddings=False)


@pytest.fixture(scope="module")
def held_out():
    """Eight sources of different lengths, right-padded."""
    return digit_batch([6, 3, 5, 4, 2, 6, 5, 3], seed=12345)


# ---- causality and padding ------------------------------------------------------------------------------------


@pytest.mark.numerics
@DTYPES
@pytest.mark.parametrize("attn_implementation", ATTENTION)
def test_changing_a_future_target_token_never_changes_earlier_logits(attn_implementation, dtype):
    model = random_model(attn_implementation, dtype=dtype)
    input_ids, attention_mask, labels = digit_batch([6, 4])
    decoder_input_ids = shift_tokens_right(labels, PAD, BOS)  # (2, 7)
    with torch.no_grad():
        logits = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits
        for t in range(1, decoder_input_ids.shape[1]):
            changed = decoder_input_ids.clone()
            changed[:, t] = (changed[:, t] - DIGIT + 1) % 10 + DIGIT  # another digit at position t
            new_logits = model(input_ids, attention_mask, decoder_input_ids=changed).logits
            assert_close(new_logits[:, :t], logits[:, :t], msg=f"positions before {t}")
            assert (new_logits[:, t] - logits[:, t]).abs().max() > 1e-3  # position t itself does see the change
            # A prefix alone gives the same logits as inside the longer target (a matmul of another shape).
            prefix_logits = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids[:, :t]).logits
            assert_close(prefix_logits, logits[:, :t], msg=f"prefix of {t}")


@pytest.mark.numerics
@DTYPES
@pytest.mark.parametrize("attn_implementation", ATTENTION)
def test_source_padding_never_changes_real_tokens(attn_implementation, dtype):
    model = random_model(attn_implementation, dtype=dtype)
    input_ids, attention_mask, labels = digit_batch([7, 3, 5])
    decoder_input_ids = shift_tokens_right(labels, PAD, BOS)
    # More padding than needed, holding arbitrary token ids: the mask alone decides what is padding.
    input_ids = torch.cat([input_ids, torch.full((3, 4), 7)], dim=1)
    attention_mask = torch.cat([attention_mask, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    input_ids = input_ids.masked_fill(attention_mask == 0, 9)
    with torch.no_grad():
        batched = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids)
        for i, length in enumerate(attention_mask.sum(1).tolist()):
            alone = model(input_ids[i : i + 1, :length], decoder_input_ids=decoder_input_ids[i : i + 1])
            assert_close(batched.logits[i : i + 1], alone.logits, msg=f"logits of row {i}")
            assert_close(batched.encoder_last_hidden_state[i : i + 1, :length], alone.encoder_last_hidden_state,
                         msg=f"encoder output of row {i}")


@pytest.mark.numerics
@DTYPES
def test_target_padding_never_changes_real_positions(dtype):
    model = random_model(dtype=dtype)
    input_ids, attention_mask, labels = digit_batch([5, 5])
    decoder_input_ids = shift_tokens_right(labels, PAD, BOS)  # (2, 6)
    padded = torch.cat([decoder_input_ids, torch.full((2, 3), 8)], dim=1)  # (2, 9): 3 masked positions
    decoder_attention_mask = torch.cat([torch.ones(2, 6), torch.zeros(2, 3)], dim=1).long()
    with torch.no_grad():
        plain = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits
        masked = model(input_ids, attention_mask, decoder_input_ids=padded,
                       decoder_attention_mask=decoder_attention_mask).logits
    assert_close(masked[:, :6], plain)


# ---- the key/value cache --------------------------------------------------------------------------------------


@pytest.mark.numerics
@DTYPES
@pytest.mark.parametrize("attn_implementation", ATTENTION)
def test_step_by_step_decoding_with_the_cache_matches_the_full_forward(attn_implementation, dtype):
    model = random_model(attn_implementation, dtype=dtype)
    input_ids, attention_mask, labels = digit_batch([6, 2, 4])
    decoder_input_ids = shift_tokens_right(labels, PAD, BOS)  # (3, 7)
    with torch.no_grad():
        full = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids, use_cache=False).logits
        encoder_outputs = model.get_encoder()(input_ids, attention_mask)
        cache = None
        for t in range(decoder_input_ids.shape[1]):
            step = model(attention_mask=attention_mask, encoder_outputs=encoder_outputs, past_key_values=cache,
                         decoder_input_ids=decoder_input_ids[:, t : t + 1], use_cache=True)
            cache = step.past_key_values
            assert cache.get_seq_length() == t + 1
            assert_close(step.logits[:, 0], full[:, t], msg=f"step {t}")
    # The source's keys and values were projected once, at the first step, then reused.
    assert all(cache.is_updated[i] for i in range(model.config.decoder_layers))
    assert cache.cross_attention_cache.get_seq_length() == input_ids.shape[1]


def _greedy_reference(model, input_ids, attention_mask, max_new_tokens):
    """Greedy decoding written out: re-run the whole target at every step, no cache, no `generate`."""
    decoder_input_ids = torch.full((input_ids.shape[0], 1), BOS)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids, use_cache=False).logits
            next_token = logits[:, -1].argmax(-1).masked_fill(done, PAD)
            decoder_input_ids = torch.cat([decoder_input_ids, next_token[:, None]], dim=1)
            done |= next_token == EOS
            if done.all():
                break
    return decoder_input_ids


def test_generator_model_is_a_meaningful_generation_test(generator_model, held_out):
    """Greedy outputs differ between sources and change token along the way: a stale cache would show."""
    input_ids, attention_mask, _ = held_out
    generated = generator_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10,
                                         min_new_tokens=10)[:, 1:]  # (8, 10)
    assert len({tuple(row.tolist()) for row in generated}) == len(generated)
    changes = (generated[:, 1:] != generated[:, :-1]).sum(1)  # (8,): how often each output switches token
    assert (changes >= 2).sum() >= len(generated) // 2


def test_greedy_generate_with_and_without_cache_equals_the_written_out_loop(generator_model, held_out):
    input_ids, attention_mask, _ = held_out
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False, num_beams=1,
                  return_dict_in_generate=True, output_scores=True)
    cached = generator_model.generate(input_ids, use_cache=True, **kwargs)
    uncached = generator_model.generate(input_ids, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    for step, (step_cached, step_uncached) in enumerate(zip(cached.scores, uncached.scores, strict=True)):
        assert_close(step_cached, step_uncached, msg=f"step {step}")
    reference = _greedy_reference(generator_model, input_ids, attention_mask, max_new_tokens=8)
    assert torch.equal(cached.sequences, reference)


def test_generate_continues_a_target_prompt_and_accepts_token_type_ids(generator_model, held_out):
    """A decoder prompt longer than the start token fills the cache with several positions at once; a BERT
    tokenizer's all-zero `token_type_ids` (which `generate` forwards to every step) change nothing."""
    input_ids, attention_mask, labels = held_out
    prompt = torch.cat([torch.full((len(labels), 1), BOS), labels[:, :2]], dim=1)  # (B, 3)
    kwargs = dict(attention_mask=attention_mask, decoder_input_ids=prompt, max_new_tokens=6, min_new_tokens=6)
    cached = generator_model.generate(input_ids, use_cache=True, **kwargs)
    assert torch.equal(cached[:, :3], prompt)
    assert torch.equal(cached, generator_model.generate(input_ids, use_cache=False, **kwargs))
    assert torch.equal(cached, generator_model.generate(
        input_ids, use_cache=True, decoder_attention_mask=torch.ones_like(prompt), **kwargs))
    with_types = generator_model.generate(input_ids, token_type_ids=torch.zeros_like(input_ids), **kwargs)
    assert torch.equal(cached, with_types)


@DTYPES
def test_beam_search_with_and_without_cache(generator_model, held_out, dtype):
    """A beam's score is a sum of log-probabilities, each a small difference of logits of size ~17: in float32 it
    rounds with the logits, not with the score (cache and no cache differ by 2e-5 on scores of 3.7, half the rule's
    bound). So the scores are compared in float64, where the cache changes nothing; float32 must pick the same
    hypotheses in the same order."""
    model = copy.deepcopy(generator_model).to(dtype)
    input_ids, attention_mask, _ = held_out
    # length_penalty=0: a hypothesis' score is then exactly the sum of its tokens' log-probabilities.
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, num_beams=3, num_return_sequences=3,
                  length_penalty=0.0, do_sample=False, return_dict_in_generate=True, output_scores=True)
    cached = model.generate(input_ids, use_cache=True, **kwargs)
    uncached = model.generate(input_ids, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)

    # Each returned hypothesis is a distinct sequence, best first, scored with the model's own log-probabilities.
    sequences = cached.sequences  # (B * 3, L)
    B = input_ids.shape[0]
    for i in range(B):
        beams = sequences[3 * i : 3 * i + 3]
        assert len({tuple(beam.tolist()) for beam in beams}) == 3
        assert cached.sequences_scores[3 * i : 3 * i + 3].diff().le(0).all()  # sorted: an exact order
    if dtype != torch.float64:
        return
    assert_close(cached.sequences_scores, uncached.sequences_scores)
    with torch.no_grad():
        logits = model(input_ids.repeat_interleave(3, 0), attention_mask.repeat_interleave(3, 0),
                       decoder_input_ids=sequences[:, :-1], use_cache=False).logits
    token_log_probs = logits.log_softmax(-1).gather(-1, sequences[:, 1:, None])[..., 0]  # (B * 3, L - 1)
    # Tokens after EOS are padding, not part of the hypothesis.
    after_eos = (sequences[:, 1:] == EOS).long().cumsum(1) - (sequences[:, 1:] == EOS).long() > 0
    expected = token_log_probs.masked_fill(after_eos, 0.0).sum(1)
    assert_close(cached.sequences_scores, expected)


def test_sampling_with_a_seed_is_reproducible_with_and_without_cache(generator_model, held_out):
    input_ids, attention_mask, _ = held_out
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=True, temperature=2.0, top_k=0)
    outputs = {}
    for seed in (0, 1):
        for use_cache in (True, False):
            torch.manual_seed(seed)
            outputs[seed, use_cache] = generator_model.generate(input_ids, use_cache=use_cache, **kwargs)
    assert torch.equal(outputs[0, True], outputs[0, False])
    assert torch.equal(outputs[1, True], outputs[1, False])
    assert not torch.equal(outputs[0, True], outputs[1, True])  # it does sample
    assert torch.all(outputs[0, True][:, 0] == BOS)


# ---- attention maps -------------------------------------------------------------------------------------------


def test_output_attentions_are_distributions_that_ignore_padding():
    model = random_model("eager")
    input_ids, attention_mask, labels = digit_batch([6, 3])  # (2, 7): the second row has 3 padded positions
    decoder_input_ids = shift_tokens_right(labels, PAD, BOS)
    B, S, T, H = 2, input_ids.shape[1], decoder_input_ids.shape[1], model.config.decoder_attention_heads
    with torch.no_grad():
        out = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
    padded_keys = attention_mask == 0  # (B, S)
    assert len(out.encoder_attentions) == model.config.num_hidden_layers
    assert len(out.decoder_attentions) == len(out.cross_attentions) == model.config.decoder_layers
    for weights in out.encoder_attentions:
        assert weights.shape == (B, model.config.num_attention_heads, S, S)
        assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
        assert torch.all(weights.transpose(1, 3)[padded_keys] == 0)  # (B, S_key, S_query, H)[padded] == 0
    for weights in out.decoder_attentions:
        assert weights.shape == (B, H, T, T)
        assert_close(weights.sum(-1), torch.ones(B, H, T))
        assert torch.all(weights.triu(diagonal=1) == 0)  # no query sees a later key
    for weights in out.cross_attentions:
        assert weights.shape == (B, H, T, S)
        assert_close(weights.sum(-1), torch.ones(B, H, T))
        assert torch.all(weights.transpose(1, 3)[padded_keys] == 0)
        assert weights[1, :, :, :4].min() > 0  # real source tokens are all attended to


def test_output_attentions_during_cached_generation(generator_model, held_out):
    input_ids, attention_mask, _ = held_out
    generator_model.set_attn_implementation("eager")
    try:
        out = generator_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, min_new_tokens=4,
                                     output_attentions=True, return_dict_in_generate=True)
    finally:
        generator_model.set_attn_implementation("sdpa")
    B, S = input_ids.shape
    H = generator_model.config.decoder_attention_heads
    assert len(out.decoder_attentions) == len(out.cross_attentions) == 4  # one tuple per generated token
    for t, (self_attn, cross_attn) in enumerate(zip(out.decoder_attentions, out.cross_attentions)):
        assert self_attn[0].shape == (B, H, 1, t + 1)  # one new query against the cached keys
        assert cross_attn[0].shape == (B, H, 1, S)
        assert torch.all(cross_attn[0].transpose(1, 3)[attention_mask == 0] == 0)


def test_attention_maps_under_sdpa_are_the_eager_maps():
    """Asking for attention maps runs the eager function for that call, whatever the backend (transformers' own
    models return none under sdpa): the same maps, self- and cross-attention, as the eager model's."""
    sdpa = random_model("sdpa")
    eager = random_model("eager")
    eager.load_state_dict(sdpa.state_dict())
    input_ids, attention_mask, labels = digit_batch([3, 2])
    with torch.no_grad():
        got = sdpa(input_ids, attention_mask, labels=labels, output_attentions=True)
        want = eager(input_ids, attention_mask, labels=labels, output_attentions=True)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        assert len(getattr(got, name)) == len(getattr(want, name)) > 0
        for ours, theirs in zip(getattr(got, name), getattr(want, name)):
            assert torch.equal(ours, theirs), name


# ---- the loss -------------------------------------------------------------------------------------------------


def test_shift_tokens_right_starts_with_the_start_token_and_reads_ignored_labels_as_padding():
    labels = torch.tensor([[5, 6, 7, EOS], [8, EOS, -100, -100]])
    expected = torch.tensor([[BOS, 5, 6, 7], [BOS, 8, EOS, PAD]])
    assert torch.equal(shift_tokens_right(labels, PAD, BOS), expected)


def test_loss_is_the_cross_entropy_of_the_shifted_target_ignoring_minus_100():
    model = random_model()
    input_ids, attention_mask, labels = digit_batch([6, 3, 4])
    labels[0, 2] = -100  # an ignored position inside a sequence, too
    with torch.no_grad():
        loss = model(input_ids, attention_mask, labels=labels).loss
        decoder_input_ids = shift_tokens_right(labels, PAD, BOS)
        logits = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits  # (B, T, V)
    kept = labels != -100
    log_probs = logits.log_softmax(-1)[kept]  # (kept, V)
    manual = -log_probs.gather(1, labels[kept][:, None]).mean()
    assert_close(loss, manual)
    assert kept.sum() < labels.numel()  # some positions were ignored


# ---- saving and loading ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("share", [True, False], ids=["shared-embeddings", "separate-embeddings"])
def test_save_and_load_round_trip(tmp_path, share):
    model = random_model(share_encoder_decoder_embeddings=share)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is VanillaSeq2SeqForConditionalGeneration

    # The sinusoidal table is not saved: it must have been rebuilt, not left as uninitialised memory.
    expected_table = sinusoidal_position_table(model.config.max_position_embeddings, model.config.hidden_size)
    for stack in (loaded.model.encoder, loaded.model.decoder):
        assert torch.equal(stack.embeddings.position_table, expected_table)

    input_ids, attention_mask, labels = digit_batch([6, 3])
    decoder_input_ids = shift_tokens_right(labels, PAD, BOS)
    with torch.no_grad():
        before = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits
        after = loaded(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits
    assert torch.equal(before, after)

    source = loaded.model.encoder.embeddings.word_embeddings.weight
    target = loaded.model.decoder.embeddings.word_embeddings.weight
    output = loaded.lm_head.decoder.weight
    assert output.data_ptr() == target.data_ptr()  # the output projection is the target embedding (section 3.4)
    assert (source.data_ptr() == target.data_ptr()) is share
    assert torch.equal(source, model.model.encoder.embeddings.word_embeddings.weight)
    assert torch.equal(target, model.model.decoder.embeddings.word_embeddings.weight)
    assert loaded.generation_config.decoder_start_token_id == BOS
    assert loaded.generation_config.eos_token_id == EOS


def test_shared_embeddings_need_a_tied_output_projection():
    """transformers ties `_tied_weights_keys` only under tie_word_embeddings: sharing without it would silently give
    separate source and target matrices, so the config refuses the mix and names both ways out."""
    with pytest.raises(ValueError, match=r"share_encoder_decoder_embeddings=True needs tie_word_embeddings=True.*"
                                         r"set share_encoder_decoder_embeddings=False"):
        VanillaSeq2SeqConfig(tie_word_embeddings=False, share_encoder_decoder_embeddings=True).check_architecture()
    untied = random_model(share_encoder_decoder_embeddings=False, tie_word_embeddings=False)
    weights = [untied.model.encoder.embeddings.word_embeddings.weight,
               untied.model.decoder.embeddings.word_embeddings.weight, untied.lm_head.decoder.weight]
    assert len({weight.data_ptr() for weight in weights}) == 3


@pytest.mark.parametrize("share", [True, False], ids=["shared-embeddings", "separate-embeddings"])
def test_resizing_the_vocabulary_resizes_source_target_and_output_alike(tmp_path, share):
    model = random_model(share_encoder_decoder_embeddings=share)
    input_ids, attention_mask, labels = digit_batch([6, 3])
    decoder_input_ids = shift_tokens_right(labels, PAD, BOS)
    with torch.no_grad():
        before = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits  # (B, T, 13)
    model.resize_token_embeddings(VOCAB + 7)
    source = model.model.encoder.embeddings.word_embeddings.weight
    target = model.model.decoder.embeddings.word_embeddings.weight
    assert source.shape == target.shape == model.lm_head.decoder.weight.shape == (VOCAB + 7, 32)
    assert model.lm_head.decoder.bias.shape == (VOCAB + 7,)
    assert model.lm_head.decoder.weight.data_ptr() == target.data_ptr()
    assert (source.data_ptr() == target.data_ptr()) is share
    with torch.no_grad():
        after = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits  # (B, T, 20)
    assert_close(after[..., :VOCAB], before)  # the old tokens are untouched (a wider output matmul sums alike)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits, after)


# ---- a reference written the tutorial way ---------------------------------------------------------------------


def _naive_attention(attn, x, memory, allowed):
    """Multi-head attention for one sequence, one head at a time: x (T, E), memory (S, E), allowed (T, S) bool."""
    D = attn.head_dim
    heads = []
    for h in range(attn.num_heads):
        rows = slice(h * D, (h + 1) * D)  # head h owns D rows of each projection
        q = x @ attn.q_proj.weight[rows].T + attn.q_proj.bias[rows]  # (T, D)
        k = memory @ attn.k_proj.weight[rows].T + attn.k_proj.bias[rows]  # (S, D)
        v = memory @ attn.v_proj.weight[rows].T + attn.v_proj.bias[rows]  # (S, D)
        scores = (q @ k.T / math.sqrt(D)).masked_fill(~allowed, float("-inf"))  # (T, S)
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T + attn.o_proj.bias  # (T, E)


def _naive_ffn(ffn, x):
    return torch.relu(x @ ffn.up_proj.weight.T + ffn.up_proj.bias) @ ffn.down_proj.weight.T + ffn.down_proj.bias


def _naive_embed(embeddings, ids):
    E = embeddings.word_embeddings.weight.shape[1]
    pe = torch.tensor([[math.sin(pos / 10000 ** (i / E)) if i % 2 == 0 else math.cos(pos / 10000 ** ((i - 1) / E))
                        for i in range(E)] for pos in range(len(ids))])
    return embeddings.word_embeddings.weight[ids] * math.sqrt(E) + pe


def _naive_logits(model, source, target):
    """The post-LN Transformer of the paper for one unpadded pair: source (S,), target (T,) -> logits (T, V)."""
    encoder, decoder = model.model.encoder, model.model.decoder
    memory = _naive_embed(encoder.embeddings, source)
    everything = torch.ones(len(source), len(source), dtype=torch.bool)
    for layer in encoder.layers:
        memory = layer.self_attn_norm(memory + _naive_attention(layer.self_attn, memory, memory, everything))
        memory = layer.ffn_norm(memory + _naive_ffn(layer.ffn, memory))
    x = _naive_embed(decoder.embeddings, target)
    past = torch.tril(torch.ones(len(target), len(target), dtype=torch.bool))  # query t sees keys 0..t
    source_visible = torch.ones(len(target), len(source), dtype=torch.bool)
    for layer in decoder.layers:
        x = layer.self_attn_norm(x + _naive_attention(layer.self_attn, x, x, past))
        x = layer.cross_attn_norm(x + _naive_attention(layer.cross_attn, x, memory, source_visible))
        x = layer.ffn_norm(x + _naive_ffn(layer.ffn, x))
    return x @ model.lm_head.decoder.weight.T + model.lm_head.decoder.bias


@pytest.mark.numerics
@pytest.mark.parametrize("attn_implementation", ATTENTION)
def test_batched_model_equals_the_head_by_head_reference(attn_implementation):
    model = random_model(attn_implementation)
    input_ids, attention_mask, labels = digit_batch([7, 4, 2])
    decoder_input_ids = shift_tokens_right(labels, PAD, BOS)
    with torch.no_grad():
        logits = model(input_ids, attention_mask, decoder_input_ids=decoder_input_ids).logits
        for i, length in enumerate(attention_mask.sum(1).tolist()):
            target_length = int((labels[i] != -100).sum())
            reference = _naive_logits(model, input_ids[i, :length], decoder_input_ids[i, :target_length])
            assert_close(logits[i, :target_length], reference, msg=f"row {i}")
