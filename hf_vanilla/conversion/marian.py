"""Marian (OPUS-MT) <-> the vanilla encoder-decoder.

`python -m conversion marian` maps a transformers `MarianMTModel` into `VanillaSeq2SeqForConditionalGeneration`;
`python -m conversion to-marian` maps it back. Both read one key table (`marian_table`, the reverse right to left),
so the round trip returns every tensor bit for bit. Marian is the paper's model with three choices of its own:
swish, sinusoids stored sines-then-cosines ("concatenated"), and a final logits bias (our output projection's bias).
Its layers carry fairseq's names, as BART's do (seq2seq.py holds that table).
"""

from pathlib import Path

from ..configuration_vanilla import VanillaSeq2SeqConfig
from ..modeling_vanilla import VanillaSeq2SeqForConditionalGeneration
from .building import build_model
from .errors import ConversionError
from .mapping import map_tensors
from .parity import reference_model
from .reading import load_tensors, read_source
from .seq2seq import (
    fairseq_config,
    fairseq_embeddings,
    fairseq_fields,
    fairseq_layers,
    generation_ids,
    save_seq2seq,
    verifier,
    verify_seq2seq,
    with_generation_config,
)
from .writing import write_conversion, write_source_format

MARIAN_DROPPED = {
    "model.encoder.embed_positions": "the sinusoidal table, recomputed from the config (checked equal when present)",
    "model.decoder.embed_positions": "the sinusoidal table, recomputed from the config (checked equal when present)",
}


def marian_table(config: VanillaSeq2SeqConfig) -> dict[str, str]:
    """Marian module -> ours: fairseq's layers in both stacks (the embeddings are mapped by `fairseq_embeddings`)."""
    return fairseq_layers("encoder", config.num_hidden_layers, False) | fairseq_layers("decoder",
                                                                                       config.decoder_layers, True)


def marian_config(marian: dict) -> VanillaSeq2SeqConfig:
    """MarianConfig dict -> ours. Marian is the paper's model with three of its own choices: swish, sinusoids
    stored sines-then-cosines ("concatenated"), and a final logits bias (our output projection's bias)."""
    return fairseq_config(
        marian, "Marian",
        max_position_embeddings=marian.get("max_position_embeddings", 1024),
        position_embedding_type="sinusoidal",
        sinusoidal_layout="concatenated",
        embedding_layer_norm=False,
        pad_token_id=marian.get("pad_token_id", 58100),
        eos_token_id=marian.get("eos_token_id", 0),
        decoder_start_token_id=marian.get("decoder_start_token_id", 58100),
        architectures=["VanillaSeq2SeqForConditionalGeneration"],
    )


def check_position_tables(tensors: dict, config: VanillaSeq2SeqConfig) -> None:
    """Older checkpoints saved the sinusoids; ours are recomputed, so a saved table must be the same one."""
    from ..transformer import sinusoidal_position_table

    for stack in ("encoder", "decoder"):
        saved = tensors.get(f"model.{stack}.embed_positions.weight")
        if saved is None:
            continue
        table = sinusoidal_position_table(saved.shape[0], saved.shape[1], config.sinusoidal_layout)
        diff = (saved.float() - table).abs().max().item()
        if diff > 1e-5:  # rounding aside: what the logits comparison would then catch
            raise ConversionError(f"The {stack}'s saved position table is not Marian's sinusoids (max |diff| "
                                  f"{diff:.2e}); the vanilla model cannot hold a trained table with sinusoidal "
                                  f"positions.")
        print(f"Dropped the {stack}'s saved position table: it is the sinusoids ours recomputes "
              f"(max |diff| {diff:.1e}).")


def marian_to_vanilla(tensors: dict, marian: dict):
    config = marian_config(marian)
    tensors = dict(tensors)
    check_position_tables(tensors, config)
    embeddings = fairseq_embeddings(tensors, config)
    mapped, unknown = map_tensors(tensors, marian_table(config), MARIAN_DROPPED)
    mapped.update(embeddings)
    return build_model(VanillaSeq2SeqForConditionalGeneration, config, mapped, unknown)


def convert_marian(source: str, output: str, dtype: str = "float32", force: bool = False,
                   verify_parity: bool = True, command: str | None = None) -> Path:
    source_dir, marian = read_source(source, ("marian",), "marian")
    ids = generation_ids(source_dir, marian)
    tensors = load_tensors(source_dir)
    return write_conversion(
        output, force, source, source_dir,
        build=lambda: with_generation_config(marian_to_vanilla(tensors, marian), source_dir, ids),
        verify=verifier("MarianMTModel", tensors, source_dir) if verify_parity else None,
        save=lambda model, directory: save_seq2seq(model, directory, source_dir, "MarianTokenizer"),
        title=f"{Path(source).name} as a vanilla encoder-decoder",
        command=command or f"hf-vanilla marian --source {source} --output {output}",
        dtype=dtype,
    )


# ---- vanilla -> Marian ----------------------------------------------------------------------------------------------


def marian_config_for(config: VanillaSeq2SeqConfig):
    """Ours -> MarianConfig, refusing what Marian cannot express (it would silently compute something else), every
    such field named at once."""
    from transformers import MarianConfig

    refusals = [f"{field}={getattr(config, field)!r} (Marian needs {value!r})" for field, value in (
        ("position_embedding_type", "sinusoidal"), ("sinusoidal_layout", "concatenated"), ("position_offset", 0),
        ("embedding_layer_norm", False), ("pre_norm", False), ("type_vocab_size", 0), ("lm_head_transform", False),
        ("layer_norm_eps", 1e-5), ("embedding_size", config.hidden_size),
    ) if getattr(config, field) != value]
    if refusals:  # every field at once, so that one look says whether the model has a Marian form at all
        raise ConversionError(f"This model cannot be expressed as Marian: {'; '.join(refusals)}. to-marian converts "
                              f"models converted from Marian (python -m conversion marian) and models of its shape.")
    return MarianConfig(
        **fairseq_fields(config), decoder_vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        share_encoder_decoder_embeddings=config.share_encoder_decoder_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, architectures=["MarianMTModel"],
    )


def vanilla_to_marian(tensors: dict, config: VanillaSeq2SeqConfig):
    """Our tensors -> a `MarianMTModel` holding them: the layers through `marian_table` inverted, the embeddings,
    output projection and its bias as `fairseq_embeddings` reads them, and the position tables Marian keeps as
    weights made as Marian makes them (`create_weight`): ours computes the same sinusoids, which the forward
    conversion checks, but in another order of operations, and the round trip is to return Marian's own bits."""
    from transformers import MarianMTModel
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    marian_config = marian_config_for(config)
    inverse = {ours: marian for marian, ours in marian_table(config).items()}
    tensors = dict(tensors)
    encoder = tensors.pop("model.encoder.embeddings.word_embeddings.weight", None)
    decoder = tensors.pop("model.decoder.embeddings.word_embeddings.weight", encoder)  # absent when shared
    output = tensors.pop("lm_head.decoder.weight", None)  # absent when tied
    bias = tensors.pop("lm_head.decoder.bias", None)
    if encoder is None or bias is None:
        raise ConversionError("The checkpoint has no token embeddings or no output bias "
                              "(model.encoder.embeddings.word_embeddings, lm_head.decoder.bias): it is damaged. "
                              "Save the model again.")
    mapped, unknown = map_tensors(tensors, inverse, {})
    if config.share_encoder_decoder_embeddings:
        mapped["model.shared.weight"] = encoder
    else:
        mapped["model.encoder.embed_tokens.weight"] = encoder
        mapped["model.decoder.embed_tokens.weight"] = decoder
    if output is not None:
        mapped["lm_head.weight"] = output
    mapped["final_logits_bias"] = bias[None]  # Marian stores it (1, V)
    table = MarianSinusoidalPositionalEmbedding(config.max_position_embeddings, config.hidden_size).create_weight()
    for stack in ("encoder", "decoder"):
        mapped[f"model.{stack}.embed_positions.weight"] = table
    return build_model(MarianMTModel, marian_config, mapped, unknown)


def to_marian(source: str, output: str, force: bool = False, verify_parity: bool = True) -> Path:
    """A vanilla encoder-decoder converted from Marian -> a transformers `MarianMTModel` folder (weights, config,
    the generation config, the tokenizer files). Unless `verify_parity` is False, the written folder is loaded with
    transformers alone and compared with the vanilla source: every output by the parity rule, and the tokens of
    greedy and beam-search `generate()`."""
    from transformers import GenerationConfig, MarianMTModel

    source_dir, _ = read_source(source, (VanillaSeq2SeqConfig.model_type,), "to-marian")
    try:
        config = VanillaSeq2SeqConfig.from_pretrained(source_dir)
        config.check_architecture()
    except ValueError as error:
        raise ConversionError(f"{source_dir}/config.json is not a valid vanilla encoder-decoder config: "
                              f"{error}") from None
    ours = (config.architectures or [VanillaSeq2SeqForConditionalGeneration.__name__])[0]
    if ours != VanillaSeq2SeqForConditionalGeneration.__name__:
        raise ConversionError(f"{source_dir} is a {ours!r}; to-marian converts "
                              f"{VanillaSeq2SeqForConditionalGeneration.__name__} (Marian has no other head).")
    tensors = load_tensors(source_dir)
    marian = vanilla_to_marian(tensors, config)
    if (source_dir / "generation_config.json").is_file():  # bad_words_ids, num_beams...: what generate does
        marian.generation_config = GenerationConfig.from_pretrained(source_dir)

    def verify(staging):
        print("Verifying the written MarianMTModel against the vanilla source (padded batches):")
        reference = reference_model(VanillaSeq2SeqForConditionalGeneration, tensors, source_dir)
        written = MarianMTModel.from_pretrained(staging, attn_implementation="eager")
        return verify_seq2seq(written.eval(), reference)

    return write_source_format(output, force, source_dir, marian, verify if verify_parity else None)
