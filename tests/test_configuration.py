"""The configs: aliases are their fields everywhere, derived sizes follow what they derive from, and a config can
pass through inconsistent states while it is filled in, yet no model is ever built from one."""

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache, MarianConfig

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderModel,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

TINY = dict(vocab_size=50, max_position_embeddings=32)

# alias -> (field, a value other than both configs' defaults)
ALIASES = {
    "d_model": ("hidden_size", 16),
    "d_ff": ("intermediate_size", 24),
    "h": ("num_attention_heads", 2),
    "N": ("num_hidden_layers", 3),
    "encoder_layers": ("num_hidden_layers", 3),
    "encoder_attention_heads": ("num_attention_heads", 2),
    "encoder_ffn_dim": ("intermediate_size", 24),
    "activation_function": ("hidden_act", "silu"),
    "dropout": ("hidden_dropout_prob", 0.25),
    "attention_dropout": ("attention_probs_dropout_prob", 0.25),
    "init_std": ("initializer_range", 0.5),
}
SEQ2SEQ_ALIASES = {**ALIASES, "decoder_ffn_dim": ("decoder_intermediate_size", 24)}


def cases():
    for config_class, aliases in ((VanillaEncoderConfig, ALIASES), (VanillaSeq2SeqConfig, SEQ2SEQ_ALIASES)):
        for alias, (field, value) in aliases.items():
            yield pytest.param(config_class, alias, field, value, id=f"{config_class.__name__}-{alias}")


@pytest.mark.parametrize(("config_class", "alias", "field", "value"), list(cases()))
def test_an_alias_is_its_field_everywhere(config_class, alias, field, value, tmp_path):
    built = config_class(**{alias: value})
    loaded = config_class.from_dict({alias: value})
    assigned = config_class()
    setattr(assigned, alias, value)
    config_class().save_pretrained(tmp_path)
    overridden = config_class.from_pretrained(tmp_path, **{alias: value})
    for config in (built, loaded, assigned, overridden):
        assert getattr(config, field) == getattr(config, alias) == value
        assert config.to_dict()[field] == value and alias not in config.to_dict()


def test_derived_sizes_follow_an_alias_at_construction():
    """The bug: `d_model=16` left the embeddings 512 wide, so the tied output projection failed on every forward,
    and d_ff / h / N left the decoder at its defaults."""
    config = VanillaSeq2SeqConfig(**TINY, d_model=16, d_ff=24, h=2, N=1)
    assert config.embedding_size == 16
    assert (config.decoder_layers, config.decoder_attention_heads, config.decoder_intermediate_size) == (1, 2, 24)
    model = VanillaSeq2SeqForConditionalGeneration(config).eval()
    ids = torch.tensor([[5, 6, 7, 2]])
    assert model(input_ids=ids, decoder_input_ids=ids).logits.shape == (1, 4, 50)
    assert model.model.encoder.embeddings.word_embeddings.weight.shape == (50, 16)

    encoder = VanillaEncoderConfig(**TINY, d_model=64, h=4)
    assert encoder.embedding_size == 64  # no projection from a default-width embedding
    assert not any("project" in name for name, _ in VanillaEncoderModel(encoder).named_modules())


def test_derived_sizes_follow_a_later_assignment_until_set():
    config = VanillaSeq2SeqConfig(**TINY, hidden_size=16, num_attention_heads=2, decoder_layers=2)
    config.d_model = 32
    config.N = 4
    config.intermediate_size = 40
    assert config.hidden_size == config.embedding_size == 32
    assert config.decoder_intermediate_size == 40
    assert config.decoder_layers == 2  # set explicitly: it no longer follows num_hidden_layers
    config.decoder_layers = None  # back to following
    assert config.decoder_layers == 4
    encoder = VanillaEncoderConfig(embedding_size=128)
    encoder.hidden_size = 256
    assert encoder.embedding_size == 128


def test_bart_and_marian_names_need_no_translation():
    marian = MarianConfig(vocab_size=50, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                          decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=40, dropout=0.2,
                          attention_dropout=0.1, activation_function="swish", init_std=0.05,
                          max_position_embeddings=64)
    names = ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
             "encoder_ffn_dim", "decoder_ffn_dim", "dropout", "attention_dropout", "activation_function", "init_std",
             "vocab_size", "max_position_embeddings")
    ours = VanillaSeq2SeqConfig(**{name: getattr(marian, name) for name in names})
    expected = VanillaSeq2SeqConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, decoder_layers=3, num_attention_heads=4,
        decoder_attention_heads=2, intermediate_size=48, decoder_intermediate_size=40, hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.1, hidden_act="swish", initializer_range=0.05, max_position_embeddings=64,
    )
    assert ours.to_dict() == expected.to_dict()


def test_a_field_given_twice_is_refused():
    with pytest.raises(ValueError, match=r"d_model=16 and hidden_size=32 name the same field: pass it once"):
        VanillaSeq2SeqConfig(d_model=16, hidden_size=32)
    with pytest.raises(ValueError, match=r"h=2, encoder_attention_heads=4 and num_attention_heads=8 name the same"):
        VanillaSeq2SeqConfig(h=2, encoder_attention_heads=4)
    assert VanillaSeq2SeqConfig(d_model=16, hidden_size=16).hidden_size == 16  # the same value twice is no conflict


def test_an_aliased_value_is_checked_as_its_field():
    with pytest.raises(ValueError, match=r"hidden_dropout_prob must be in \[0, 1\), got 1.5"):
        VanillaSeq2SeqConfig(dropout=1.5)
    with pytest.raises(ValueError, match=r"decoder_intermediate_size must be a positive integer, got 0"):
        VanillaSeq2SeqConfig(decoder_ffn_dim=0)


def test_decoder_sizes_reach_the_cache_as_numbers():
    """`get_text_config(decoder=True)` copies every `decoder_*` field over the main one: what it copies must be the
    decoder's size, never the stored `None` that means "as the encoder"."""
    config = VanillaSeq2SeqConfig(**TINY, hidden_size=16, num_attention_heads=4, num_hidden_layers=3,
                                  intermediate_size=24)
    assert config.to_diff_dict().get("decoder_layers") is None  # following: not written to config.json
    decoder = config.get_text_config(decoder=True)
    assert (decoder.num_hidden_layers, decoder.num_attention_heads, decoder.intermediate_size) == (3, 4, 24)
    decoder.validate()
    config.decoder_layers = 2
    assert config.get_text_config(decoder=True).num_hidden_layers == 2
    model = VanillaSeq2SeqForConditionalGeneration(config).eval()
    ids = torch.tensor([[5, 6, 2]])
    cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    out = model(input_ids=ids, decoder_input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    assert len(out.past_key_values.self_attention_cache.layers) == 2
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[0] == 1


def test_untying_the_output_projection_alone_gives_separate_matrices():
    """transformers' common tests (and users) untie with `tie_word_embeddings=False` only: the source/target sharing
    follows it unless set, so that is a consistent config, and every matrix is its own."""
    config = VanillaSeq2SeqConfig(**TINY, hidden_size=16, num_attention_heads=2, tie_word_embeddings=False)
    assert config.share_encoder_decoder_embeddings is False
    config.check_architecture()
    model = VanillaSeq2SeqForConditionalGeneration(config)
    weights = [model.model.encoder.embeddings.word_embeddings.weight,
               model.model.decoder.embeddings.word_embeddings.weight, model.lm_head.decoder.weight]
    assert len({w.data_ptr() for w in weights}) == 3
    config.tie_word_embeddings = True
    assert config.share_encoder_decoder_embeddings is True


def test_encoder_config_declares_the_special_ids_generic_code_reads():
    config = VanillaEncoderConfig()
    assert config.bos_token_id is None and config.eos_token_id is None
    assert VanillaEncoderConfig(bos_token_id=101, eos_token_id=102).to_dict()["eos_token_id"] == 102


# Settings no model can be built from, though a config may hold them while it is filled in field by field.
INCONSISTENT = [
    (VanillaEncoderConfig, {"hidden_size": 32}, r"hidden_size \(32\) must be divisible by num_attention_heads \(12\)"
                                                r".*Try num_attention_heads in \[1, 2, 4, 8, 16, 32\]"),
    (VanillaSeq2SeqConfig, {"decoder_attention_heads": 7},
     r"hidden_size \(512\) must be divisible by decoder_attention_heads \(7\)"),
    (VanillaEncoderConfig, {"position_offset": 512}, r"position_offset \(512\) leaves no room"),
    (VanillaSeq2SeqConfig, {"hidden_size": 36, "num_attention_heads": 4, "embedding_size": 35},
     r"embedding width must be even; got 35"),
    (VanillaSeq2SeqConfig, {"tie_word_embeddings": False, "share_encoder_decoder_embeddings": True},
     r"share_encoder_decoder_embeddings=True needs tie_word_embeddings=True"),
]


@pytest.mark.parametrize(("config_class", "fields", "message"), INCONSISTENT)
def test_a_config_may_be_inconsistent_while_it_is_filled_in(config_class, fields, message, tmp_path):
    config = config_class(**fields)  # transformers' ConfigTester and from_dict + overrides build configs this way
    config.save_pretrained(tmp_path)
    assert config_class.from_pretrained(tmp_path).to_dict() == config.to_dict()
    with pytest.raises(ValueError, match=message):
        config.check_architecture()


def test_check_architecture_sees_assignments_made_after_construction():
    config = VanillaEncoderConfig(hidden_size=32, num_attention_heads=4)
    config.check_architecture()
    config.num_attention_heads = 0
    with pytest.raises(ValueError, match="num_attention_heads must be a positive integer, got 0"):
        config.check_architecture()


@pytest.mark.parametrize(("config_class", "fields", "message"), INCONSISTENT[:2])
def test_no_model_is_built_from_an_inconsistent_config(config_class, fields, message, monkeypatch):
    model_class = VanillaEncoderModel if config_class is VanillaEncoderConfig else VanillaSeq2SeqForConditionalGeneration

    def allocation(*args):
        raise AssertionError("a weight was allocated before the config was checked")

    monkeypatch.setattr(torch.nn.Module, "register_parameter", allocation)
    with pytest.raises(ValueError, match=message):
        model_class(config_class(**fields))
