"""The generative families and the encoder-decoder's heads: what transformers' common tests expect of them.

- The three causal families (BERT's causal LM, the encoder-decoder, the decoder alone) generate the same tokens with
  a static cache as with the dynamic one, and the decoder alone is causal and caches one entry per position.
- The decoder alone loads from an encoder-decoder checkpoint (its weights are named alike) and runs in the
  `text-generation` pipeline, with the pipeline's text equal to `generate` + decode.
- The encoder-decoder's classification head reads the decoder state at the last eos token (BART's recipe) and
  refuses rows whose eos counts differ; its QA head scores every source token.
- A static-cache decoding step compiles with `fullgraph=True` (slow).
Parity of the encoder heads with transformers' BERT classes is in test_encoder_parity.py.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache, pipeline

import hf_vanilla  # noqa: F401  (registers the Auto classes)
from hf_vanilla import (
    VanillaDecoderForCausalLM,
    VanillaEncoderConfig,
    VanillaEncoderForCausalLM,
    VanillaEncoderForSequenceClassification,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
    VanillaSeq2SeqForQuestionAnswering,
    VanillaSeq2SeqForSequenceClassification,
)
from numerics import assert_close

pytestmark = pytest.mark.generation
PAD, BOS, EOS, V = 0, 1, 2, 60
SIZES = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def seq2seq_config(**overrides):
    ids = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS)
    return VanillaSeq2SeqConfig(**(SIZES | ids | overrides))


def build(model_class, config, seed=0):
    torch.manual_seed(seed)
    return model_class(config).eval()


def causal_models():
    return {
        "bert-causal-lm": build(VanillaEncoderForCausalLM, VanillaEncoderConfig(**SIZES, is_decoder=True)),
        "decoder-only": build(VanillaDecoderForCausalLM, seq2seq_config()),
    }


def left_padded_prompt():
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, V, (2, 6), generator=generator)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0  # generation pads on the left
    return prompt.masked_fill(mask == 0, PAD), mask


@pytest.mark.parametrize("family", ["bert-causal-lm", "decoder-only", "encoder-decoder"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_static_cache_generates_what_the_dynamic_cache_does(family, num_beams):
    prompt, mask = left_padded_prompt()
    if family == "encoder-decoder":
        model = build(VanillaSeq2SeqForConditionalGeneration, seq2seq_config())
        mask = mask.flip(1)  # a source pads on the right
    else:
        model = causal_models()[family]
    options = dict(input_ids=prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=num_beams)
    with torch.no_grad():
        dynamic = model.generate(**options)
        static = model.generate(**options, cache_implementation="static")
    assert dynamic.shape[1] > prompt.shape[1] and torch.equal(static, dynamic)


@pytest.mark.numerics
def test_the_decoder_alone_is_causal_and_caches_each_position_once():
    """`get_decoder()` called without encoder states skips cross-attention: no token sees the future, and the
    cache holds one entry per position (cross-attention used as self-attention had doubled both)."""
    model = build(VanillaSeq2SeqForConditionalGeneration, seq2seq_config()).double()
    decoder = model.get_decoder()
    tokens = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 4:] = torch.randint(3, V, (2, 3), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = decoder(input_ids=tokens, use_cache=True)
        out_changed = decoder(input_ids=changed)
    assert out.past_key_values.get_seq_length() == 7
    assert_close(out_changed.last_hidden_state[:, :4], out.last_hidden_state[:, :4])  # float64: exact up to 1e-12
    assert (out_changed.last_hidden_state[:, 4:] - out.last_hidden_state[:, 4:]).abs().max() > 1e-3


def test_decoder_only_loads_an_encoder_decoder_checkpoint_and_runs_in_the_text_generation_pipeline(
        tmp_path, minilm_path):
    """The decoder's weights are named as the encoder-decoder's decoder, so AutoModelForCausalLM loads one from an
    encoder-decoder checkpoint (as BartForCausalLM does from BART's); `text-generation` then works on it. (A
    checkpoint whose source and target share one embedding matrix saves it once, under the encoder's name, which
    the decoder alone does not read: this one keeps its target embeddings apart, tied to the output projection.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = seq2seq_config(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                            decoder_start_token_id=tokenizer.cls_token_id, share_encoder_decoder_embeddings=False)
    build(VanillaSeq2SeqForConditionalGeneration, config).save_pretrained(tmp_path)
    seq2seq = VanillaSeq2SeqForConditionalGeneration.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(model, VanillaDecoderForCausalLM) and not model.config.is_encoder_decoder
    for name, tensor in model.model.decoder.state_dict().items():
        assert torch.equal(tensor, seq2seq.model.decoder.state_dict()[name]), name
    assert model.lm_head.decoder.weight.data_ptr() == model.model.decoder.embeddings.word_embeddings.weight.data_ptr()

    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = generator("the cat sat on", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    inputs = tokenizer("the cat sat on", return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert text == tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_causal_lm_loss_scores_the_next_token():
    """labels = input_ids: position t is scored on token t + 1 (the shift is inside), as in transformers."""
    for model in causal_models().values():
        tokens = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(4))
        out = model(input_ids=tokens, labels=tokens)
        expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
        assert_close(out.loss, expected)


def sentences_with_eos():
    source = torch.randint(3, V, (3, 7), generator=torch.Generator().manual_seed(5))
    source[:, -1] = EOS
    source[1, 3:] = PAD
    source[1, 2] = EOS  # a shorter row: its eos comes before its padding
    return source, (source != PAD).long()


def test_seq2seq_classification_reads_the_last_eos_state():
    model = build(VanillaSeq2SeqForSequenceClassification, seq2seq_config(num_labels=3))
    source, mask = sentences_with_eos()
    with torch.no_grad():
        out = model(input_ids=source, attention_mask=mask, labels=torch.tensor([0, 2, 1]), output_hidden_states=True)
        states = out.decoder_hidden_states[-1]  # (B, T, E): the decoder read the source shifted right
        last_eos = torch.stack([states[0, 6], states[1, 2], states[2, 6]])
        expected = model.classifier(torch.tanh(model.pooler(last_eos)))
    assert out.logits.shape == (3, 3) and torch.isfinite(out.loss)
    assert_close(out.logits, expected)
    source[0, 4] = EOS  # row 0 now has two
    with pytest.raises(ValueError, match=r"same, non-zero number of eos tokens.*\[2, 1, 1\]"):
        model(input_ids=source, attention_mask=mask)


def test_seq2seq_question_answering_scores_every_token():
    model = build(VanillaSeq2SeqForQuestionAnswering, seq2seq_config())
    source, mask = sentences_with_eos()
    out = model(input_ids=source, attention_mask=mask, start_positions=torch.tensor([1, 0, 2]),
                end_positions=torch.tensor([3, 1, 5]))
    assert out.start_logits.shape == out.end_logits.shape == source.shape and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.qa_outputs.weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_a_static_cache_decoding_step_compiles_with_fullgraph():
    model = causal_models()["decoder-only"]
    prompt, _ = left_padded_prompt()
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        first = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        step = first.logits[:, -1:].argmax(-1)
        eager_cache = StaticCache(config=model.config, max_cache_len=16)
        model(input_ids=prompt, past_key_values=eager_cache, use_cache=True)
        expected = model(input_ids=step, past_key_values=eager_cache, use_cache=True).logits
        compiled = torch.compile(model.forward, fullgraph=True, dynamic=False)
        got = compiled(input_ids=step, past_key_values=cache, use_cache=True).logits
    assert_close(got, expected)


def test_no_split_modules_name_the_blocks_each_model_holds():
    """Accelerate's FSDP auto-wrap (and device maps) read `_no_split_modules`, and the auto-wrap refuses a listed
    class the model lacks: an encoder has no decoder layer, BERT's causal LM (masked layers) no encoder layer."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    models = {
        "encoder": VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**SIZES)),
        **causal_models(),
        "encoder-decoder": build(VanillaSeq2SeqForConditionalGeneration, seq2seq_config()),
    }
    expected = {
        "encoder": {"VanillaEmbeddings", "VanillaEncoderLayer"},
        "bert-causal-lm": {"VanillaEmbeddings", "VanillaDecoderLayer"},
        "decoder-only": {"VanillaEmbeddings", "VanillaDecoderLayer"},
        "encoder-decoder": {"VanillaEmbeddings", "VanillaEncoderLayer", "VanillaDecoderLayer"},
    }
    for name, model in models.items():
        assert set(model._no_split_modules) == expected[name], name
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        assert callable(fsdp2_prepare_auto_wrap_policy(plugin, model)), name
