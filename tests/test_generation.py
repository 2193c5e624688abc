"""The generation contract, for every class that generates: the encoder-decoder, the decoder alone (a causal LM) and
the encoder's causal-LM head (BERT's `BertLMHeadModel`).

transformers' own `GenerationTesterMixin` is not in its sdist (tests/transformers_tests.py runs the model mixins
only), so its core claims are made here, on the installed transformers, whichever version of the supported range
that is: the key/value cache changes no token (greedy, beam search, sampling with a seed), a static cache gives the
dynamic cache's tokens, a left-padded batch generates for each row what that row generates alone, `inputs_embeds`
generate what their `input_ids` generate, attention maps and hidden states come back for every step, and the cache
comes back under the name the installed transformers reads (`cache` since 5.24, `past_key_values` before) without a
deprecation warning.

Random tiny models generate one token over and over, against which a broken cache can look right: these have large
weights and pre-LN, and a test checks that their generations vary from prompt to prompt and along the output.
"""

import copy
import logging

import pytest
import torch
from hf_references import single_thread  # noqa: F401  (fixture)
from numerics import assert_close

from hf_vanilla import (
    VanillaDecoderForCausalLM,
    VanillaEncoderConfig,
    VanillaEncoderForCausalLM,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)
from hf_vanilla.compat import CACHE_FIELD

PAD, BOS, EOS = 0, 1, 2
VOCAB = 40
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.generation]
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, initializer_range=1.0, pre_norm=True)


def seq2seq():
    return VanillaSeq2SeqForConditionalGeneration(VanillaSeq2SeqConfig(
        **SIZES, decoder_layers=2, decoder_start_token_id=BOS, tie_word_embeddings=False,
        share_encoder_decoder_embeddings=False, scale_embeddings=False))


def decoder_lm(position_offset=0):
    return VanillaDecoderForCausalLM(VanillaSeq2SeqConfig(
        **SIZES, decoder_layers=2, decoder_start_token_id=BOS, tie_word_embeddings=False, scale_embeddings=False,
        position_offset=position_offset))


def encoder_lm():
    return VanillaEncoderForCausalLM(VanillaEncoderConfig(**SIZES, is_decoder=True, tie_word_embeddings=False))


FAMILIES = {"seq2seq": seq2seq, "decoder": decoder_lm, "decoder-offset-2": lambda: decoder_lm(2),
            "encoder-causal-lm": encoder_lm}
CAUSAL = [name for name in FAMILIES if name != "seq2seq"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    torch.manual_seed(0)
    return request.param, FAMILIES[request.param]().eval()


def prompts(seed=0, lengths=(5, 2, 7, 4)):
    """Prompts of different lengths, with their tokens drawn from the vocabulary (no special token)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(EOS + 1, VOCAB, (n,), generator=generator) for n in lengths]


def padded(rows, side):
    """(B, L) ids padded on `side` with PAD, and their 1/0 mask."""
    L = max(len(row) for row in rows)
    ids, mask = torch.full((len(rows), L), PAD), torch.zeros(len(rows), L, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(L - len(row), L) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    return ids, mask


def batch(name):
    """The batch each family generates from: the source (right-padded) of the encoder-decoder, the prompt
    (left-padded, as decoder-only models batch prompts) of a causal LM."""
    return padded(prompts(), "right" if name == "seq2seq" else "left")


def new_tokens(name, sequences, input_ids):
    """The generated tokens alone: a causal LM returns its prompt first."""
    return sequences if name == "seq2seq" else sequences[:, input_ids.shape[1]:]


def test_these_models_make_a_meaningful_generation_test(family):
    name, model = family
    input_ids, attention_mask = batch(name)
    generated = new_tokens(name, model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8,
                                                min_new_tokens=8, do_sample=False, pad_token_id=PAD), input_ids)
    assert len({tuple(row.tolist()) for row in generated}) == len(generated)  # every prompt its own output
    assert ((generated[:, 1:] != generated[:, :-1]).sum(1) >= 2).sum() >= len(generated) // 2


@pytest.mark.parametrize("mode", ["greedy", "beam", "sample"])
def test_the_cache_changes_no_token(family, mode):
    name, model = family
    input_ids, attention_mask = batch(name)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, pad_token_id=PAD,
                  return_dict_in_generate=True, output_scores=True)
    kwargs |= {"greedy": dict(do_sample=False), "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
               "sample": dict(do_sample=True, temperature=2.0, top_k=0)}[mode]
    runs = {}
    for use_cache in (True, False):
        torch.manual_seed(1)
        runs[use_cache] = model.generate(input_ids, use_cache=use_cache, **kwargs)
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    if mode == "greedy":  # the same logits at every step, to the float32 rule
        for step, (cached, uncached) in enumerate(zip(runs[True].scores, runs[False].scores, strict=True)):
            assert_close(cached, uncached, msg=f"step {step}")


def test_a_static_cache_gives_the_dynamic_cache_tokens(family):
    name, model = family
    input_ids, attention_mask = batch(name)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    dynamic = model.generate(input_ids, **kwargs)
    assert torch.equal(model.generate(input_ids, cache_implementation="static", **kwargs), dynamic)


@pytest.mark.numerics
@pytest.mark.parametrize("name", CAUSAL)
def test_a_left_padded_prompt_scores_as_it_does_alone(name):
    """transformers' `test_left_padding_compatibility`: the next-token logits of a left-padded prompt, with the
    positions `generate` derives from its mask, are those of the prompt alone."""
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    rows = prompts(seed=3)
    input_ids, attention_mask = padded(rows, "left")
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate derives them
    with torch.no_grad():
        batched = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, -1]
        for i, row in enumerate(rows):
            alone = model(input_ids=row[None]).logits[0, -1]
            assert_close(batched[i], alone, msg=f"row {i}")


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_a_left_padded_batch_generates_each_row_as_it_would_alone(name, cache_implementation):
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    rows = prompts(seed=4)
    input_ids, attention_mask = padded(rows, "left")
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, cache_implementation=cache_implementation)
    together = model.generate(input_ids, attention_mask=attention_mask, **kwargs)[:, input_ids.shape[1]:]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **kwargs)[0, len(row):]
        assert torch.equal(together[i], alone), f"row {i}"


def test_inputs_embeds_generate_what_their_input_ids_generate(family):
    name, model = family
    input_ids, attention_mask = batch(name)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    from_ids = new_tokens(name, model.generate(input_ids, **kwargs), input_ids)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(input_ids)
    from_embeds = model.generate(inputs_embeds=embeds, **kwargs)  # returns the new tokens alone
    assert torch.equal(from_embeds, from_ids)


@pytest.mark.parametrize("name", CAUSAL)
def test_inputs_embeds_score_what_their_input_ids_score_where_the_prompt_ends_in_padding(name):
    """Regression: a causal LM cleared its padding positions' states when given `inputs_embeds` and not
    when given `input_ids`, so a prompt whose mask ends in padding (transformers' `random_attention_mask` draws such
    masks) scored its next token from its embeddings 0.1 away from its ids, and generated another token (transformers'
    `test_generate_from_inputs_embeds` failed). `generate` reads the last position, padding or not."""
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    input_ids = torch.stack(prompts(seed=5, lengths=(7, 7)))
    attention_mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1, 0]])  # padding inside and at the end
    with torch.no_grad():
        embeds = model.get_input_embeddings()(input_ids)
        from_ids = model(input_ids=input_ids, attention_mask=attention_mask).logits
        from_embeds = model(inputs_embeds=embeds, attention_mask=attention_mask).logits
    assert_close(from_embeds, from_ids)  # every position, padding included: the same input either way
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert torch.equal(model.generate(inputs_embeds=embeds, **kwargs), model.generate(input_ids, **kwargs)[:, 7:])


@pytest.mark.numerics
@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_sequences_packed_in_one_row_score_as_they_do_alone(name, attn, use_cache):
    """Regression: transformers' padding-free format (`DataCollatorWithFlattening`) lays sequences end to
    end in one row, without an attention_mask, their position ids restarting at each sequence; a causal LM let each
    sequence attend to the ones before it (transformers' `test_eager_padding_matches_padding_free_with_position_ids`
    failed in 2 of 20 runs in bfloat16). Each sequence now sees only itself, whether or not a cache is kept."""
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    model.set_attn_implementation(attn)
    rows = prompts(seed=6, lengths=(5, 2, 7))
    input_ids = torch.cat(rows)[None]  # (1, 14)
    position_ids = torch.cat([torch.arange(len(row)) for row in rows])[None]  # (1, 14): 0..4, 0..1, 0..6
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache).logits[0]
        start = 0
        for i, row in enumerate(rows):
            alone = model(input_ids=row[None], use_cache=use_cache).logits[0]
            assert_close(packed[start:start + len(row)], alone, msg=f"sequence {i}")
            start += len(row)


def test_attentions_and_hidden_states_come_back_for_every_step(family):
    name, model = family
    input_ids, attention_mask = batch(name)
    B, L = input_ids.shape
    H, layers, steps = model.config.num_attention_heads, 2, 4
    model.set_attn_implementation("eager")
    try:
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=PAD, output_attentions=True, output_hidden_states=True,
                             return_dict_in_generate=True)
    finally:
        model.set_attn_implementation("sdpa")
    self_maps = out.decoder_attentions if name == "seq2seq" else out.attentions
    states = out.decoder_hidden_states if name == "seq2seq" else out.hidden_states
    assert len(self_maps) == len(states) == steps
    prompt = 1 if name == "seq2seq" else L  # the decoder's first input: its start token, or the whole prompt
    for t in range(steps):
        queries = prompt if t == 0 else 1
        assert len(self_maps[t]) == layers and len(states[t]) == layers + 1
        assert self_maps[t][0].shape == (B, H, queries, prompt + t)  # the new queries against every cached key
        assert states[t][-1].shape == (B, queries, model.config.hidden_size)
        assert_close(self_maps[t][-1].sum(-1), torch.ones(B, H, queries))
    if name == "seq2seq":
        assert all(step[0].shape == (B, H, 1, L) for step in out.cross_attentions)
        assert torch.all(out.cross_attentions[-1][0].transpose(1, 3)[attention_mask == 0] == 0)


def test_the_cache_comes_back_under_the_installed_name_and_is_taken_under_both(family, caplog):
    """`cache` since transformers 5.24, `past_key_values` before: generation reads it back by that name, and a
    forward takes either. Neither our forwards nor our outputs make transformers log its deprecation warning."""
    name, model = family
    input_ids, attention_mask = batch(name)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
    if name == "seq2seq":
        inputs["decoder_input_ids"] = torch.full((len(input_ids), 1), BOS)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        first = model(**inputs, use_cache=True)
        assert CACHE_FIELD in first.keys()
        cache = first[CACHE_FIELD]
        length = cache.get_seq_length()
        model.generate(**{k: v for k, v in inputs.items() if k != "decoder_input_ids"}, max_new_tokens=3,
                       do_sample=False, pad_token_id=PAD)
    assert not [record.message for record in caplog.records if "deprecated" in record.getMessage()]
    step = {"decoder_input_ids" if name == "seq2seq" else "input_ids": torch.full((len(input_ids), 1), EOS + 1)}
    if name != "seq2seq":
        step["attention_mask"] = torch.cat([attention_mask, torch.ones(len(input_ids), 1, dtype=torch.long)], 1)
    else:
        step["input_ids"], step["attention_mask"] = input_ids, attention_mask
    for keyword in ("cache", "past_key_values"):
        with torch.no_grad():
            out = model(**step, **{keyword: copy.deepcopy(cache)}, use_cache=True)
        assert out[CACHE_FIELD].get_seq_length() == length + 1, keyword
    with pytest.raises(ValueError, match="pass one"):
        model(**step, cache=copy.deepcopy(cache), past_key_values=copy.deepcopy(cache))
