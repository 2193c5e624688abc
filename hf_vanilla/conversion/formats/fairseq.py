"""fairseq's layout, which BART and Marian both keep (bart.py, marian.py): the layer table, the config fields and the
token embeddings (`model.shared`, tied to the encoder's, the decoder's and the output projection), as data and the
few functions that read them both ways."""

import torch

from ...configuration_vanilla import VanillaSeq2SeqConfig
from ..errors import ConversionError
from ..mapping import expand_table

FAIRSEQ_LAYER_TABLE = [
    ("self_attn.q_proj", "self_attn.q_proj"),
    ("self_attn.k_proj", "self_attn.k_proj"),
    ("self_attn.v_proj", "self_attn.v_proj"),
    ("self_attn.out_proj", "self_attn.o_proj"),
    ("self_attn_layer_norm", "self_attn_norm"),
    ("fc1", "ffn.up_proj"),
    ("fc2", "ffn.down_proj"),
    ("final_layer_norm", "ffn_norm"),
]
FAIRSEQ_CROSS_ATTENTION_TABLE = [
    ("encoder_attn.q_proj", "cross_attn.q_proj"),
    ("encoder_attn.k_proj", "cross_attn.k_proj"),
    ("encoder_attn.v_proj", "cross_attn.v_proj"),
    ("encoder_attn.out_proj", "cross_attn.o_proj"),
    ("encoder_attn_layer_norm", "cross_attn_norm"),
]


def fairseq_layers(stack: str, num_layers: int, cross_attention: bool) -> dict[str, str]:
    """fairseq's modules of the `num_layers` layers of `model.<stack>` -> ours, under the same prefix."""
    rows = FAIRSEQ_LAYER_TABLE + (FAIRSEQ_CROSS_ATTENTION_TABLE if cross_attention else [])
    prefix = f"model.{stack}.layers.{{i}}."
    return expand_table([(prefix + fairseq, prefix + ours) for fairseq, ours in rows], num_layers)


def fairseq_layer_counts(config: VanillaSeq2SeqConfig, stacks: tuple) -> list[tuple[str, str, int]]:
    """The layer count each of `stacks` declares, as `mapping.check_layer_counts` checks it against a fairseq-layout
    checkpoint (keys as the head classes have them, `model.` prefixed): its config field and our value of it."""
    fields = {"encoder": ("encoder_layers", config.num_hidden_layers), "decoder": ("decoder_layers",
                                                                                   config.decoder_layers)}
    return [(f"model.{stack}.layers.{{i}}.", *fields[stack]) for stack in stacks]


def fairseq_fields(config: VanillaSeq2SeqConfig) -> dict:
    """Ours -> the fields a BART-family config (BartConfig, MarianConfig) names alike: `fairseq_config` read
    backwards. Each format adds its own (positions, vocabularies, heads)."""
    return dict(
        vocab_size=config.vocab_size, d_model=config.hidden_size, encoder_layers=config.num_hidden_layers,
        decoder_layers=config.decoder_layers, encoder_attention_heads=config.num_attention_heads,
        decoder_attention_heads=config.decoder_attention_heads, encoder_ffn_dim=config.intermediate_size,
        decoder_ffn_dim=config.decoder_intermediate_size, activation_function=config.hidden_act,
        dropout=config.hidden_dropout_prob, attention_dropout=config.attention_probs_dropout_prob,
        init_std=config.initializer_range, scale_embedding=config.scale_embeddings, pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def fairseq_required(config: VanillaSeq2SeqConfig, title: str) -> dict:
    """What fairseq's layout (BART's and Marian's) computes with one value only, for the reverse conversions'
    `required`: {field: (value, why)}; each format adds its positions and embeddings."""
    return {
        "pre_norm": (False, f"{title} normalises after each residual sum (post-LN)"),
        "type_vocab_size": (0, f"{title} has no token types"),
        "lm_head_transform": (False, f"{title}'s output projection has no transform"),
        "layer_norm_eps": (1e-5, f"{title}'s LayerNorms use torch's default epsilon"),
        "embedding_size": (config.hidden_size, f"{title} embeds at the model width"),
    }


def fairseq_config(source: dict, title: str, default_ids: dict[str, int], **choices) -> VanillaSeq2SeqConfig:
    """A BART-family config dict (MarianConfig, BartConfig: fairseq's field names) -> ours. `default_ids`: the
    format's special token ids (pad, eos, decoder start), each read from `source` where it has it; `choices` are
    the format's own (positions, embedding LayerNorm)."""
    shared = source.get("share_encoder_decoder_embeddings", True)
    vocab_size = source.get("vocab_size", 58101)
    decoder_vocab_size = source.get("decoder_vocab_size") or vocab_size
    if decoder_vocab_size != vocab_size and not shared:
        raise ConversionError(
            f"Separate source and target vocabularies of different sizes ({vocab_size} vs {decoder_vocab_size}) "
            f"have no vanilla equivalent: our encoder and decoder embed the same vocabulary."
        )
    for ignored in ("activation_dropout", "encoder_layerdrop", "decoder_layerdrop"):
        if source.get(ignored):
            print(f"Note: {ignored}={source[ignored]} is training-time regularisation the vanilla model does not "
                  f"have; inference is unaffected.")
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=source.get("d_model", 1024),
        num_hidden_layers=source.get("encoder_layers", 12),
        num_attention_heads=source.get("encoder_attention_heads", 16),
        intermediate_size=source.get("encoder_ffn_dim", 4096),
        decoder_layers=source.get("decoder_layers", 12),
        decoder_attention_heads=source.get("decoder_attention_heads", 16),
        decoder_intermediate_size=source.get("decoder_ffn_dim", 4096),
        hidden_act=source.get("activation_function", "gelu"),
        hidden_dropout_prob=source.get("dropout", 0.1),
        attention_probs_dropout_prob=source.get("attention_dropout", 0.0),
        initializer_range=source.get("init_std", 0.02),
        type_vocab_size=0,
        layer_norm_eps=1e-5,  # fairseq's LayerNorms use torch's default
        scale_embeddings=source.get("scale_embedding", False),
        pre_norm=False,
        lm_head_transform=False,
        trainable_logits_bias=False,  # `final_logits_bias` is a buffer: BART and Marian never train it
        share_encoder_decoder_embeddings=shared and source.get("tie_word_embeddings", True),
        tie_word_embeddings=source.get("tie_word_embeddings", True),
        bos_token_id=source.get("bos_token_id"),
    ) | {name: source.get(name, default) for name, default in default_ids.items()}
    if source.get("id2label"):  # the classification head's labels
        fields |= {"id2label": {int(k): v for k, v in source["id2label"].items()}, "label2id": source.get("label2id")}
    try:
        config = VanillaSeq2SeqConfig(**(fields | choices))
        config.check_architecture()
        return config
    except ValueError as error:
        raise ConversionError(f"The {title} configuration has no vanilla equivalent: {error}") from None


def fairseq_embeddings(tensors: dict, config: VanillaSeq2SeqConfig) -> dict:
    """BART and Marian store their token embeddings as `model.shared` and, tied to it, the encoder's, the decoder's
    and the output projection (its bias as `final_logits_bias`); which of them a checkpoint holds depends on the
    version that saved it."""
    shared = tensors.pop("model.shared.weight", None)
    encoder = tensors.pop("model.encoder.embed_tokens.weight", shared)
    decoder = tensors.pop("model.decoder.embed_tokens.weight", shared)
    output = tensors.pop("lm_head.weight", decoder)
    if encoder is None or decoder is None:
        raise ConversionError("The checkpoint has no token embeddings (model.shared / embed_tokens).")
    mapped = {"model.encoder.embeddings.word_embeddings.weight": encoder}
    tied = {"decoder embeddings": decoder} if config.share_encoder_decoder_embeddings else {}
    if config.tie_word_embeddings:
        tied["output projection"] = output
    else:
        mapped["lm_head.decoder.weight"] = output
    if not config.share_encoder_decoder_embeddings:
        mapped["model.decoder.embeddings.word_embeddings.weight"] = decoder
    reference = encoder if config.share_encoder_decoder_embeddings else decoder
    for what, tensor in tied.items():
        if tensor is not reference and not torch.equal(tensor, reference):
            raise ConversionError(f"The checkpoint's {what} differ from the embeddings they are tied to in its config "
                                  f"(share_encoder_decoder_embeddings / tie_word_embeddings).")
    bias = tensors.pop("final_logits_bias", None)
    mapped["lm_head.decoder.bias"] = (bias if bias is not None else torch.zeros(1, config.vocab_size)).reshape(-1)
    return mapped
