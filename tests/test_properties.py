"""Property-based tests (hypothesis): random small configurations and random padded inputs.

1. BERT parity: any small BERT (depth, width, heads, FFN width, activation, token types, epsilon), converted with
   `hf_vanilla.conversion.formats.bert.bert_to_vanilla`, gives every layer's hidden states within the float32 rule of
   tests/numerics.py of transformers' BertModel at the real tokens of any padded batch (right, left or holed
   masks), for eager and sdpa attention.
2. The encoder-decoder: greedy `generate` with the key/value cache equals `generate` without it; save_pretrained ->
   from_pretrained reproduces the weights exactly and the logits within the float32 rule; a decoder position never
   sees a later token (exactly in float64, within the rule in float32).

Example counts are modest (the whole file runs in about a minute on two cores); `HF_VANILLA_THOROUGH=1`
runs ten times as many. Inputs that once found a bug are kept below as plain regression tests.
"""

import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import assert_close
from transformers import BertConfig, BertModel

from hf_vanilla.conversion.formats.bert import bert_to_vanilla
from hf_vanilla import VanillaSeq2SeqConfig, VanillaSeq2SeqForConditionalGeneration

# Set here rather than as a global profile, so that other test files keep their own settings.
# HF_VANILLA_THOROUGH=1 runs ten times as many examples.
SCALE = 10 if os.environ.get("HF_VANILLA_THOROUGH") == "1" else 1


def examples(n):
    return settings(max_examples=n * SCALE, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

BERT_ACTIVATIONS = ("gelu", "relu", "gelu_new", "silu")


# ---- strategies -----------------------------------------------------------------------------------------------


@st.composite
def widths_and_heads(draw):
    hidden = draw(st.sampled_from([16, 24, 32, 48, 64]))
    heads = draw(st.sampled_from([h for h in (1, 2, 3, 4, 8) if hidden % h == 0]))
    return hidden, heads


@st.composite
def bert_configs(draw):
    hidden, heads = draw(widths_and_heads())
    return BertConfig(
        vocab_size=draw(st.integers(8, 120)),
        hidden_size=hidden,
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads,
        intermediate_size=draw(st.integers(8, 160)),
        hidden_act=draw(st.sampled_from(BERT_ACTIVATIONS)),
        max_position_embeddings=draw(st.integers(12, 40)),
        type_vocab_size=draw(st.integers(1, 3)),  # BertConfig needs >= 1; 0 (no types) is tested in test_inputs
        layer_norm_eps=draw(st.sampled_from([1e-12, 1e-7, 1e-5, 1e-3])),
        initializer_range=draw(st.sampled_from([0.02, 0.2])),
        pad_token_id=0,
    )


@st.composite
def masks(draw, batch, length):
    """(batch, length) 1/0 masks, each row right-padded, left-padded or with holes, and at least one real token."""
    rows = []
    for _ in range(batch):
        kind = draw(st.sampled_from(["full", "right", "left", "holes"]))
        real = draw(st.integers(1, length))
        if kind == "full":
            row = [1] * length
        elif kind == "right":
            row = [1] * real + [0] * (length - real)
        elif kind == "left":
            row = [0] * (length - real) + [1] * real
        else:
            row = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
            row[draw(st.integers(0, length - 1))] = 1
        rows.append(row)
    return torch.tensor(rows)


@st.composite
def bert_cases(draw):
    config = draw(bert_configs())
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, config.max_position_embeddings))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    inputs = dict(
        input_ids=torch.randint(0, config.vocab_size, (batch, length), generator=generator),
        token_type_ids=torch.randint(0, config.type_vocab_size, (batch, length), generator=generator),
        attention_mask=draw(masks(batch, length)),
    )
    return config, seed, inputs


@st.composite
def seq2seq_configs(draw):
    hidden, heads = draw(widths_and_heads())
    decoder_heads = draw(st.sampled_from([h for h in (1, 2, 4) if hidden % h == 0]))
    position = draw(st.sampled_from(["learned", "sinusoidal"]))
    return VanillaSeq2SeqConfig(
        vocab_size=draw(st.integers(12, 60)),
        hidden_size=hidden,
        num_hidden_layers=draw(st.integers(1, 2)),
        num_attention_heads=heads,
        intermediate_size=draw(st.integers(8, 96)),
        decoder_layers=draw(st.integers(1, 2)),
        decoder_attention_heads=decoder_heads,
        decoder_intermediate_size=draw(st.integers(8, 96)),
        hidden_act=draw(st.sampled_from(["relu", "gelu", "silu"])),
        max_position_embeddings=32,
        position_embedding_type=position,
        sinusoidal_layout=draw(st.sampled_from(["interleaved", "concatenated"])),
        pre_norm=draw(st.booleans()),
        scale_embeddings=draw(st.booleans()),
        embedding_layer_norm=draw(st.booleans()),
        # Shared source/target embeddings imply a tied output projection (the config refuses the other mix).
        **draw(st.sampled_from([dict(share_encoder_decoder_embeddings=True, tie_word_embeddings=True),
                                dict(share_encoder_decoder_embeddings=False, tie_word_embeddings=True),
                                dict(share_encoder_decoder_embeddings=False, tie_word_embeddings=False)])),
        # Wide enough weights that the greedy choice is never a near-tie decided by rounding.
        initializer_range=0.3,
        pad_token_id=0,
        bos_token_id=1,
        decoder_start_token_id=1,
        eos_token_id=draw(st.sampled_from([None, 2])),
        attn_implementation=draw(st.sampled_from(["eager", "sdpa"])),
    )


@st.composite
def seq2seq_cases(draw):
    config = draw(seq2seq_configs())
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 10))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(3, config.vocab_size, (batch, length), generator=generator)
    mask = draw(masks(batch, length))
    return config, seed, dict(input_ids=source.masked_fill(mask == 0, 0), attention_mask=mask)


def seq2seq_model(config, seed):
    torch.manual_seed(seed)
    return VanillaSeq2SeqForConditionalGeneration(config).eval()


# ---- 1. BERT parity -------------------------------------------------------------------------------------------


def bert_pair(config: BertConfig, seed: int, attn: str):
    """A random BertModel and its conversion (which shares its tensors), both using `attn` attention."""
    torch.manual_seed(seed)
    bert = BertModel(config).eval()
    bert.set_attn_implementation(attn)
    ours = bert_to_vanilla(bert.state_dict(), config.to_dict(), "base")
    ours.set_attn_implementation(attn)
    return bert, ours


def assert_bert_parity(config, seed, inputs, attn):
    bert, ours = bert_pair(config, seed, attn)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = bert(**inputs, output_hidden_states=True)
        actual = ours(**inputs, output_hidden_states=True)
    assert len(actual.hidden_states) == config.num_hidden_layers + 1
    for layer, (ref, out) in enumerate(zip(expected.hidden_states, actual.hidden_states, strict=True)):
        assert_close(out[real], ref[real], msg=f"layer {layer} at real tokens ({attn})")
    if real.all():  # the pooler reads token 0, which is real only when the row starts with a token
        assert_close(actual.pooler_output, expected.pooler_output, msg="pooler")


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@examples(20)
@given(case=bert_cases())
def test_random_bert_matches_transformers_layer_by_layer(attn, case):
    config, seed, inputs = case
    assert_bert_parity(config, seed, inputs, attn)


# ---- 2. the encoder-decoder -----------------------------------------------------------------------------------


def greedy(model, inputs, use_cache):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=8, do_sample=False, num_beams=1, use_cache=use_cache,
                              output_scores=True, return_dict_in_generate=True)


def assert_cache_changes_nothing(model, inputs):
    """Greedy generation with the key/value cache picks the same tokens, with the same scores (within the rule for
    the model's dtype), as recomputing the whole target at every step."""
    cached, uncached = greedy(model, inputs, True), greedy(model, inputs, False)
    assert torch.equal(cached.sequences, uncached.sequences)
    for step, (a, b) in enumerate(zip(cached.scores, uncached.scores, strict=True)):
        finite = torch.isfinite(b)  # finished rows score -inf everywhere but the padding id
        assert torch.equal(finite, torch.isfinite(a)), f"step {step}"
        assert_close(a[finite], b[finite], msg=f"step {step}")


@examples(15)
@given(case=seq2seq_cases())
def test_generate_with_cache_equals_without(case):
    """Run in float64, where the cached and uncached passes agree to the float64 rule: any slip in the cache (a
    wrong position, a stale or missing key) shows at full size. In float32 they differ by rounding alone (a
    one-token step and a full pass use matmuls of other shapes), up to ~2e-5 on logits of size 6: see the
    regression test below, which hypothesis found when this ran in float32 with an absolute 1e-5."""
    config, seed, inputs = case
    assert_cache_changes_nothing(seq2seq_model(config, seed).double(), inputs)


def shared_groups(model):
    """Which parameter names share one tensor (tied weights), as a set of name tuples."""
    groups = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return {tuple(sorted(names)) for names in groups.values()}


@pytest.mark.numerics
@examples(15)
@given(case=seq2seq_cases())
def test_save_and_reload_gives_identical_logits(case):
    """The reloaded model has bit-identical weights, the same ties and config, and the same logits.

    The logits are compared at the float32 rule, not bit for bit: tensors read from safetensors sit at other memory
    alignments than freshly allocated ones, and the CPU matmul kernels then round differently (~5e-7; cloning the
    loaded weights into fresh memory makes the logits bit-identical)."""
    config, seed, inputs = case
    model = seq2seq_model(config, seed)
    target = torch.randint(1, model.config.vocab_size, (inputs["input_ids"].shape[0], 5),
                           generator=torch.Generator().manual_seed(seed + 1))
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        reloaded = VanillaSeq2SeqForConditionalGeneration.from_pretrained(
            directory, attn_implementation=model.config._attn_implementation
        ).eval()
    saved, loaded = model.config.to_dict(), reloaded.config.to_dict()
    saved.pop("_name_or_path"), loaded.pop("_name_or_path")
    assert loaded == saved
    expected_state, actual_state = model.state_dict(), reloaded.state_dict()
    assert actual_state.keys() == expected_state.keys()
    for key, tensor in expected_state.items():
        assert torch.equal(actual_state[key], tensor), key
    assert shared_groups(reloaded) == shared_groups(model)
    with torch.no_grad():
        expected = model(**inputs, decoder_input_ids=target).logits
        actual = reloaded(**inputs, decoder_input_ids=target).logits
    assert_close(actual, expected)


@pytest.mark.numerics
@examples(15)
@given(case=seq2seq_cases(), data=st.data())
def test_future_decoder_tokens_never_influence_the_past(case, data):
    """Exact in float64 (checked at its rule); in float32 too, within the float32 rule."""
    config, seed, inputs = case
    model = seq2seq_model(config, seed)
    vocab, batch = model.config.vocab_size, inputs["input_ids"].shape[0]
    length = data.draw(st.integers(2, 9), label="target length")
    cut = data.draw(st.integers(1, length - 1), label="first changed position")
    generator = torch.Generator().manual_seed(seed + 2)
    target = torch.randint(1, vocab, (batch, length), generator=generator)
    changed = target.clone()
    changed[:, cut:] = torch.randint(1, vocab, (batch, length - cut), generator=generator)
    for dtype in (torch.float32, torch.float64):
        model.to(dtype)
        with torch.no_grad():
            before = model(**inputs, decoder_input_ids=target, use_cache=False).logits
            after = model(**inputs, decoder_input_ids=changed, use_cache=False).logits
        assert_close(after[:, :cut], before[:, :cut], msg=f"{dtype}, positions before {cut}")


# ---- regression tests: inputs that hypothesis found failing ---------------------------------------------------


@pytest.mark.numerics
def test_regression_cache_rounding_in_float32():
    """Found by `test_generate_with_cache_equals_without` when it compared float32 scores to an absolute 1e-5: the
    step-4 scores of cached and uncached generation differed by 1.8e-5 (sdpa; 1.1e-5 eager) on logits of size 6.
    Not a cache bug: in float64 the two agree exactly. Kept to pin both facts, each at its dtype's rule."""
    config = VanillaSeq2SeqConfig(
        vocab_size=45, hidden_size=64, num_hidden_layers=1, num_attention_heads=1, intermediate_size=45,
        decoder_layers=1, decoder_attention_heads=1, decoder_intermediate_size=33, hidden_act="relu",
        max_position_embeddings=32, position_embedding_type="sinusoidal", sinusoidal_layout="concatenated",
        pre_norm=False, scale_embeddings=True, embedding_layer_norm=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, initializer_range=0.3, pad_token_id=0, bos_token_id=1, decoder_start_token_id=1,
        eos_token_id=None,
    )
    inputs = dict(input_ids=torch.tensor([[25, 25, 43, 10, 38]]), attention_mask=torch.ones(1, 5, dtype=torch.long))
    for attn in ("eager", "sdpa"):
        model = seq2seq_model(config, 14056)
        model.set_attn_implementation(attn)
        assert_cache_changes_nothing(model, inputs)
        assert_cache_changes_nothing(model.double(), inputs)
