"""MarianMTModel (OPUS-MT) -> VanillaSeq2SeqForConditionalGeneration, against a small random MarianMTModel saved with
`save_pretrained`: logits on padded batches, greedy and beam-search `generate()`, the generation config and tokenizer
files carried over, and the checkpoint variants (saved position tables, unshared embeddings)."""

import json
import shutil
from contextlib import redirect_stdout
from functools import partial
from io import StringIO

import pytest
import torch
from numerics import assert_close
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, MarianConfig, MarianMTModel

import hf_vanilla  # noqa: F401  (registers the Auto classes)
from hf_vanilla.conversion import flow
from hf_vanilla.conversion.cli import main as cli
from hf_vanilla.conversion.errors import ConversionError
from hf_vanilla.conversion.formats.bert2bert import BERT2BERT, WARM_START
from hf_vanilla.conversion.formats.marian import FORMAT as MARIAN
from hf_vanilla.conversion.formats.marian import marian_config

convert_marian = partial(flow.convert, MARIAN)
convert_bert2bert = partial(flow.convert, BERT2BERT)
convert_warm_start = partial(flow.convert, WARM_START)

VOCAB, PAD, EOS = 320, 319, 0
# Marian's tokenizer files; MarianTokenizer itself needs sentencepiece, so the tests feed ids and only check that
# the converter copies these files byte for byte.
TOKENIZER_FILES = {
    "source.spm": b"not a real sentencepiece model: copied, never read",
    "target.spm": b"not a real sentencepiece model either",
    "vocab.json": json.dumps({f"tok{i}": i for i in range(VOCAB)}).encode(),
    "tokenizer_config.json": json.dumps({"source_lang": "en", "target_lang": "de"}).encode(),
}


def quiet(function, *args, **kwargs):
    with redirect_stdout(StringIO()) as printed:
        result = function(*args, **kwargs)
    return result, printed.getvalue()


def make_marian(directory, seed: int = 0, **overrides):
    """A small random OPUS-MT-shaped model: scaled embeddings, swish, pad = decoder start, separate encoder and decoder
    depths, heads and FFN widths, a non-zero final_logits_bias, and OPUS-MT's generation settings."""
    config = MarianConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=48, max_position_embeddings=64,
        scale_embedding=True, activation_function="swish", pad_token_id=PAD, decoder_start_token_id=PAD,
        eos_token_id=EOS, forced_eos_token_id=EOS, init_std=0.1, **overrides,
    )
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(std=0.5)  # zeros would not test where the bias goes
    generation = model.generation_config
    generation.bad_words_ids, generation.num_beams, generation.max_length = [[PAD]], 4, 64
    model.save_pretrained(directory)
    for name, content in TOKENIZER_FILES.items():
        (directory / name).write_bytes(content)
    return directory


def batch(seed: int, lengths: list[int], start: int | None = None) -> dict:
    """Right-padded ids (text ids avoid eos and pad); rows of `lengths` real tokens, eos last unless `start`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(5, PAD, (len(lengths), width), generator=generator)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    if start is None:
        ids[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = EOS
    else:
        ids[:, 0] = start
    return {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    root = tmp_path_factory.mktemp("marian")
    source = make_marian(root / "reference")
    _, printed = quiet(convert_marian, str(source), str(root / "converted"))
    assert "OK:" in printed and "identical" in printed
    reference = MarianMTModel.from_pretrained(source, attn_implementation="eager").eval()
    return source, root / "converted", reference, AutoModelForSeq2SeqLM.from_pretrained(root / "converted").eval()


@pytest.mark.numerics
@pytest.mark.parametrize("lengths,target_lengths", [([11, 7, 1], [9, 4, 2]), ([3, 16], [12, 1])])
def test_logits_match_on_padded_batches(marian, lengths, target_lengths):
    _, _, reference, ours = marian
    source, target = batch(0, lengths), batch(1, target_lengths, start=PAD)
    inputs = {**source, "decoder_input_ids": target["input_ids"], "decoder_attention_mask": target["attention_mask"]}
    with torch.no_grad():
        expected, got = reference(**inputs), ours(**inputs)
    real = target["attention_mask"].bool()
    assert_close(got.logits[real], expected.logits[real], msg="logits")
    real_source = source["attention_mask"].bool()
    assert_close(got.encoder_last_hidden_state[real_source], expected.encoder_last_hidden_state[real_source],
                 msg="encoder output")


@pytest.mark.parametrize("options", [{"num_beams": 1}, {}, {"num_beams": 3, "num_return_sequences": 2}],
                         ids=["greedy", "beam-from-generation-config", "beam-3-return-2"])
def test_generate_is_identical(marian, options):
    _, _, reference, ours = marian
    inputs = batch(2, [10, 6, 3])
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=15, do_sample=False, **options)
        got = ours.generate(**inputs, max_new_tokens=15, do_sample=False, **options)
    assert torch.equal(expected, got)
    assert (got[:, 0] == PAD).all()  # Marian starts from the pad token
    assert got.shape[1] > 2


def test_generation_config_and_tokenizer_files_are_copied(marian):
    source, converted, _, ours = marian
    assert (converted / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    generation = ours.generation_config
    assert (generation.forced_eos_token_id, generation.bad_words_ids, generation.num_beams) == (EOS, [[PAD]], 4)
    for name, content in TOKENIZER_FILES.items():
        if name != "tokenizer_config.json":
            assert (converted / name).read_bytes() == content
    # OPUS-MT's tokenizer config names no class: AutoTokenizer found MarianTokenizer through model_type "marian",
    # which the converted config no longer has, so the converter names it.
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    source_config = json.loads(TOKENIZER_FILES["tokenizer_config.json"])
    assert tokenizer_config == {**source_config, "tokenizer_class": "MarianTokenizer"}


def test_config_mapping(marian):
    _, converted, _, ours = marian
    config = json.loads((converted / "config.json").read_text())
    expected = {
        "model_type": "vanilla_seq2seq", "position_embedding_type": "sinusoidal", "sinusoidal_layout": "concatenated",
        "scale_embeddings": True, "embedding_layer_norm": False, "pre_norm": False, "layer_norm_eps": 1e-5,
        "hidden_act": "swish", "type_vocab_size": 0, "lm_head_transform": False,
        "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True, "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "decoder_layers": 3, "decoder_attention_heads": 2, "decoder_intermediate_size": 48,
        "pad_token_id": PAD, "decoder_start_token_id": PAD, "eos_token_id": EOS, "vocab_size": VOCAB,
    }
    assert {k: config[k] for k in expected} == expected
    tensors = load_file(converted / "model.safetensors")
    assert not any("position" in k for k in tensors)  # recomputed, as in Marian
    # One embedding matrix for source, target and output, as in Marian.
    assert ours.lm_head.decoder.weight.data_ptr() == ours.model.encoder.embeddings.word_embeddings.weight.data_ptr()
    assert ours.model.decoder.embeddings.word_embeddings is ours.model.encoder.embeddings.word_embeddings or (
        ours.model.decoder.embeddings.word_embeddings.weight.data_ptr()
        == ours.model.encoder.embeddings.word_embeddings.weight.data_ptr())


def test_final_logits_bias_is_the_output_bias(marian):
    source, _, reference, ours = marian
    assert torch.equal(ours.lm_head.decoder.bias, reference.final_logits_bias[0])
    assert reference.final_logits_bias.abs().sum() > 0


def test_position_table_is_marians(marian):
    """Marian's table: float64 sines of every frequency, then cosines, rounded once to float32."""
    _, _, reference, ours = marian
    expected = reference.model.encoder.embed_positions.weight
    for stack in (ours.model.encoder, ours.model.decoder):
        assert torch.equal(stack.embeddings.position_table, expected)


def test_saved_position_tables_are_dropped_or_refused(tmp_path):
    """Checkpoints saved before `_keys_to_ignore_on_save` hold the sinusoids: dropped when they are Marian's,
    refused when they are anything else (a sinusoidal model cannot hold a trained table)."""
    source = make_marian(tmp_path / "with_positions", seed=1)
    reference = MarianMTModel.from_pretrained(source)
    tensors = load_file(source / "model.safetensors")
    for stack in ("encoder", "decoder"):
        tensors[f"model.{stack}.embed_positions.weight"] = getattr(reference.model, stack).embed_positions.weight
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    _, printed = quiet(convert_marian, str(source), str(tmp_path / "converted"))
    assert "OK:" in printed
    tensors["model.decoder.embed_positions.weight"] = tensors["model.decoder.embed_positions.weight"] + 0.01
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="decoder's saved position table"):
        quiet(convert_marian, str(source), str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()


def test_unshared_embeddings(tmp_path):
    """share_encoder_decoder_embeddings=False: separate source and target matrices, the output tied to the target."""
    source = make_marian(tmp_path / "unshared", seed=2, share_encoder_decoder_embeddings=False)
    _, printed = quiet(convert_marian, str(source), str(tmp_path / "converted"))
    assert "OK:" in printed
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "converted").eval()
    reference = MarianMTModel.from_pretrained(source).eval()
    assert not ours.config.share_encoder_decoder_embeddings
    for stack in ("encoder", "decoder"):
        ours_embeddings = getattr(ours.model, stack).embeddings.word_embeddings.weight
        assert torch.equal(ours_embeddings, getattr(reference.model, stack).embed_tokens.weight)
    assert not torch.equal(ours.model.encoder.embeddings.word_embeddings.weight,
                           ours.model.decoder.embeddings.word_embeddings.weight)
    inputs = batch(3, [8, 5])
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=10, num_beams=2)
        got = ours.generate(**inputs, max_new_tokens=10, num_beams=2)
    assert torch.equal(expected, got)


def test_round_trip_save_load(marian, tmp_path):
    _, _, _, ours = marian
    ours.save_pretrained(tmp_path / "again")
    again = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "again").eval()
    inputs = {**batch(4, [7, 3]), "decoder_input_ids": batch(5, [4, 4], start=PAD)["input_ids"]}
    with torch.no_grad():
        assert torch.equal(ours(**inputs).logits, again(**inputs).logits)
    assert torch.equal(again.model.decoder.embeddings.position_table, ours.model.decoder.embeddings.position_table)


def assert_marian_round_trip(source, converted, back, capsys):
    """`to-marian` wrote a MarianMTModel folder that transformers loads alone, holding the source's every tensor bit
    for bit, its generation config and tokenizer files, and generating the source's tokens."""
    assert cli(["to-marian", "--source", str(converted), "--output", str(back)]) == 0
    printed = capsys.readouterr().out
    assert "OK:" in printed and "identical" in printed  # the converter compared what it wrote with the source
    reference = MarianMTModel.from_pretrained(source).eval()
    written = MarianMTModel.from_pretrained(back).eval()
    assert json.loads((back / "config.json").read_text())["architectures"] == ["MarianMTModel"]
    expected, got = reference.state_dict(), written.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected), [
        key for key in expected if not torch.equal(expected[key], got[key])]
    assert written.generation_config.to_dict() == reference.generation_config.to_dict()
    for name in ("source.spm", "target.spm", "vocab.json"):
        assert (back / name).read_bytes() == (source / name).read_bytes()
    inputs = batch(6, [9, 5, 2])
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=12)
        assert torch.equal(written.generate(**inputs, max_new_tokens=12), expected)


def test_to_marian_round_trip(marian, tmp_path, capsys):
    source, converted, _, _ = marian
    assert_marian_round_trip(source, converted, tmp_path / "back", capsys)


def test_to_marian_round_trip_unshared(tmp_path, capsys):
    source = make_marian(tmp_path / "unshared", seed=3, share_encoder_decoder_embeddings=False)
    quiet(convert_marian, str(source), str(tmp_path / "converted"))
    assert_marian_round_trip(source, tmp_path / "converted", tmp_path / "back", capsys)


def test_to_marian_refuses_what_marian_cannot_express(marian, tmp_path, capsys):
    """A vanilla model of another shape (here post-LN turned pre-LN, learned positions) is refused in one message
    naming every field, before its weights are read; nothing is written."""
    _, converted, _, _ = marian
    shutil.copytree(converted, tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    config |= {"pre_norm": True, "position_embedding_type": "learned"}
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    assert cli(["to-marian", "--source", str(tmp_path / "other"), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: This model cannot be expressed as Marian:\n  "), error
    assert "position_embedding_type='learned'" in error and "pre_norm=True" in error
    assert not (tmp_path / "out").exists()


def test_refuses_other_sources(marian, tmp_path, minilm_path, capsys):
    source, _, _, _ = marian
    with pytest.raises(ConversionError, match="holds a 'bert' model, but the 'marian' converter"):
        convert_marian(str(minilm_path), str(tmp_path / "a"))
    with pytest.raises(ConversionError, match="holds a 'marian' model"):
        convert_bert2bert(str(source), str(tmp_path / "b"))
    with pytest.raises(ConversionError, match="holds a 'marian' model"):
        convert_warm_start(str(source), str(tmp_path / "c"))
    assert cli(["marian", "--source", str(minilm_path), "--output", str(tmp_path / "d")]) == 2
    assert "'bert'" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_refuses_what_the_model_cannot_hold():
    with pytest.raises(ConversionError, match="even"):  # sinusoids pair a sine with a cosine
        marian_config({"d_model": 33, "encoder_attention_heads": 3, "decoder_attention_heads": 3})
    with pytest.raises(ConversionError, match="vocabularies of different sizes"):
        marian_config({"vocab_size": 100, "decoder_vocab_size": 90, "share_encoder_decoder_embeddings": False})


# ---- with a real (tiny) Marian tokenizer ---------------------------------------------------------------------------

SENTENCES = ["the quick brown fox jumps over the lazy dog", "attention is all you need", "a short one"]


@pytest.fixture(scope="module")
def marian_with_tokenizer(tmp_path_factory):
    """A random Marian whose vocabulary is a sentencepiece model trained here on a few sentences, laid out as OPUS-MT
    lays it out: source.spm, target.spm, vocab.json (</s> = 0, <unk> = 1, <pad> last) and a tokenizer_config.json
    with the languages only."""
    spm = pytest.importorskip("sentencepiece", reason="MarianTokenizer needs sentencepiece")
    import io

    root = tmp_path_factory.mktemp("marian_tokenizer")
    source = root / "reference"
    source.mkdir()
    text = SENTENCES + ["der schnelle braune fuchs springt", "aufmerksamkeit ist alles was man braucht"]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text * 20), model_writer=model, vocab_size=40,
                                   character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0, pad_id=-1, minloglevel=2)
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = {"</s>": 0, "<unk>": 1}
    for i in range(processor.get_piece_size()):
        vocab.setdefault(processor.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    for name in ("source.spm", "target.spm"):
        (source / name).write_bytes(model.getvalue())
    (source / "vocab.json").write_text(json.dumps(vocab))
    (source / "tokenizer_config.json").write_text(json.dumps({"source_lang": "en", "target_lang": "de"}))
    config = MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        scale_embedding=True, activation_function="swish", pad_token_id=vocab["<pad>"],
        decoder_start_token_id=vocab["<pad>"], eos_token_id=0, forced_eos_token_id=0, init_std=0.2,
    )
    torch.manual_seed(3)
    MarianMTModel(config).eval().save_pretrained(source)
    quiet(convert_marian, str(source), str(root / "converted"))
    return source, root / "converted"


def test_tokenizer_loads_from_the_converted_folder(marian_with_tokenizer):
    from transformers import AutoTokenizer, MarianTokenizer

    source, converted = marian_with_tokenizer
    ours = AutoTokenizer.from_pretrained(converted)
    assert isinstance(ours, MarianTokenizer)
    expected = MarianTokenizer.from_pretrained(source)(SENTENCES, padding=True)
    assert ours(SENTENCES, padding=True) == expected


def test_tokenizer_is_checked_against_the_embeddings(marian_with_tokenizer, tmp_path):
    """MarianTokenizer's length is its (shared) vocab.json: equal to vocab_size, silent; larger, refused."""
    source, _ = marian_with_tokenizer
    _, printed = quiet(convert_marian, str(source), str(tmp_path / "same"), verify=False)
    assert "tokenizer" not in printed
    larger = shutil.copytree(source, tmp_path / "larger")
    vocab = json.loads((larger / "vocab.json").read_text())
    rows = len(vocab)
    (larger / "vocab.json").write_text(json.dumps(vocab | {"extra0": rows, "extra1": rows + 1}))
    with pytest.raises(ConversionError, match=rf"has {rows + 2} tokens .* the embeddings have {rows} rows"):
        quiet(convert_marian, str(larger), str(tmp_path / "out"), verify=False)
    assert not (tmp_path / "out").exists()


def test_pipeline_matches_reference_generate(marian_with_tokenizer):
    pytest.importorskip("hf_vanilla.pipelines", reason="the seq2seq-generation pipeline is not in hf_vanilla yet")
    from transformers import MarianTokenizer, pipeline

    source, converted = marian_with_tokenizer
    tokenizer = MarianTokenizer.from_pretrained(source)
    reference = MarianMTModel.from_pretrained(source).eval()
    translator = pipeline("seq2seq-generation", model=str(converted))
    for sentence in SENTENCES:
        with torch.no_grad():
            ids = reference.generate(**tokenizer(sentence, return_tensors="pt"), max_new_tokens=8, num_beams=1,
                                     do_sample=False)
        output = translator(sentence, max_new_tokens=8, num_beams=1, do_sample=False)
        output = output[0] if isinstance(output, list) else output
        assert output["generated_text"] == tokenizer.decode(ids[0], skip_special_tokens=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_to_marian_of_a_half_precision_conversion(marian, tmp_path, capsys, dtype):
    """A model converted with --dtype bfloat16 goes back as stored, checked by the rule of the dtype written against
    the vanilla source (read in float32), as the encoders' reverse conversions are: every tensor the same bits."""
    source = marian[0]
    assert cli(["marian", "--source", str(source), "--output", str(tmp_path / "half"), "--dtype", dtype]) == 0
    capsys.readouterr()
    assert cli(["to-marian", "--source", str(tmp_path / "half"), "--output", str(tmp_path / "back")]) == 0
    printed = capsys.readouterr().out
    assert "OK:" in printed and ("bf16" if dtype == "bfloat16" else "fp16") in printed, printed
    half = load_file(tmp_path / "half" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back["model.shared.weight"].dtype == getattr(torch, dtype)
    assert torch.equal(back["model.shared.weight"], half["model.encoder.embeddings.word_embeddings.weight"])
    assert torch.equal(back["model.encoder.layers.0.fc1.weight"], half["model.encoder.layers.0.ffn.up_proj.weight"])
