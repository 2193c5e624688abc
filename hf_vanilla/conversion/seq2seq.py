"""What the encoder-decoder converters share (bert2bert.py, marian.py, bart.py): fairseq's layer names and config
fields, which BART and Marian both use; the source's generation settings; saving next to the source's tokenizer; and
the verification of a whole encoder-decoder: every hidden state and output by the parity rule (parity.py), then the
tokens `generate()` gives."""

import json
from pathlib import Path

import torch

from ..configuration_vanilla import VanillaSeq2SeqConfig
from .errors import ConversionError
from .mapping import expand_table
from .parity import PRECISION_NAMES, check, compare_generation, reference_model, rule
from .reading import check_generation_settings, read_generation_config, read_json
from .writing import TOKENIZER_FILES, copy_side_files, save_checkpoint

# ---- fairseq's layout: BART and Marian ----------------------------------------------------------------------

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


# ---- generation settings and saving -----------------------------------------------------------------------------


def generation_ids(source_dir: Path, config: dict) -> dict:
    """decoder_start / eos / pad / bos ids: the source's generation_config.json first, then its config.json."""
    path = source_dir / "generation_config.json"
    generation = read_json(path, "generation config") if path.is_file() else {}
    if generation and generation.get("decoder_start_token_id", generation.get("bos_token_id")) is None:
        start = config.get("decoder_start_token_id")
        raise ConversionError(
            f"{path} sets neither decoder_start_token_id nor bos_token_id: transformers' generate() cannot start a "
            f"target sentence with it (it does not fall back to config.json). Add \"decoder_start_token_id\": "
            f"{start if start is not None else 'the id that starts a target sentence'} to it.")
    ids = {}
    for name in ("decoder_start_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        ids[name] = generation.get(name, config.get(name, config.get("decoder", {}).get(name)))
    if ids["decoder_start_token_id"] is None:
        raise ConversionError(
            f"{source_dir} sets no decoder_start_token_id (neither generation_config.json nor config.json): "
            f"generation would not know how to start. Set it in the source's config ([CLS], 101, for bert2bert)."
        )
    return ids


def with_generation_config(model, source_dir: Path | None, ids: dict, ids_from: str | None = None):
    """`model`, given the source's generation config whole (forced_eos_token_id, bad_words_ids, num_beams... all
    change what `generate` returns); without one, the special ids alone, read from `ids_from` (the source's
    config.json by default). Either is refused, naming the file and the field, where `generate` would fail on it: a
    token id outside the model's vocabulary, a setting of the wrong type or range (reading.py)."""
    from transformers import GenerationConfig

    vocab_size = model.config.vocab_size
    generation = read_generation_config(source_dir, vocab_size) if source_dir is not None else None
    if generation is None:
        generation = GenerationConfig(**{k: v for k, v in ids.items() if v is not None})
        check_generation_settings(generation, ids_from or f"{source_dir}/config.json", vocab_size)
    model.generation_config = generation
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


# ---- verification ----------------------------------------------------------------------------------------------


def verifier(reference_class: str, tensors: dict, source_dir: Path, **options):
    """`verify` for `write_conversion`: transformers' `reference_class`, holding the source's `tensors`, against ours
    (`verify_seq2seq`, with `options`)."""

    def verify(model) -> tuple[bool, str]:
        import transformers

        reference = reference_model(getattr(transformers, reference_class), tensors, source_dir)
        print(f"Verifying against transformers' {reference_class} (eager attention, padded batches):")
        return verify_seq2seq(reference, model, **options)

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


# Outputs compared, and the label each one's report lines carry.
OUTPUTS = {"encoder_hidden_states": "encoder", "decoder_hidden_states": "decoder", "hidden_states": "hidden states",
           "last_hidden_state": "last_hidden_state", "logits": "logits", "start_logits": "start_logits",
           "end_logits": "end_logits"}


def verify_seq2seq(reference, model, decoder_inputs: bool = True, generation: bool = True,
                   with_token_types: bool = False, max_new_tokens: int = 10, num_beams: int = 4) -> tuple[bool, str]:
    """Every hidden state and output of both models on a padded source batch (with `decoder_inputs`, a padded target
    batch too, opened by the decoder start token), by the parity rule for `model`'s dtype at real tokens; then, with
    `generation`, the token sequences of greedy and beam-search `generate()` from each model's generation config.

    Tokens are compared in float32 only: in half precision rounding may rightly swap two nearly tied tokens, and the
    float32 check (which `write_conversion` runs first) has compared them. Returns (ok, a one-line summary)."""
    config = model.config
    batch = source_batch(config)
    inputs, target_mask = dict(batch), batch["attention_mask"]
    if decoder_inputs:
        target = source_batch(config, seed=1, length=9)
        target["input_ids"][:, 0] = config.decoder_start_token_id
        inputs |= {"decoder_input_ids": target["input_ids"], "decoder_attention_mask": target["attention_mask"]}
        target_mask = target["attention_mask"]
    if with_token_types and config.type_vocab_size > 1:
        inputs["token_type_ids"] = (torch.arange(batch["input_ids"].shape[1]) >= 4).long().expand_as(
            batch["input_ids"]) * batch["attention_mask"]
    model.eval()
    with torch.no_grad():
        ref_out = reference(**inputs, output_hidden_states=True)
        our_out = model(**inputs, output_hidden_states=True)
    ok, worst = True, 0.0
    for name, label in OUTPUTS.items():
        ref, ours = getattr(ref_out, name, None), getattr(our_out, name, None)
        if ref is None or ours is None:
            continue
        # Decoder states line up with the target, which for the heads that read the shifted source is that source.
        mask = batch["attention_mask"] if name == "encoder_hidden_states" else target_mask
        within, diff = check(label, ref, ours, mask, model.dtype)
        ok, worst = ok and within, max(worst, diff)
    summary = (f"max |diff| {worst:.1e} over every hidden state and output ({PRECISION_NAMES[model.dtype]}, padded "
               f"batch, {rule(model.dtype)})")
    if not generation or model.dtype != torch.float32:
        return ok, summary
    if not config.is_encoder_decoder:
        # A decoder alone continues its prompts. Ours takes the positions `generate` derives from a left-padded mask
        # (GPT-2's convention); BartForCausalLM takes none and counts from the row's left edge, padding included, so
        # the two agree on prompts without padding, which is what is compared.
        batch = {"input_ids": batch["input_ids"][:1], "attention_mask": batch["attention_mask"][:1]}
    same, generated = compare_generation(reference, model, batch, max_new_tokens, num_beams)
    return ok and same, f"{summary}; {generated}"
