"""Input checking and numerical safety.

Bad input must fail with a `ValueError` that names the limit and the offending value, before any kernel runs: an
index kernel would turn it into an opaque error (on GPU, a device-side assert that poisons the process). Every
error test therefore also records the forward calls of every leaf module and asserts that none ran.

Padding must be harmless: a row that is all padding gives finite outputs and leaves the other rows' outputs as
they would be without it, on the padded (eager) and the packed (sdpa and eager without attention maps) paths, and
in float16. Half-precision forward passes of a BERT-sized model never produce NaN/Inf on ordinary text, and stay
within the half-precision rule of tests/numerics.py of the float32 run.
"""

import contextlib
import copy
import re
from pathlib import Path

import pytest
import torch
from numerics import assert_close

import hf_vanilla.transformer as transformer_module
from hf_vanilla.losses import shift_tokens_right
from hf_vanilla.masks import additive_mask
from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForMultipleChoice,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

V, P, TYPES = 50, 16, 2  # vocabulary, position table, token types of the tiny models
B, T = 3, 6

SENTENCES = [
    "The cat sat on the mat.",
    "Transformers replaced recurrence with attention, and the field has not looked back since 2017.",
    "Hi!",
    "A padded batch mixes short and long sentences, so most of this row is padding.",
]


def encoder(attn="eager", model_class=VanillaEncoderModel, **overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=P, type_vocab_size=TYPES, attn_implementation=attn)
    return model_class(VanillaEncoderConfig(**(fields | overrides))).eval()


def seq2seq(attn="eager", **overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=P, pad_token_id=0, eos_token_id=None, attn_implementation=attn)
    return VanillaSeq2SeqForConditionalGeneration(VanillaSeq2SeqConfig(**(fields | overrides))).eval()


def ids(batch=B, length=T, seed=1):
    return torch.randint(1, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def padded_mask(batch=B, length=T):
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length // 2:] = 0  # right padding
    if batch > 2:
        mask[2, :2] = 0  # left padding
    return mask


@contextlib.contextmanager
def no_kernel_runs(model):
    """Record every leaf module's forward (embeddings, projections, norms); assert none ran inside the block."""
    calls = []
    handles = [
        module.register_forward_pre_hook(lambda module, args, name=name: calls.append(name))
        for name, module in model.named_modules() if not list(module.children())
    ]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [], f"modules ran before the input was refused: {calls}"


def assert_refused(model, match, **inputs):
    """`model(**inputs)` raises a ValueError matching every pattern in `match`, before any module runs."""
    with no_kernel_runs(model), pytest.raises(ValueError) as info:
        with torch.no_grad():
            model(**inputs)
    for pattern in [match] if isinstance(match, str) else match:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in: {info.value}"
    return str(info.value)


def test_hook_sees_a_normal_forward():
    """The detector works: a valid forward is recorded (so an empty record in the tests below means something)."""
    model = encoder()
    with pytest.raises(AssertionError, match="encoder.embeddings.word_embeddings"):
        with no_kernel_runs(model):
            model(input_ids=ids())


# ---- token ids ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("bad", [V, V + 7, -1])
@pytest.mark.parametrize("with_mask", [False, True])
def test_input_ids_out_of_range(attn, bad, with_mask):
    model, input_ids = encoder(attn), ids()
    input_ids[1, 2] = bad
    mask = padded_mask() if with_mask else None
    message = assert_refused(model, [rf"input_ids contains {bad}\b", rf"\[0, {V}\)", rf"vocab_size={V}"],
                             input_ids=input_ids, attention_mask=mask)
    assert "tokenizer" in message  # the fix


def test_largest_valid_ids_are_accepted():
    model, input_ids = encoder(), ids()
    input_ids[0, 0], input_ids[0, 1] = V - 1, 0
    token_type_ids = torch.full_like(input_ids, TYPES - 1)
    position_ids = torch.arange(P - T, P).expand(B, T)
    out = model(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
    assert torch.isfinite(out.last_hidden_state).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_input_ids_must_be_integers(dtype):
    assert_refused(encoder(), [r"input_ids must hold integer ids", str(dtype), r"\.long\(\)"],
                   input_ids=ids().to(dtype))


@pytest.mark.parametrize("shape", [(T,), (1, B, T)])
def test_input_ids_must_be_two_dimensional(shape):
    assert_refused(encoder(), [r"input_ids must be \(batch, length\)", re.escape(str(shape))],
                   input_ids=torch.ones(shape, dtype=torch.long))


def test_inputs_embeds_width_is_checked():
    assert_refused(encoder(), [r"inputs_embeds must be", r"embedding_size=16", r"\(3, 6, 8\)"],
                   inputs_embeds=torch.randn(B, T, 8))
    assert_refused(encoder(), r"inputs_embeds must be .* got shape \(6, 16\)", inputs_embeds=torch.randn(T, 16))


def test_exactly_one_of_ids_and_embeds():
    assert_refused(encoder(), "Pass exactly one of input_ids or inputs_embeds")
    assert_refused(encoder(), "Pass exactly one of input_ids or inputs_embeds",
                   input_ids=ids(), inputs_embeds=torch.randn(B, T, 16))


# ---- token types ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("bad", [TYPES, 9, -2])
def test_token_type_ids_out_of_range(attn, bad):
    token_type_ids = torch.zeros(B, T, dtype=torch.long)
    token_type_ids[2, 4] = bad
    assert_refused(encoder(attn), [rf"token_type_ids contains {bad}\b", rf"type_vocab_size={TYPES}"],
                   input_ids=ids(), attention_mask=padded_mask(), token_type_ids=token_type_ids)


def test_token_type_ids_on_a_model_without_types():
    assert_refused(encoder(type_vocab_size=0), [r"no token types \(type_vocab_size=0\)", "drop token_type_ids"],
                   input_ids=ids(), token_type_ids=torch.ones(B, T, dtype=torch.long))


def test_token_type_ids_shape():
    assert_refused(encoder(), [r"token_type_ids has shape \(3, 5\)", r"input_ids has shape \(3, 6\)"],
                   input_ids=ids(), token_type_ids=torch.zeros(B, T - 1, dtype=torch.long))
    assert_refused(encoder(), r"token_type_ids must hold integer ids",
                   input_ids=ids(), token_type_ids=torch.zeros(B, T))


# ---- lengths and positions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("offset", [0, 2])
def test_sequence_longer_than_position_table(attn, offset):
    model = encoder(attn, position_offset=offset)
    longest = P - offset
    out = model(input_ids=ids(length=longest))  # exactly the longest allowed runs
    assert out.last_hidden_state.shape == (B, longest, 16)
    assert_refused(model, [rf"has {longest + 1} tokens", rf"at most {longest}\b", rf"max_position_embeddings={P}",
                           rf"position_offset={offset}", "truncat"],
                   input_ids=ids(length=longest + 1), attention_mask=padded_mask(length=longest + 1))


def test_packed_sequences_each_fit_the_position_table():
    """Sequences told apart by transformers' packed keywords alone (cu_seq_lens, seq_idx; no position_ids) each count
    their positions from their own start: the table must cover the longest sequence, not the row they share."""
    model, input_ids = encoder(), ids(batch=1, length=3 * P)
    for fits, lengths in ((True, [P, P, P]), (False, [P - 1, P + 1, P])):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
        for keywords in (dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu), dict(seq_idx=seq_idx)):
            if fits:
                with torch.no_grad():
                    assert model(input_ids=input_ids, **keywords).last_hidden_state.shape == (1, 3 * P, 16)
            else:
                assert_refused(model, [rf"has {P + 1} tokens", rf"at most {P}\b"], input_ids=input_ids, **keywords)


def test_sinusoidal_positions_have_the_same_limit():
    model = encoder(position_embedding_type="sinusoidal", position_offset=3)
    model(input_ids=ids(length=P - 3))
    assert_refused(model, [r"has 14 tokens", r"at most 13\b"], input_ids=ids(length=P - 2))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("bad", [P, P + 5, -1])
def test_position_ids_out_of_range(attn, bad):
    position_ids = torch.arange(T).expand(B, T).clone()
    position_ids[1, 3] = bad
    assert_refused(encoder(attn), [rf"position_ids contains {bad}\b", rf"max_position_embeddings={P}"],
                   input_ids=ids(), attention_mask=padded_mask(), position_ids=position_ids)


def test_position_ids_shape():
    assert_refused(encoder(), [r"position_ids has shape \(2, 6\)", r"\(1, 6\) shared by every row"],
                   input_ids=ids(), position_ids=torch.arange(T).expand(2, T))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_shared_position_and_token_type_rows(attn):
    """Regression: position_ids/token_type_ids of shape (T,) or (1, T), which BERT accepts, crashed the packed
    path (a reshape to B*T) with an opaque RuntimeError; they now mean the same row for every sequence."""
    model, input_ids, mask = encoder(attn), ids(), padded_mask()
    positions = torch.tensor([3, 1, 4, 1, 5, 9])
    types = torch.tensor([0, 0, 1, 1, 1, 0])
    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=mask, position_ids=positions.expand(B, T),
                     token_type_ids=types.expand(B, T)).last_hidden_state
        for shared in (dict(position_ids=positions, token_type_ids=types),
                       dict(position_ids=positions[None], token_type_ids=types[None])):
            out = model(input_ids=input_ids, attention_mask=mask, **shared).last_hidden_state
            assert_close(out, full)


# ---- attention masks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("shape", [(B, T - 1), (B, T + 1), (B + 1, T), (B, 1, T), (T,)])
def test_attention_mask_shape(attn, shape):
    assert_refused(encoder(attn), [rf"attention_mask has shape {re.escape(str(shape))}",
                                   rf"should be \({B}, {T}\)", "tokenizer's attention_mask"],
                   input_ids=ids(), attention_mask=torch.ones(shape, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int8])
def test_ids_of_a_dtype_no_embedding_takes_are_refused(dtype):
    """Regression: uint8 ids reached the embedding and failed with torch's own message."""
    assert_refused(encoder(), [rf"input_ids must hold integer ids, got dtype {dtype}", r"input_ids\.long\(\)"],
                   input_ids=ids().to(dtype))


def test_a_complex_mask_is_refused():
    """Regression: a complex mask raised NotImplementedError from inside aminmax."""
    assert_refused(encoder(), [r"attention_mask must be bool, integer or float, got torch.complex64"],
                   input_ids=ids(), attention_mask=padded_mask().to(torch.complex64))


def test_a_nan_at_a_padding_position_stays_there():
    """Regression: a NaN in inputs_embeds at a padding position turned the whole row to NaN on the padded path
    (attention maps, eager): padding keys get zero weight, but 0 * NaN is NaN. The packed path never reads it."""
    model, mask = encoder(), padded_mask()
    embeds = model.get_input_embeddings()(ids())
    embeds[1, -1] = float("nan")  # row 1 is right-padded: its last position is padding
    with torch.no_grad():
        padded = model(inputs_embeds=embeds, attention_mask=mask, output_attentions=True).last_hidden_state
        packed = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert torch.isfinite(padded[real]).all() and torch.isfinite(packed[real]).all()
    assert_close(padded[real], packed[real])


@pytest.mark.parametrize("shape", [(B, 1, T, T + 1), (B, 2, T, T), (B + 1, 1, T, T), (B, 1, 2, T)])
def test_4d_attention_mask_shape(shape):
    assert_refused(encoder(), [r"A 4-D attention_mask must be \(batch, 1, query length, key length\)",
                               re.escape(f"({B}, 1, {T}, {T})"), re.escape(str(shape))],
                   input_ids=ids(), attention_mask=torch.ones(shape, dtype=torch.bool))


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_4d_attention_mask_is_used_as_given(attn):
    """A 4-D mask (as transformers' mask utilities build them) is the caller's final word: bool, 1/0 or additive,
    per query or broadcast over queries, it gives what the equivalent 2-D padding mask gives at real tokens."""
    model, input_ids, mask = encoder(attn), ids(), padded_mask()
    real = mask.bool()
    keys = real[:, None, None, :]  # (B, 1, 1, S)
    additive = torch.zeros(B, 1, T, T).masked_fill(~keys, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        for four_d in (keys, keys.expand(B, 1, T, T).long(), additive):
            got = model(input_ids=input_ids, attention_mask=four_d).last_hidden_state
            assert_close(got[real], expected[real])


@pytest.mark.parametrize("value", [2, -1, 0.5])
def test_attention_mask_values(value):
    """Regression: a mask of 2s was accepted; the padded path turned it into +finfo.max (NaN after softmax) while
    the packed path read it as 1."""
    mask = padded_mask()
    mask = mask.float() if isinstance(value, float) else mask
    mask[0, 1] = value
    assert_refused(encoder(), [r"attention_mask must hold 1 \(token\) or 0 \(padding\)", rf"got {value}\b"],
                   input_ids=ids(), attention_mask=mask)


@pytest.mark.numerics
def test_bool_and_float_masks_equal_integer_masks():
    """Bit for bit: every mask dtype becomes the same gather of real tokens, then the same kernels run."""
    model, input_ids, mask = encoder("sdpa"), ids(), padded_mask()
    with torch.no_grad():
        reference = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        for other in (mask.bool(), mask.float()):
            assert torch.equal(model(input_ids=input_ids, attention_mask=other).last_hidden_state, reference)


# ---- empty batches --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, T), (B, 0), (0, 0)])
def test_empty_batch(shape):
    assert_refused(encoder(), [r"empty batch", re.escape(str(shape))], input_ids=torch.zeros(shape, dtype=torch.long),
                   attention_mask=torch.ones(shape, dtype=torch.long))
    assert_refused(encoder(), r"empty batch", inputs_embeds=torch.zeros(*shape, 16))


def test_empty_decoder_input():
    model = seq2seq()
    with pytest.raises(ValueError, match=r"empty batch of shape \(3, 0\)"):
        model(input_ids=ids(), decoder_input_ids=torch.zeros(B, 0, dtype=torch.long))


# ---- the encoder-decoder --------------------------------------------------------------------------------------


def test_seq2seq_source_errors_stop_before_any_module():
    model, source = seq2seq(), ids()
    source[0, 0] = V + 3
    assert_refused(model, [rf"input_ids contains {V + 3}\b", rf"vocab_size={V}"],
                   input_ids=source, decoder_input_ids=ids(length=4))
    assert_refused(model, r"attention_mask has shape \(3, 5\)",
                   input_ids=ids(), attention_mask=torch.ones(B, T - 1), decoder_input_ids=ids(length=4))
    assert_refused(model, [r"has 17 tokens", rf"at most {P}\b"], input_ids=ids(length=P + 1),
                   decoder_input_ids=ids(length=4))


def decoder_refused(model, match, **inputs):
    """Given `encoder_outputs`, the decoder refuses before any decoder module runs."""
    with no_kernel_runs(model.model.decoder), pytest.raises(ValueError) as info:
        with torch.no_grad():
            model(**inputs)
    for pattern in match:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in: {info.value}"
    return str(info.value)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("bad", [V, V + 11, -1])
def test_decoder_input_ids_out_of_range(attn, bad):
    target = ids(length=4)
    target[1, 3] = bad
    # The target is checked before the source is encoded: not even the encoder runs.
    assert_refused(seq2seq(attn), [rf"decoder_input_ids contains {bad}\b", rf"vocab_size={V}"],
                   input_ids=ids(), attention_mask=padded_mask(), decoder_input_ids=target)


def test_decoder_too_long():
    model = seq2seq(position_offset=1)
    assert_refused(model, [r"decoder sequence .* has 16 tokens", r"at most 15\b", r"position_offset=1",
                           "max_new_tokens"], input_ids=ids(), decoder_input_ids=ids(length=P))


def test_generate_past_the_position_table_is_refused():
    model = seq2seq()
    # The start token + 16 new ones: the last step reads 16 positions, exactly the table.
    out = model.generate(input_ids=ids(), attention_mask=padded_mask(), max_new_tokens=P, do_sample=False)
    assert out.shape == (B, P + 1)
    with pytest.raises(ValueError, match=rf"has {P + 1} tokens but the position table allows at most {P}\b"):
        model.generate(input_ids=ids(), attention_mask=padded_mask(), max_new_tokens=P + 1, do_sample=False)


def test_decoder_attention_mask_shape_and_values():
    model = seq2seq()
    assert_refused(model, [r"decoder_attention_mask has shape \(3, 3\)", r"should be \(3, 4\)"],
                   input_ids=ids(), decoder_input_ids=ids(length=4), decoder_attention_mask=torch.ones(B, 3))
    assert_refused(model, [r"decoder_attention_mask must hold 1 \(token\) or 0 \(padding\), got 3"],
                   input_ids=ids(), decoder_input_ids=ids(length=4),
                   decoder_attention_mask=torch.full((B, 4), 3))


def test_decoder_needs_an_input():
    model = seq2seq()
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(ids())
    decoder_refused(model, [r"Pass exactly one of decoder_input_ids or decoder_inputs_embeds \(or labels"],
                    encoder_outputs=encoder_outputs)


def test_without_a_target_the_decoder_reads_the_source_shifted_right():
    """BART's convention, which the encoder-decoder's classification and QA heads rely on."""
    model, source = seq2seq(), ids()
    config = model.config
    with torch.no_grad():
        implicit = model(input_ids=source).logits
        explicit = model(input_ids=source, decoder_input_ids=shift_tokens_right(
            source, config.pad_token_id, config.decoder_start_token_id)).logits
    assert torch.equal(implicit, explicit)


def test_encoder_outputs_must_match_the_target_batch_and_the_mask():
    model = seq2seq()
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(ids())
    decoder_refused(model, [r"decoder_input_ids has 2 rows but the encoder output has 3"],
                    encoder_outputs=encoder_outputs, decoder_input_ids=ids(batch=2, length=4))
    for shape in [(B, T - 2), (1, T)]:
        decoder_refused(model, [rf"attention_mask has shape {re.escape(str(shape))}",
                                rf"encoder output covers \({B}, {T}\)"],
                        encoder_outputs=encoder_outputs, attention_mask=torch.ones(shape, dtype=torch.long),
                        decoder_input_ids=ids(length=4))


def bart_and_ours():
    """A randomised transformers BartForConditionalGeneration and ours converted from it (sharing its tensors)."""
    from transformers import BartConfig, BartForConditionalGeneration

    from hf_vanilla.conversion.formats import bart

    config = BartConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=P,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    reference = BartForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the default init: attention far from uniform, outputs of order 1
        for name, parameter in reference.named_parameters():
            if "norm" not in name:
                parameter.normal_(std=0.15)
    ours = bart.FORMAT.to_vanilla(reference.state_dict(), config.to_dict(), "BartForConditionalGeneration")
    return reference, ours.eval()


def shared_prefix_mask():
    """transformers' custom 4-D mask test: a prefix of 3 tokens and three endings, each ending reading the prefix and
    itself alone (causally), as one additive (1, 1, 6, 6) mask."""
    allowed = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    allowed[4, 3] = allowed[5, 3] = allowed[5, 4] = False
    return (~allowed).float()[None, None] * torch.finfo(torch.float32).min


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_custom_4d_mask_reaches_cross_attention_as_in_bart(attn):
    """A custom 4-D attention_mask is a valid input to the encoder-decoder, as to transformers' models: the encoder
    attends as it says, and cross-attention reads it as given, target position t its row t, as BART passes it on.
    Ours gives BartForConditionalGeneration's encoder states and logits on the same weights. With the position_ids
    of transformers' own test ([[0, 1, 2, 3, 3, 3]]: positions, not packed boundaries) each ending's encoder state
    is the one its sequence gets alone under its causal mask."""
    reference, ours = bart_and_ours()
    reference.set_attn_implementation(attn)
    ours.set_attn_implementation(attn)
    prefix, endings = torch.tensor([10, 11, 12]), torch.tensor([13, 14, 15])
    input_ids, mask = torch.cat([prefix, endings])[None], shared_prefix_mask()
    with torch.no_grad():
        expected = reference(input_ids=input_ids, attention_mask=mask)
        got = ours(input_ids=input_ids, attention_mask=mask)
        assert_close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state, msg="encoder states")
        assert_close(got.logits, expected.logits, msg="logits")

        shared = ours(input_ids=input_ids, attention_mask=mask, position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]]))
        for i, ending in enumerate(endings):
            alone = ours(input_ids=torch.cat([prefix, ending[None]])[None], attention_mask=mask[..., :4, :4])
            assert_close(shared.encoder_last_hidden_state[0, 3 + i], alone.encoder_last_hidden_state[0, 3],
                         msg=f"ending {i}")


def test_a_4d_source_mask_must_fit_cross_attention():
    """Cross-attention reads a 4-D source mask row by row for the target's positions: a target of another length
    than the mask's rows is refused, naming the shapes, before the decoder runs; a real mismatch of the source is
    still refused."""
    model = seq2seq()
    mask = shared_prefix_mask()
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(ids(batch=1), attention_mask=mask)
    decoder_refused(model, [r"4-D attention_mask of shape \(1, 1, 6, 6\) reaches cross-attention",
                            r"\(1, 1, 4, 6\)"],
                    encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=ids(batch=1, length=4))
    decoder_refused(model, [r"\(1, 1, 6, 5\)"], encoder_outputs=encoder_outputs, attention_mask=mask[..., :5],
                    decoder_input_ids=ids(batch=1))
    with torch.no_grad():  # a target as long as the source reads the mask as given
        model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=ids(batch=1))


def test_encoder_outputs_as_a_tuple():
    """As from `return_dict=False` or an exported encoder: (last_hidden_state, ...) is read like the dataclass."""
    model, target = seq2seq(), ids(length=4)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(ids(), padded_mask())
        expected = model(encoder_outputs=encoder_outputs, attention_mask=padded_mask(), decoder_input_ids=target)
        for as_tuple in [(encoder_outputs.last_hidden_state,), (encoder_outputs.last_hidden_state, None, None)]:
            out = model(encoder_outputs=as_tuple, attention_mask=padded_mask(), decoder_input_ids=target)
            assert torch.equal(out.logits, expected.logits)
            assert torch.equal(out.encoder_last_hidden_state, encoder_outputs.last_hidden_state)


def test_seq2seq_token_type_ids_out_of_range():
    """A bert2bert-style encoder-decoder with segments checks the source's token types like the encoder does."""
    model, token_type_ids = seq2seq(type_vocab_size=TYPES), torch.zeros(B, T, dtype=torch.long)
    model(input_ids=ids(), token_type_ids=token_type_ids, decoder_input_ids=ids(length=4))  # valid: runs
    token_type_ids[0, 5] = TYPES
    assert_refused(model, [rf"token_type_ids contains {TYPES}\b", rf"type_vocab_size={TYPES}"],
                   input_ids=ids(), token_type_ids=token_type_ids, decoder_input_ids=ids(length=4))


def test_seq2seq_token_type_ids_without_types():
    assert_refused(seq2seq(), "no token types", input_ids=ids(), decoder_input_ids=ids(length=4),
                   token_type_ids=torch.ones(B, T, dtype=torch.long))


# ---- labels ---------------------------------------------------------------------------------------------------
# A loss indexes its logits with class labels: an out-of-range label is a device-side assert on GPU. Refused before
# the model runs; -100 (ignored) is valid anywhere.


def head(model_class, **overrides):
    """The tiny encoder under a task head, with three labels unless told otherwise."""
    return encoder(model_class=model_class, **({"num_labels": 3} | overrides))


LABEL_CASES = [  # model, label shape, number of classes, the config field that sets it
    (lambda: head(VanillaEncoderForMaskedLM), (B, T), V, "vocab_size"),
    (lambda: head(VanillaEncoderForTokenClassification), (B, T), 3, "num_labels"),
    (lambda: head(VanillaEncoderForSequenceClassification), (B,), 3, "num_labels"),
    (lambda: seq2seq(), (B, 4), V, "vocab_size"),
]


@pytest.mark.parametrize("case", range(len(LABEL_CASES)))
@pytest.mark.parametrize("bad", ["high", -1, -99])
def test_labels_out_of_range(case, bad):
    make, shape, classes, field = LABEL_CASES[case]
    bad = classes + 4 if bad == "high" else bad
    labels = torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(0))
    labels.view(-1)[-1] = bad  # the last label: in seq2seq it is not shifted into the decoder's input
    inputs = dict(input_ids=ids(), labels=labels)
    assert_refused(make(), [rf"labels contains {bad}\b", rf"\[0, {classes}\)", rf"{field}={classes}\b", "-100"],
                   **inputs)
    labels.view(-1)[-1] = -100  # ignored: valid
    assert torch.isfinite(make()(**inputs).loss)


def test_label_dtype_and_non_class_targets():
    with pytest.raises(ValueError, match=r"labels must hold integer ids, got dtype torch.float32"):
        head(VanillaEncoderForMaskedLM)(input_ids=ids(), labels=ids().float())
    # Regression and multi-label targets are not class ids: any float is valid.
    regression = head(VanillaEncoderForSequenceClassification, num_labels=1)
    assert torch.isfinite(regression(input_ids=ids(), labels=torch.tensor([-100.0, 7.5, 3.0])).loss)
    multi_label = head(VanillaEncoderForSequenceClassification, problem_type="multi_label_classification")
    assert torch.isfinite(multi_label(input_ids=ids(), labels=torch.rand(B, 3)).loss)


def test_multiple_choice_refuses_a_batch_without_choices_and_labels_past_the_last_choice():
    model = head(VanillaEncoderForMultipleChoice)
    assert_refused(model, [r"shape \(batch, choices, length\)", "one row per choice"], input_ids=ids())
    choices = ids(batch=B * 2).view(B, 2, T)  # (B, C=2, T)
    assert_refused(model, [r"labels contains 2\b", r"\[0, 2\)", "the number of choices=2"], input_ids=choices,
                   labels=torch.tensor([0, 1, 2]))
    out = model(input_ids=choices, labels=torch.tensor([0, 1, 1]))
    assert out.logits.shape == (B, 2) and torch.isfinite(out.loss)


def test_multiple_choice_refuses_per_choice_inputs_of_another_shape():
    """A (choices, batch, T), (batch * choices, T) or (batch, T) mask or token-type tensor would be reshaped onto
    the wrong rows without complaint."""
    model, C = head(VanillaEncoderForMultipleChoice), 2
    choices = ids(batch=B * C).view(B, C, T)
    for name in ("attention_mask", "token_type_ids"):
        for shape in [(C, B, T), (B * C, T), (B, T)]:
            assert_refused(model, [rf"{name} has shape {re.escape(str(shape))}",
                                   rf"choices are \({B}, {C}, {T}\)", "one row per choice"],
                           input_ids=choices, **{name: torch.ones(shape, dtype=torch.long)})
    out = model(input_ids=choices, attention_mask=torch.ones(B, C, T, dtype=torch.long))
    assert out.logits.shape == (B, C)


def test_head_targets_of_the_wrong_kind_are_refused():
    """Raw tracebacks where a one-line error belongs: float QA positions, mis-shaped ELECTRA labels."""
    from hf_vanilla import VanillaEncoderForQuestionAnswering, VanillaEncoderForReplacedTokenDetection

    qa = head(VanillaEncoderForQuestionAnswering)
    assert_refused(qa, [r"start_positions must hold integer ids, got dtype torch.float32"], input_ids=ids(),
                   start_positions=torch.tensor([1.0, 2.0, 3.0]), end_positions=torch.tensor([2, 3, 4]))
    assert_refused(qa, [r"end_positions has shape \(2,\)", r"one token index per sequence, \(3,\)"],
                   input_ids=ids(), start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([2, 3]))
    assert torch.isfinite(qa(input_ids=ids(), start_positions=torch.tensor([1, 2, 3]),
                             end_positions=torch.tensor([[2], [3], [4]])).loss)  # (B, 1), as transformers takes
    rtd = head(VanillaEncoderForReplacedTokenDetection)
    assert_refused(rtd, [r"labels has shape \(3, 5\) but should be \(3, 6\)", "one label per token"],
                   input_ids=ids(), labels=torch.zeros(B, T - 1, dtype=torch.long))
    assert_refused(rtd, [r"labels must hold 0 or 1 at every real token, got 2"], input_ids=ids(),
                   labels=torch.full((B, T), 2))
    assert torch.isfinite(rtd(input_ids=ids(), labels=torch.randint(0, 2, (B, T))).loss)
    # -100 at padding, as DataCollatorForTokenClassification writes it: taken, and the loss reads real tokens only.
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    labels = torch.randint(0, 2, (B, T))
    with torch.no_grad():
        expected = rtd(input_ids=ids(), attention_mask=mask, labels=labels).loss
        assert_close(rtd(input_ids=ids(), attention_mask=mask, labels=labels.masked_fill(mask == 0, -100)).loss,
                     expected)
    assert_refused(rtd, [r"labels must hold 0 or 1 at every real token, got -100"], input_ids=ids(),
                   attention_mask=mask, labels=labels.masked_fill(mask == 1, -100))


def test_inputs_of_the_wrong_kind_are_refused():
    """float64 embeddings for float32 weights, encoder outputs of another width, a mask with no values (meta), a
    sequence classifier's decoder shorter than its source: one-line errors, before any kernel runs."""
    from hf_vanilla import VanillaSeq2SeqForSequenceClassification

    model = encoder()
    embeds = model.get_input_embeddings()(ids()).double()
    assert_refused(model, [r"inputs_embeds has dtype torch.float64 but the model's weights are torch.float32",
                           r"inputs_embeds.to\(torch.float32\)"], inputs_embeds=embeds)
    assert_refused(model, [r"attention_mask is on the meta device", "holds shapes but no values"], input_ids=ids(),
                   attention_mask=torch.ones(B, T, dtype=torch.long, device="meta"))
    generator = seq2seq()
    decoder_refused(generator, [r"encoder output has shape \(3, 6, 8\)", r"hidden_size=16", "get_encoder"],
                    encoder_outputs=(torch.zeros(B, T, 8),), decoder_input_ids=ids(length=4))
    torch.manual_seed(0)
    classifier = VanillaSeq2SeqForSequenceClassification(VanillaSeq2SeqConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=P, pad_token_id=0, eos_token_id=2, num_labels=3)).eval()
    source = ids()
    source[:, -1] = 2
    assert_refused(classifier, [r"decoder input has shape \(3, 4\) but input_ids \(3, 6\)",
                                "leave decoder_input_ids out"], input_ids=source, decoder_input_ids=ids(length=4))
    assert classifier(input_ids=source).logits.shape == (B, 3)


def test_a_legacy_tuple_cache_is_refused_naming_the_cache_that_takes_it():
    """A cache as transformers 4 returned it, a tuple of per-layer tensors, failed inside the stack with "'tuple' object
    has no attribute 'get_seq_length'" (as transformers 5's own models do): refused under either name, naming the
    Cache to wrap it in, which then gives the answer the Cache object gave."""
    from transformers import DynamicCache, EncoderDecoderCache

    from hf_vanilla.compat import CACHE_FIELD
    from hf_vanilla.modeling_decoder import VanillaDecoderForCausalLM

    generator = seq2seq()
    decoder = VanillaDecoderForCausalLM(generator.config).eval()
    source, prefix, step = ids(), ids(length=3), ids(length=1)
    for model, legacy_of, wrap, inputs in [
        (generator, lambda cache: tuple((self.keys, self.values, cross.keys, cross.values) for self, cross in
                                        zip(cache.self_attention_cache.layers, cache.cross_attention_cache.layers)),
         EncoderDecoderCache, {"input_ids": source}),
        (decoder, lambda cache: tuple((layer.keys, layer.values) for layer in cache.layers), DynamicCache, {}),
    ]:
        def run(tokens, **cache):
            key = "decoder_input_ids" if model is generator else "input_ids"
            return model(**inputs, **{key: tokens}, use_cache=True, **cache)

        with torch.no_grad():
            legacy = legacy_of(getattr(run(prefix), CACHE_FIELD))
            for name in ("past_key_values", "cache"):
                with pytest.raises(ValueError, match=rf"^{name} is a tuple of per-layer tensors, the legacy cache "
                                                     rf"format, .*transformers\.DynamicCache\({name}\).*"
                                                     rf"EncoderDecoderCache\({name}\)"):
                    run(step, **{name: legacy})
            full = torch.cat([prefix, step], dim=1)
            assert_close(run(step, past_key_values=wrap(legacy)).logits[:, -1], run(full).logits[:, -1])


@pytest.mark.numerics
def test_pooled_heads_read_a_left_padded_row_as_transformers_bert_does():
    """Position 0 of a left-padded row is padding. transformers' BERT pools what its layers computed there, and so
    must every path of ours: the padding-free path used to leave it at zero, giving every left-padded row
    the classifier's bias alone, while the attention-map path gave BERT's logits."""
    from transformers import BertConfig, BertForSequenceClassification

    from hf_vanilla.conversion.formats.bert import bert_to_vanilla

    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=P, num_labels=3, attn_implementation="eager")).eval()
    ours = bert_to_vanilla(bert.state_dict(), bert.config.to_dict(), "sequence-classification").eval()
    input_ids, mask = ids(), padded_mask()  # row 1 right-padded, row 2 left-padded
    with torch.no_grad():
        expected = bert(input_ids=input_ids, attention_mask=mask).logits
        default = ours(input_ids=input_ids, attention_mask=mask).logits
        with_maps = ours(input_ids=input_ids, attention_mask=mask, output_attentions=True).logits
    assert (expected[2] - ours.classifier.bias).abs().max() > 1e-2  # the left-padded row is not the bias alone
    assert_close(default, expected, msg="default path against BERT")
    assert_close(with_maps, expected, msg="attention-map path against BERT")


# ---- all-padding rows -----------------------------------------------------------------------------------------


def with_blank_row(input_ids, mask, row=1):
    """The batch with one more row at `row` that is all padding (its ids are pad ids)."""
    blank = torch.zeros(1, input_ids.shape[1], dtype=input_ids.dtype)
    return (torch.cat([input_ids[:row], blank, input_ids[row:]]),
            torch.cat([mask[:row], torch.zeros_like(blank), mask[row:]]))


def others(x, row=1):
    return torch.cat([x[:row], x[row + 1:]])


@pytest.mark.numerics
@pytest.mark.parametrize("attn, output_attentions", [("eager", True), ("eager", False), ("sdpa", False)],
                         ids=["eager-padded", "eager-packed", "sdpa-packed"])
def test_all_padding_row_is_finite_and_isolated(attn, output_attentions):
    model, input_ids, mask = encoder(attn), ids(), padded_mask()
    batch, batch_mask = with_blank_row(input_ids, mask)
    with torch.no_grad():
        reference = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                          output_attentions=output_attentions)
        out = model(input_ids=batch, attention_mask=batch_mask, output_hidden_states=True,
                    output_attentions=output_attentions)
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    real = mask.bool()
    for layer, (ours, ref) in enumerate(zip(out.hidden_states, reference.hidden_states, strict=True)):
        assert torch.isfinite(ours).all()
        assert_close(others(ours)[real], ref[real], msg=f"layer {layer}")
    if output_attentions:
        for weights in out.attentions:
            assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


@pytest.mark.parametrize("attn, output_attentions", [("eager", True), ("eager", False), ("sdpa", False)])
def test_batch_of_nothing_but_padding(attn, output_attentions):
    """Regression: a batch whose every row is padding crashed the packed path (torch.cat of no sequences)."""
    model = encoder(attn)
    with torch.no_grad():
        out = model(input_ids=torch.zeros(2, T, dtype=torch.long), attention_mask=torch.zeros(2, T, dtype=torch.long),
                    output_attentions=output_attentions)
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()


def force_very_negative_scores(model):
    """Make every attention score about -45 (q = 4, k = -4 in every feature): in float16, -45 + finfo.min
    overflows to -inf, so a query whose keys are all masked would get a softmax of NaN."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, transformer_module.VanillaAttention):
                module.q_proj.weight.zero_()
                module.k_proj.weight.zero_()
                module.q_proj.bias.fill_(4.0)
                module.k_proj.bias.fill_(-4.0)
    return model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_padding_row_in_half_precision_padded_path(dtype):
    """Regression: in float16 the padded path's mask (score + finfo.min) overflowed to -inf for every key of an
    all-padding row, and that row's attention weights became NaN. Fully masked rows now attend everywhere."""
    model = force_very_negative_scores(encoder("eager")).to(dtype)
    batch, batch_mask = with_blank_row(ids(), padded_mask())
    with torch.no_grad():
        out = model(input_ids=batch, attention_mask=batch_mask, output_attentions=True)
    assert all(torch.isfinite(w).all() for w in out.attentions)
    assert torch.isfinite(out.last_hidden_state).all()


def test_additive_mask_opens_fully_masked_rows_only():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    additive = additive_mask(mask[:, None, None, :], torch.float16)
    low = torch.finfo(torch.float16).min
    assert additive[0, 0, 0].tolist() == [0, 0, low]
    assert additive[1, 0, 0].tolist() == [0, 0, 0]


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_seq2seq_all_padding_source_row(attn, dtype):
    """A source row that is all padding: cross-attention has nothing to read; the logits stay finite, and the
    other rows' logits are those of the batch without it."""
    model = seq2seq(attn)
    if dtype == torch.float16:
        force_very_negative_scores(model)
    model = model.to(dtype)
    source, mask = ids(), padded_mask()
    target = ids(length=4, seed=2)
    batch, batch_mask = with_blank_row(source, mask)
    batch_target = torch.cat([target[:1], target[:1], target[1:]])
    with torch.no_grad():
        reference = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        out = model(input_ids=batch, attention_mask=batch_mask, decoder_input_ids=batch_target).logits
    assert torch.isfinite(out).all()
    assert_close(others(out), reference)  # at the rule for the model's dtype


@pytest.mark.numerics
def test_decoder_all_padding_row():
    model = seq2seq()
    source, mask = ids(), padded_mask()
    target, target_mask = ids(length=4, seed=2), torch.ones(B, 4, dtype=torch.long)
    with torch.no_grad():
        reference = model(input_ids=source, attention_mask=mask, decoder_input_ids=target,
                          decoder_attention_mask=target_mask).logits
        target_mask[1] = 0
        out = model(input_ids=source, attention_mask=mask, decoder_input_ids=target,
                    decoder_attention_mask=target_mask).logits
    assert torch.isfinite(out).all()
    assert_close(others(out), others(reference))


# ---- half precision on real text ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_batch(minilm_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    return dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))


@pytest.fixture(scope="module")
def minilm(minilm_path):
    from hf_vanilla.conversion.formats.bert import bert_to_vanilla
    from hf_vanilla.conversion.io.reading import load_tensors, read_config

    return bert_to_vanilla(load_tensors(Path(minilm_path)), read_config(Path(minilm_path)), "base")


def assert_half_precision_close(model, batch, reference, dtype, path):
    """Every hidden state finite at every position, and at real tokens within the half-precision rule of the float32
    `reference` (tests/numerics.py)."""
    attn, output_attentions = PATHS[path]
    model = copy.deepcopy(model).to(dtype)  # a copy: rounding the shared float32 weights would spoil the references
    model.set_attn_implementation(attn)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True, output_attentions=output_attentions)
    for i, (ours, ref) in enumerate(zip(out.hidden_states, reference.hidden_states, strict=True)):
        assert torch.isfinite(ours).all(), f"non-finite values in layer {i} ({dtype}, {path})"
        assert_close(ours.float()[real], ref[real], dtype=dtype, msg=f"layer {i} ({dtype}, {path})")
    assert torch.isfinite(out.pooler_output).all()
    if output_attentions:
        assert all(torch.isfinite(weights).all() for weights in out.attentions)


# The padded path (eager with attention maps) adds the mask to the scores; the packed path never forms them.
PATHS = {"eager-padded": ("eager", True), "sdpa-packed": ("sdpa", False)}


def float32_reference(model, batch):
    with torch.no_grad():
        return model(**batch, output_hidden_states=True)


@pytest.fixture(scope="module")
def minilm_reference(minilm, text_batch):
    return float32_reference(minilm, text_batch)


@pytest.fixture(scope="module")
def bert_base():
    """bert-base sizes (the VanillaEncoderConfig defaults: 12 layers, 768 wide, 30522 tokens), random init."""
    torch.manual_seed(0)
    return VanillaEncoderModel(VanillaEncoderConfig(attn_implementation="sdpa")).eval()


@pytest.fixture(scope="module")
def bert_base_reference(bert_base, text_batch):
    return float32_reference(bert_base, text_batch)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_minilm_half_precision_on_text(minilm, text_batch, minilm_reference, dtype, path):
    """The real all-MiniLM-L6-v2 weights, converted, on a padded batch of tokenized sentences."""
    assert_half_precision_close(minilm, text_batch, minilm_reference, dtype, path)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bert_base_shaped_half_precision_on_text(bert_base, text_batch, bert_base_reference, dtype, path):
    assert_half_precision_close(bert_base, text_batch, bert_base_reference, dtype, path)
