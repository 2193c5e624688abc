"""Marian (OPUS-MT) <-> the vanilla encoder-decoder.

`python -m conversion marian` maps a transformers `MarianMTModel` into `VanillaSeq2SeqForConditionalGeneration`;
`python -m conversion to-marian` maps it back. Both read one key table (`marian_table`, the reverse right to left),
so the round trip returns every tensor bit for bit; `FORMAT` below is the data, and the flow is conversion/flow.py.
Marian is the paper's model with three choices of its own: swish, sinusoids stored sines-then-cosines
("concatenated"), and a final logits bias (our output projection's bias, a buffer never trained, as Marian's is:
`trainable_logits_bias=False`, set by fairseq.py for BART too). Its layers carry fairseq's names, as BART's
do (fairseq.py holds that table).
"""

from ...configuration_vanilla import VanillaSeq2SeqConfig
from ...modeling_seq2seq import VanillaSeq2SeqForConditionalGeneration
from ..errors import ConversionError
from .fairseq import fairseq_config, fairseq_embeddings, fairseq_fields, fairseq_layers, fairseq_required
from .seq2seq import Seq2SeqFormat, Seq2SeqHead

MARIAN = "MarianMTModel"  # the one class: Marian converts no other head

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
        marian, "Marian", {"pad_token_id": 58100, "eos_token_id": 0, "decoder_start_token_id": 58100},
        max_position_embeddings=marian.get("max_position_embeddings", 1024),
        position_embedding_type="sinusoidal",
        sinusoidal_layout="concatenated",
        embedding_layer_norm=False,
        architectures=["VanillaSeq2SeqForConditionalGeneration"],
    )


def check_position_tables(tensors: dict, config: VanillaSeq2SeqConfig) -> None:
    """Older checkpoints saved the sinusoids; ours are recomputed, so a saved table must be the same one."""
    from ...transformer import sinusoidal_position_table

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


def prepare(tensors: dict, config: VanillaSeq2SeqConfig) -> dict:
    """The source's tensors, their saved position tables checked (`check_position_tables`), in a dict of our own."""
    check_position_tables(tensors, config)
    return dict(tensors)


# ---- vanilla -> Marian ----------------------------------------------------------------------------------------------


def required(config: VanillaSeq2SeqConfig) -> dict:
    """What Marian computes with one value only (any other it would silently compute as something else)."""
    return {
        "position_embedding_type": ("sinusoidal", "Marian's positions are sinusoids"),
        "sinusoidal_layout": ("concatenated", "Marian stores sines then cosines"),
        "position_offset": (0, "Marian numbers positions from 0"),
        "embedding_layer_norm": (False, "Marian does not LayerNorm its embeddings"),
        **fairseq_required(config, "Marian"),
    }


def marian_config_for(config: VanillaSeq2SeqConfig):
    """Ours -> MarianConfig (`required` has refused what Marian cannot express)."""
    from transformers import MarianConfig

    return MarianConfig(
        **fairseq_fields(config), decoder_vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        share_encoder_decoder_embeddings=config.share_encoder_decoder_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, architectures=["MarianMTModel"],
    )


def marian_embeddings(tensors: dict, config: VanillaSeq2SeqConfig, head: str, marian_config) -> dict:
    """Our embeddings, output projection and its bias, popped from `tensors`, as `fairseq_embeddings` reads them; and
    the position tables Marian keeps as weights, made as Marian makes them (`create_weight`): ours computes the same
    sinusoids, which the forward conversion checks, but in another order of operations, and the round trip is to
    return Marian's own bits."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    encoder = tensors.pop("model.encoder.embeddings.word_embeddings.weight", None)
    decoder = tensors.pop("model.decoder.embeddings.word_embeddings.weight", encoder)  # absent when shared
    output = tensors.pop("lm_head.decoder.weight", None)  # absent when tied
    bias = tensors.pop("lm_head.decoder.bias", None)
    if encoder is None or bias is None:
        raise ConversionError("The checkpoint has no token embeddings or no output bias "
                              "(model.encoder.embeddings.word_embeddings, lm_head.decoder.bias): it is damaged. "
                              "Save the model again.")
    if config.share_encoder_decoder_embeddings:
        mapped = {"model.shared.weight": encoder}
    else:
        mapped = {"model.encoder.embed_tokens.weight": encoder, "model.decoder.embed_tokens.weight": decoder}
    if output is not None:
        mapped["lm_head.weight"] = output
    mapped["final_logits_bias"] = bias[None]  # Marian stores it (1, V)
    table = MarianSinusoidalPositionalEmbedding(config.max_position_embeddings, config.hidden_size).create_weight()
    for stack in ("encoder", "decoder"):
        mapped[f"model.{stack}.embed_positions.weight"] = table
    return mapped


FORMAT = Seq2SeqFormat(
    name="marian",
    title="Marian",
    model_types=("marian",),
    heads={MARIAN: Seq2SeqHead(VanillaSeq2SeqForConditionalGeneration, decoder_inputs=True, generates=True)},
    tokenizer_class="MarianTokenizer",
    vanilla_config=lambda marian, head: marian_config(marian),
    key_table=lambda config, head: marian_table(config),
    prepare=prepare,
    embeddings=lambda tensors, config, head: fairseq_embeddings(tensors, config),
    dropped=lambda config, head: MARIAN_DROPPED,
    required=lambda config, head: required(config),
    source_config=lambda config, head: marian_config_for(config),
    source_embeddings=marian_embeddings,
    reverse_hint="to-marian converts models converted from Marian (python -m conversion marian) and models of its "
                 "shape.",
)


def marian_to_vanilla(tensors: dict, marian: dict):
    """In memory: a MarianMTModel's tensors and config dict -> ours, sharing their storage."""
    return FORMAT.to_vanilla(tensors, marian, MARIAN)
