"""Encoder-decoders -> `VanillaSeq2SeqForConditionalGeneration`.

Three sub-commands:
    warm-start  one BERT checkpoint -> both stacks, cross-attention freshly initialised: the bert2bert of
                Rothe et al. 2020 (https://arxiv.org/abs/1907.12461), as `EncoderDecoderModel.from_encoder_decoder_
                pretrained(bert, bert)` builds it.
    bert2bert   a transformers `EncoderDecoderModel` (BertModel encoder, BertLMHeadModel decoder with cross-attention).
    marian      a transformers `MarianMTModel` (OPUS-MT).

BERT layers map through `bert.ENCODER_TABLE`, used for both stacks; the decoder adds cross-attention. Every
conversion is checked against the transformers model it came from: logits on a padded batch, and for trained models
the token sequences of greedy and beam-search `generate()`.
"""

import json
from pathlib import Path

import torch

from hf_vanilla import VanillaSeq2SeqConfig, VanillaSeq2SeqForConditionalGeneration

from .bert import ENCODER_TABLE
from .bert import FORMAT as BERT
from .common import (
    HALF_PRECISION_TOLERANCE,
    PRECISION_NAMES,
    TOKENIZER_FILES,
    ConversionError,
    build_model,
    copy_side_files,
    expand_table,
    limits,
    load_tensors,
    map_tensors,
    max_differences,
    normalise_keys,
    read_config,
    read_source,
    reference_model,
    report,
    require_model_type,
    resolve_source,
    save_checkpoint,
    untie,
    verification_batch,
    write_conversion,
)

LOGITS_TOLERANCE = 5e-5  # fp32, whole model: the sum of every layer's rounding
ENCODER_TOLERANCE = 1e-5  # fp32, BERT's hidden states, as the encoder converter

# ---- BERT stacks ------------------------------------------------------------------------------------------------

# BERT's decoder layer (BertLMHeadModel with add_cross_attention) = an encoder layer + this, between self-attention
# and the feed-forward network, which is our decoder layer's order too.
CROSS_ATTENTION_TABLE = [
    ("encoder.layer.{i}.crossattention.self.query", "encoder.layers.{i}.cross_attn.q_proj"),
    ("encoder.layer.{i}.crossattention.self.key", "encoder.layers.{i}.cross_attn.k_proj"),
    ("encoder.layer.{i}.crossattention.self.value", "encoder.layers.{i}.cross_attn.v_proj"),
    ("encoder.layer.{i}.crossattention.output.dense", "encoder.layers.{i}.cross_attn.o_proj"),
    ("encoder.layer.{i}.crossattention.output.LayerNorm", "encoder.layers.{i}.cross_attn_norm"),
]

# BertConfig fields our config takes as they are (`decoder_*` sizes come from the decoder's BertConfig).
BERT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "initializer_range", "pad_token_id",
)
# Fields both stacks read from one value in our config: the two BERTs must agree on them.
SHARED_BY_STACKS = ("vocab_size", "hidden_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
                    "layer_norm_eps", "pad_token_id")


def bert_stack_table(stack: str, num_layers: int, cross_attention: bool) -> dict[str, str]:
    """BERT module (without `bert.`) -> our module inside `model.<stack>`; the pooler is not part of a stack."""
    table = list(ENCODER_TABLE) + (CROSS_ATTENTION_TABLE if cross_attention else [])
    return {bert: f"model.{stack}" + ours.removeprefix("encoder")
            for bert, ours in expand_table(table, num_layers).items() if bert != "pooler.dense"}


def bert_seq2seq_config(encoder: dict, decoder: dict, decoder_start_token_id, eos_token_id, bos_token_id,
                        share_embeddings: bool) -> VanillaSeq2SeqConfig:
    """Two BertConfig dicts -> our config: BERT's departures from the paper (learned positions, GELU, segments,
    embedding LayerNorm, eps 1e-12, no embedding scale, the MLM transform before the output projection)."""
    # encoder_config validates each BERT (absolute positions only) the way the encoder converter does; the decoder's
    # is_decoder/add_cross_attention flags are what make it a decoder here, not a reason to refuse.
    as_encoder = {k: v for k, v in decoder.items() if k not in ("is_decoder", "add_cross_attention")}
    enc, dec = BERT.encoder_config(encoder, "base"), BERT.encoder_config(as_encoder, "base")
    for field in SHARED_BY_STACKS:
        if getattr(enc, field) != getattr(dec, field):
            raise ConversionError(
                f"The encoder and decoder BERTs differ in {field} "
                f"({getattr(enc, field)!r} vs {getattr(dec, field)!r}); "
                f"the vanilla encoder-decoder shares it between its stacks (a different hidden_size would also need "
                f"transformers' enc_to_dec_proj, which it does not have)."
            )
    try:
        config = VanillaSeq2SeqConfig(
            **{k: getattr(enc, k) for k in BERT_FIELDS},
            decoder_layers=dec.num_hidden_layers,
            decoder_attention_heads=dec.num_attention_heads,
            decoder_intermediate_size=dec.intermediate_size,
            position_embedding_type="learned",
            embedding_layer_norm=True,
            scale_embeddings=False,
            lm_head_transform=True,
            share_encoder_decoder_embeddings=share_embeddings,
            tie_word_embeddings=decoder.get("tie_word_embeddings", True),
            decoder_start_token_id=decoder_start_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            architectures=["VanillaSeq2SeqForConditionalGeneration"],
        )
        config.check_architecture()
    except ValueError as error:
        raise ConversionError(f"The source's configuration has no vanilla equivalent: {error}") from None
    return config


def bert2bert_tensors_to_vanilla(tensors: dict, config: VanillaSeq2SeqConfig, tie_word_embeddings: bool):
    """`EncoderDecoderModel(BertModel, BertLMHeadModel)` tensors -> our model, without copying them."""
    encoder = normalise_keys({k.removeprefix("encoder."): v for k, v in tensors.items() if k.startswith("encoder.")},
                             "bert.")
    decoder = normalise_keys({k.removeprefix("decoder."): v for k, v in tensors.items() if k.startswith("decoder.")},
                             "bert.")
    others = [k for k in tensors if not k.startswith(("encoder.", "decoder."))]
    if tie_word_embeddings:
        try:
            # checks the output weight is the decoder's embedding matrix, then drops it
            untie(decoder, BERT.heads["masked-lm"].tied, "BERT", "")
        except ConversionError:
            raise ConversionError(
                "The decoder's output weights differ from its word embeddings, although its config ties them "
                "(tie_word_embeddings); set tie_word_embeddings to false in the source's decoder config to keep both."
            ) from None
    elif "cls.predictions.bias" in decoder:
        decoder.pop("cls.predictions.decoder.bias", None)  # the same bias, stored twice
    encoder_dropped = BERT.dropped_keys("base") | {
        "pooler": "BERT's pooler (tanh over [CLS]): an encoder-decoder's decoder reads every encoder state, never it"
    }
    decoder_dropped = BERT.dropped_keys("masked-lm")
    encoder_table = bert_stack_table("encoder", config.num_hidden_layers, cross_attention=False)
    decoder_table = bert_stack_table("decoder", config.decoder_layers, cross_attention=True)
    decoder_table.update(expand_table(list(BERT.heads["masked-lm"].table), 0))
    if not tie_word_embeddings:
        decoder_table["cls.predictions.decoder"] = "lm_head.decoder"  # untied: an output matrix of its own
    mapped, unknown = map_tensors(encoder, encoder_table, encoder_dropped)
    mapped_decoder, unknown_decoder = map_tensors(decoder, decoder_table, decoder_dropped)
    mapped.update(mapped_decoder)
    unknown = [f"encoder.{k}" for k in unknown] + [f"decoder.{k}" for k in unknown_decoder] + others
    return build_model(VanillaSeq2SeqForConditionalGeneration, config, mapped, unknown)


# ---- bert2bert ----------------------------------------------------------------------------------------------------


def read_bert2bert_config(source_dir: Path) -> dict:
    config = read_config(source_dir)
    require_model_type(config, ("encoder-decoder",), "bert2bert", source_dir)
    for side in ("encoder", "decoder"):
        model_type = config.get(side, {}).get("model_type")
        if model_type != "bert":
            raise ConversionError(
                f"{source_dir} is an encoder-decoder whose {side} is {model_type!r}; the bert2bert converter reads "
                f"BERT encoders and BERT decoders only (model_type 'bert' on both sides)."
            )
    if not config["decoder"].get("add_cross_attention"):
        raise ConversionError(f"{source_dir}: the decoder BERT has no cross-attention (add_cross_attention is false).")
    return config


def generation_ids(source_dir: Path, config: dict) -> dict:
    """decoder_start / eos / pad / bos ids: the source's generation_config.json first, then its config.json."""
    path = source_dir / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    ids = {}
    for name in ("decoder_start_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        ids[name] = generation.get(name, config.get(name, config.get("decoder", {}).get(name)))
    if ids["decoder_start_token_id"] is None:
        raise ConversionError(
            f"{source_dir} sets no decoder_start_token_id (neither generation_config.json nor config.json): "
            f"generation would not know how to start. Set it in the source's config ([CLS], 101, for bert2bert)."
        )
    return ids


def fill_tied_decoder(tensors: dict) -> list[str]:
    """`tie_encoder_decoder=True` (transformers 4) shared every encoder module with the decoder, so checkpoints
    may store each such tensor once, under `encoder.`. Give the decoder its own copy of what it lacks."""
    filled = []
    for key in [k for k in tensors if k.startswith("encoder.") and not k.startswith("encoder.pooler.")]:
        twin = "decoder.bert." + key.removeprefix("encoder.")
        if twin not in tensors:
            tensors[twin] = tensors[key].clone()
            filled.append(twin)
    return filled


def convert_bert2bert(source: str, output: str, dtype: str = "float32", force: bool = False,
                      verify_parity: bool = True, command: str | None = None) -> Path:
    source_dir = resolve_source(source)
    config = read_bert2bert_config(source_dir)
    ids = generation_ids(source_dir, config)
    tensors = load_tensors(source_dir)
    tie_encoder_decoder = bool(config.get("tie_encoder_decoder", False))
    filled = fill_tied_decoder(tensors) if tie_encoder_decoder else []
    if filled:
        print(f"tie_encoder_decoder: the decoder shares the encoder's weights; copied {len(filled)} tensors into it.")
    vanilla = bert_seq2seq_config(config["encoder"], config["decoder"], ids["decoder_start_token_id"],
                                  ids["eos_token_id"], ids["bos_token_id"],
                                  # One shared matrix needs the output tied too; else equal copies serve as well.
                                  share_embeddings=tie_encoder_decoder
                                  and config["decoder"].get("tie_word_embeddings", True))
    return write_conversion(
        output, force, source, source_dir,
        build=lambda: with_generation_config(
            bert2bert_tensors_to_vanilla(tensors, vanilla, vanilla.tie_word_embeddings), source_dir, ids),
        # `tensors` holds the decoder's filled-in copies too: transformers 5 no longer ties encoder and decoder.
        verify=verifier("EncoderDecoderModel", tensors, source_dir, with_token_types=True) if verify_parity else None,
        save=lambda model, directory: save_seq2seq(model, directory, source_dir, "BertTokenizer"),
        title=f"{Path(source).name} as a vanilla encoder-decoder",
        command=command or f"hf-vanilla bert2bert --source {source} --output {output}",
        dtype=dtype,
    )


# ---- warm-start -------------------------------------------------------------------------------------------------


def fresh_cross_attention(hidden_size: int, num_layers: int, std: float, generator) -> dict:
    """New cross-attention in BERT's names, initialised as BERT initialises new modules (and as
    `from_encoder_decoder_pretrained` leaves them): weights ~ N(0, initializer_range), zero biases, unit LayerNorm."""
    tensors = {}
    for i in range(num_layers):
        prefix = f"decoder.bert.encoder.layer.{i}.crossattention."
        for name in ("self.query", "self.key", "self.value", "output.dense"):
            tensors[f"{prefix}{name}.weight"] = torch.randn(hidden_size, hidden_size, generator=generator) * std
            tensors[f"{prefix}{name}.bias"] = torch.zeros(hidden_size)
        tensors[f"{prefix}output.LayerNorm.weight"] = torch.ones(hidden_size)
        tensors[f"{prefix}output.LayerNorm.bias"] = torch.zeros(hidden_size)
    return tensors


def fresh_lm_head(hidden_size: int, vocab_size: int, std: float, generator) -> dict:
    """BERT's MLM head, new: the transform initialised as above, the output bias zero (its weight is the tied
    embedding matrix)."""
    return {
        "decoder.cls.predictions.transform.dense.weight":
            torch.randn(hidden_size, hidden_size, generator=generator) * std,
        "decoder.cls.predictions.transform.dense.bias": torch.zeros(hidden_size),
        "decoder.cls.predictions.transform.LayerNorm.weight": torch.ones(hidden_size),
        "decoder.cls.predictions.transform.LayerNorm.bias": torch.zeros(hidden_size),
        "decoder.cls.predictions.bias": torch.zeros(vocab_size),
    }


def special_ids(source_dir: Path, decoder_start_token_id, eos_token_id) -> tuple[int, int]:
    """[CLS] starts the target and [SEP] ends it, as in the published bert2bert models."""
    if decoder_start_token_id is not None and eos_token_id is not None:
        return decoder_start_token_id, eos_token_id
    if not any((source_dir / name).is_file() for name in ("tokenizer.json", "vocab.txt")):
        # Without a vocabulary AutoTokenizer still builds a BERT tokenizer, of five special tokens: wrong ids.
        raise ConversionError(
            f"{source_dir} has no tokenizer (tokenizer.json or vocab.txt) to read [CLS] and [SEP] from; pass "
            f"--decoder-start-token-id and --eos-token-id (101 and 102 for BERT's uncased vocabulary)."
        )
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source_dir)
        cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    except Exception as error:
        raise ConversionError(
            f"Could not read [CLS] and [SEP] from the tokenizer in {source_dir} ({type(error).__name__}: {error}); "
            f"pass --decoder-start-token-id and --eos-token-id (101 and 102 for BERT's uncased vocabulary)."
        ) from None
    if cls is None or sep is None:
        raise ConversionError(f"The tokenizer in {source_dir} has no [CLS]/[SEP]; pass --decoder-start-token-id "
                              f"and --eos-token-id.")
    return (decoder_start_token_id if decoder_start_token_id is not None else cls,
            eos_token_id if eos_token_id is not None else sep)


def warm_start_tensors(bert_tensors: dict, bert_config: dict, seed: int) -> tuple[dict, bool]:
    """The tensors of the `EncoderDecoderModel` that `from_encoder_decoder_pretrained(bert, bert)` builds: BERT as
    the encoder, an own copy of BERT as the decoder, new cross-attention, and the MLM head (new if BERT has none).
    Returns them and whether the LM head came from the source."""
    bert = normalise_keys(bert_tensors, "bert.")
    if any(".crossattention." in k for k in bert):
        raise ConversionError("The source BERT already has cross-attention: it is half of an encoder-decoder. "
                              "Convert the whole model with the bert2bert sub-command.")
    generator = torch.Generator().manual_seed(seed)
    size, std = bert_config["hidden_size"], bert_config.get("initializer_range", 0.02)
    tensors = {}
    for key, tensor in bert.items():
        if key.startswith("cls."):
            tensors[f"decoder.{key}"] = tensor.clone()
        elif not key.startswith("pooler."):  # BertLMHeadModel has no pooler; the encoder (BertModel) keeps it
            tensors[f"encoder.{key}"] = tensor
            tensors[f"decoder.bert.{key}"] = tensor.clone()  # the decoder holds its own copy
        else:
            tensors[f"encoder.{key}"] = tensor
    tensors.update(fresh_cross_attention(size, bert_config["num_hidden_layers"], std, generator))
    has_head = "decoder.cls.predictions.transform.dense.weight" in tensors
    if not has_head:
        tensors.update(fresh_lm_head(size, bert_config["vocab_size"], std, generator))
    for key in [k for k in tensors if k.startswith("decoder.cls.seq_relationship.")]:
        del tensors[key]  # next-sentence prediction: BertLMHeadModel has no such head
    return tensors, has_head


def convert_warm_start(source: str, output: str, dtype: str = "float32", force: bool = False,
                       verify_parity: bool = True, seed: int = 0, decoder_start_token_id: int | None = None,
                       eos_token_id: int | None = None, command: str | None = None) -> Path:
    source_dir, bert_config = read_source(source, ("bert",), "warm-start")
    start, eos = special_ids(source_dir, decoder_start_token_id, eos_token_id)
    bert_tensors = load_tensors(source_dir)
    tensors, has_head = warm_start_tensors(bert_tensors, bert_config, seed)
    print("Decoder LM head: " + ("BERT's masked-LM head." if has_head else
          "the source has no masked-LM head: transform freshly initialised, output bias zero, output weights tied to "
          "the decoder's word embeddings."))
    print(f"Cross-attention: freshly initialised (N(0, {bert_config.get('initializer_range', 0.02)}), seed {seed}).")
    encoder_config = {k: v for k, v in bert_config.items() if k not in ("is_decoder", "add_cross_attention")}
    decoder_config = encoder_config | {"is_decoder": True, "add_cross_attention": True}
    pad = bert_config.get("pad_token_id", 0)
    config = bert_seq2seq_config(encoder_config, decoder_config, start, eos, start, share_embeddings=False)
    ids = {"decoder_start_token_id": start, "bos_token_id": start, "eos_token_id": eos, "pad_token_id": pad}
    return write_conversion(
        output, force, source, source_dir,
        build=lambda: with_generation_config(
            bert2bert_tensors_to_vanilla(tensors, config, tie_word_embeddings=True), None, ids),
        verify=(lambda model: verify_warm_start(source_dir, bert_tensors, model, tensors, encoder_config,
                                                decoder_config, ids)) if verify_parity else None,
        save=lambda model, directory: save_seq2seq(model, directory, source_dir, "BertTokenizer",
                                                   copy_generation_config=False),
        title=f"bert2bert warm-started from {Path(source).name}",
        command=command or f"hf-vanilla warm-start --source {source} --output {output}",
        notes="Cross-attention is freshly initialised: fine-tune before use.",
        dtype=dtype,
    )


def verify_warm_start(source_dir: Path, bert_tensors: dict, model, tensors: dict, encoder_config: dict,
                      decoder_config: dict, ids: dict) -> tuple[bool, str]:
    """The encoder against transformers' BertModel (the source's `bert_tensors`) layer by layer (1e-5), then the
    whole model against the `EncoderDecoderModel` holding `tensors`, the same weights (the same fresh
    cross-attention), logits within 5e-5."""
    from transformers import BertConfig, BertModel, EncoderDecoderConfig, EncoderDecoderModel

    print("Verifying the encoder against transformers' BertModel (eager attention, padded batch):")
    bert = reference_model(BertModel, bert_tensors, source_dir)
    batch = verification_batch(model.config)
    with torch.no_grad():
        expected = bert(**batch, output_hidden_states=True).hidden_states
        ours = model.model.encoder(**batch, output_hidden_states=True).hidden_states
    half = HALF_PRECISION_TOLERANCE.get(model.dtype)
    tolerance = half or ENCODER_TOLERANCE
    diffs = max_differences(expected, ours, batch["attention_mask"])
    encoder_ok = report("encoder", diffs, limits(expected, tolerance, relative=half is not None))
    del bert

    print("Verifying the whole model against transformers' bert2bert with the same weights:")
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig.from_dict(encoder_config), BertConfig.from_dict(decoder_config), **ids)
    reference = reference_model(EncoderDecoderModel, tensors, config=config)
    ok, summary = verify_seq2seq(reference, model, with_token_types=True, generation=False)
    rule = f"{tolerance:g} x max(1, |output|)" if half else f"{tolerance:g}"
    encoder = f"encoder hidden states max |diff| {max(diffs):.2e} (tolerance {rule})"
    return encoder_ok and ok, f"{encoder}; {summary}"


# ---- Marian -----------------------------------------------------------------------------------------------------

# One Marian layer -> ours. Marian (like BART) is post-LN, as the paper and as our default.
MARIAN_LAYER_TABLE = [
    ("self_attn.q_proj", "self_attn.q_proj"),
    ("self_attn.k_proj", "self_attn.k_proj"),
    ("self_attn.v_proj", "self_attn.v_proj"),
    ("self_attn.out_proj", "self_attn.o_proj"),
    ("self_attn_layer_norm", "self_attn_norm"),
    ("fc1", "ffn.up_proj"),
    ("fc2", "ffn.down_proj"),
    ("final_layer_norm", "ffn_norm"),
]
MARIAN_CROSS_ATTENTION_TABLE = [
    ("encoder_attn.q_proj", "cross_attn.q_proj"),
    ("encoder_attn.k_proj", "cross_attn.k_proj"),
    ("encoder_attn.v_proj", "cross_attn.v_proj"),
    ("encoder_attn.out_proj", "cross_attn.o_proj"),
    ("encoder_attn_layer_norm", "cross_attn_norm"),
]
MARIAN_DROPPED = {
    "model.encoder.embed_positions": "the sinusoidal table, recomputed from the config (checked equal when present)",
    "model.decoder.embed_positions": "the sinusoidal table, recomputed from the config (checked equal when present)",
}


def marian_table(config: VanillaSeq2SeqConfig) -> dict[str, str]:
    table = {}
    for stack, num_layers, layer_table in (
        ("encoder", config.num_hidden_layers, MARIAN_LAYER_TABLE),
        ("decoder", config.decoder_layers, MARIAN_LAYER_TABLE + MARIAN_CROSS_ATTENTION_TABLE),
    ):
        prefix = f"model.{stack}.layers.{{i}}."
        table.update(expand_table([(prefix + m, prefix + ours) for m, ours in layer_table], num_layers))
    return table


def fairseq_config(source: dict, title: str, **choices) -> VanillaSeq2SeqConfig:
    """A BART-family config dict (MarianConfig, BartConfig: fairseq's field names) -> ours; `choices` are the
    format's own (positions, embedding LayerNorm, defaults)."""
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
        share_encoder_decoder_embeddings=shared and source.get("tie_word_embeddings", True),
        tie_word_embeddings=source.get("tie_word_embeddings", True),
        bos_token_id=source.get("bos_token_id"),
    )
    if source.get("id2label"):  # the classification head's labels
        fields |= {"id2label": {int(k): v for k, v in source["id2label"].items()}, "label2id": source.get("label2id")}
    try:
        config = VanillaSeq2SeqConfig(**(fields | choices))
        config.check_architecture()
        return config
    except ValueError as error:
        raise ConversionError(f"The {title} configuration has no vanilla equivalent: {error}") from None


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


def marian_embeddings(tensors: dict, config: VanillaSeq2SeqConfig) -> dict:
    """Marian stores its token embeddings as `model.shared` and, tied to it, the encoder's, the decoder's and the
    output projection; which of them a checkpoint holds depends on the version that saved it."""
    shared = tensors.pop("model.shared.weight", None)
    encoder = tensors.pop("model.encoder.embed_tokens.weight", shared)
    decoder = tensors.pop("model.decoder.embed_tokens.weight", shared)
    output = tensors.pop("lm_head.weight", decoder)
    if encoder is None or decoder is None:
        raise ConversionError("The Marian checkpoint has no token embeddings (model.shared / embed_tokens).")
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


def check_position_tables(tensors: dict, config: VanillaSeq2SeqConfig) -> None:
    """Older checkpoints saved the sinusoids; ours are recomputed, so a saved table must be the same one."""
    from hf_vanilla.transformer import sinusoidal_position_table

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
    embeddings = marian_embeddings(tensors, config)
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
        verify=verifier("MarianMTModel", tensors, source_dir, with_token_types=False) if verify_parity else None,
        save=lambda model, directory: save_seq2seq(model, directory, source_dir, "MarianTokenizer"),
        title=f"{Path(source).name} as a vanilla encoder-decoder",
        command=command or f"hf-vanilla marian --source {source} --output {output}",
        dtype=dtype,
    )


# ---- shared: generation config, saving, verification ------------------------------------------------------------


def with_generation_config(model, source_dir: Path | None, ids: dict):
    """`model`, given the source's generation config whole (forced_eos_token_id, bad_words_ids, num_beams... all
    change what `generate` returns); without one, the special ids alone."""
    from transformers import GenerationConfig

    if source_dir is not None and (source_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source_dir)
    else:
        model.generation_config = GenerationConfig(**{k: v for k, v in ids.items() if v is not None})
    return model


def save_seq2seq(model, directory: Path, source_dir: Path, tokenizer_class: str,
                 copy_generation_config: bool = True) -> None:
    """Our checkpoint, the source's tokenizer files, and its generation_config.json copied byte for byte.

    Sentence-transformers files are left behind: they describe an embedding model (pooling, normalisation), which an
    encoder-decoder is not. The tokenizer config names its class when the source's did not: AutoTokenizer found it
    through the source's model_type, which the converted config no longer has (OPUS-MT's tokenizer_config.json
    holds only the languages, and Marian has no tokenizer.json to fall back on)."""
    save_checkpoint(model, directory, None)
    generation = ("generation_config.json",) if copy_generation_config else ()
    copied = copy_side_files(source_dir, directory, TOKENIZER_FILES + generation, folders=())
    if set(copied) - set(generation):
        path = directory / "tokenizer_config.json"
        tokenizer_config = json.loads(path.read_text()) if path.is_file() else {}
        if "tokenizer_class" not in tokenizer_config:
            tokenizer_config["tokenizer_class"] = tokenizer_class
            path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def verifier(reference_class: str, tensors: dict, source_dir: Path, with_token_types: bool):
    """`verify` for `write_conversion`: transformers' `reference_class`, holding the source's `tensors`, against ours
    (`verify_seq2seq`)."""

    def verify(model) -> tuple[bool, str]:
        import transformers

        reference = reference_model(getattr(transformers, reference_class), tensors, source_dir)
        print(f"Verifying against transformers' {reference_class} (eager attention, padded batches):")
        return verify_seq2seq(reference, model, with_token_types)

    return verify


def source_batch(config, batch_size: int = 3, length: int = 12, seed: int = 0, low: int = 5) -> dict:
    """Random source ids, right-padded rows of different lengths (one full, one with a single token), ending with
    eos where the model has one; special ids are avoided inside the text."""
    generator = torch.Generator().manual_seed(seed)
    special = {config.pad_token_id, config.eos_token_id, config.bos_token_id, config.decoder_start_token_id}
    allowed = torch.tensor([i for i in range(low, config.vocab_size) if i not in special])
    input_ids = allowed[torch.randint(len(allowed), (batch_size, length), generator=generator)]
    lengths = torch.tensor([length, length * 2 // 3, 1])[:batch_size]
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    if isinstance(config.eos_token_id, int):
        input_ids[torch.arange(batch_size), lengths - 1] = config.eos_token_id
    input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def verify_seq2seq(reference, model, with_token_types: bool, generation: bool = True,
                   max_new_tokens: int = 10, num_beams: int = 4) -> tuple[bool, str]:
    """Logits, encoder and decoder hidden states on a padded source and a padded target batch (only real tokens
    count), then the token sequences of greedy and beam-search `generate()` from each model's generation config.

    A float32 `model` is held to `LOGITS_TOLERANCE`. One in half precision (as saved with --dtype float16 or
    bfloat16) to its dtype's `HALF_PRECISION_TOLERANCE` times each output's magnitude, and its tokens are not
    compared: rounding may rightly swap two nearly tied tokens, and the float32 check has compared generation."""
    config = model.config
    half = HALF_PRECISION_TOLERANCE.get(model.dtype)
    tolerance = half or LOGITS_TOLERANCE
    batch = source_batch(config)
    target = source_batch(config, seed=1, length=9)
    target["input_ids"][:, 0] = config.decoder_start_token_id
    inputs = {**batch, "decoder_input_ids": target["input_ids"], "decoder_attention_mask": target["attention_mask"]}
    if with_token_types and config.type_vocab_size > 1:
        inputs["token_type_ids"] = (torch.arange(batch["input_ids"].shape[1]) >= 4).long().expand_as(
            batch["input_ids"]) * batch["attention_mask"]
    model.eval()
    with torch.no_grad():
        ref_out = reference(**inputs, output_hidden_states=True)
        our_out = model(**inputs, output_hidden_states=True)
    relative = half is not None
    ok = report("encoder", max_differences(ref_out.encoder_hidden_states, our_out.encoder_hidden_states,
                                           batch["attention_mask"]),
                limits(ref_out.encoder_hidden_states, tolerance, relative))
    ok &= report("decoder", max_differences(ref_out.decoder_hidden_states, our_out.decoder_hidden_states,
                                           target["attention_mask"]),
                 limits(ref_out.decoder_hidden_states, tolerance, relative))
    logits_diff = max_differences((ref_out.logits,), (our_out.logits,), target["attention_mask"])[0]
    print(f"  logits: max |diff| = {logits_diff:.3e}")
    ok &= logits_diff <= limits((ref_out.logits,), tolerance, relative)[0]
    rule = f"{tolerance:g} x max(1, |output|)" if relative else f"{tolerance:g}"
    summary = (f"logits max |diff| {logits_diff:.2e} ({PRECISION_NAMES[model.dtype]}, padded batch, tolerance "
               f"{rule})")
    if not generation or half:
        return ok, summary
    same, generated = compare_generation(reference, model, batch, max_new_tokens, num_beams)
    return ok and same, f"{summary}; {generated}"


def compare_generation(reference, model, inputs: dict, max_new_tokens: int = 10, num_beams: int = 4):
    """Greedy and beam-search `generate()` of both models from `inputs`, each with its own generation config: (both
    gave identical token sequences, a summary)."""
    ok, summary = True, []
    for name, options in (("greedy", {"num_beams": 1}), (f"beam search ({num_beams} beams)", {"num_beams": num_beams})):
        kwargs = dict(inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
        with torch.no_grad():
            expected = reference.generate(**kwargs)
            ours = model.generate(**kwargs)
        same = expected.shape == ours.shape and torch.equal(expected, ours)
        print(f"  generate, {name}: {'identical' if same else 'DIFFERENT'} token sequences "
              f"({expected.shape[0]} sources, {expected.shape[1]} tokens)")
        ok &= same
        summary.append(f"{name} generate(): {'identical' if same else 'different'} tokens")
    return ok, "; ".join(summary)
