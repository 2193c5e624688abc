"""BERT <-> vanilla encoder.

`python -m conversion bert --source SRC --output OUT` maps any transformers BERT checkpoint (bert-base-uncased and
every BERT-architecture model) into a `VanillaEncoder*` model; `python -m conversion to-bert` maps it back.
The key table below is the whole correspondence: every BERT module on the left, ours on the right.
"""

import sys
from pathlib import Path

import torch

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForQuestionAnswering,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
)

from .common import (
    DTYPES,
    ConversionError,
    atomic_output,
    build_model,
    check_finite,
    copy_side_files,
    expand_table,
    load_tensors,
    map_tensors,
    max_differences,
    read_config,
    report,
    require_model_type,
    resolve_source,
    save_checkpoint,
    write_model_card,
)

# BERT module -> ours, within the base model (BERT's `bert.` prefix and our `model.` prefix are added for heads).
ENCODER_TABLE = [
    ("embeddings.word_embeddings", "encoder.embeddings.word_embeddings"),
    ("embeddings.position_embeddings", "encoder.embeddings.position_embeddings"),
    ("embeddings.token_type_embeddings", "encoder.embeddings.token_type_embeddings"),
    ("embeddings.LayerNorm", "encoder.embeddings.norm"),
    ("encoder.layer.{i}.attention.self.query", "encoder.layers.{i}.self_attn.q_proj"),
    ("encoder.layer.{i}.attention.self.key", "encoder.layers.{i}.self_attn.k_proj"),
    ("encoder.layer.{i}.attention.self.value", "encoder.layers.{i}.self_attn.v_proj"),
    ("encoder.layer.{i}.attention.output.dense", "encoder.layers.{i}.self_attn.o_proj"),
    ("encoder.layer.{i}.attention.output.LayerNorm", "encoder.layers.{i}.self_attn_norm"),
    ("encoder.layer.{i}.intermediate.dense", "encoder.layers.{i}.ffn.up_proj"),
    ("encoder.layer.{i}.output.dense", "encoder.layers.{i}.ffn.down_proj"),
    ("encoder.layer.{i}.output.LayerNorm", "encoder.layers.{i}.ffn_norm"),
    ("pooler.dense", "pooler"),
]

# Head modules, outside the base model. BERT's MLM decoder weight is the word embedding matrix (tied), and its
# bias is stored both as `cls.predictions.bias` and `cls.predictions.decoder.bias`.
HEAD_TABLES = {
    "base": [],
    "masked-lm": [
        ("cls.predictions.transform.dense", "lm_head.dense"),
        ("cls.predictions.transform.LayerNorm", "lm_head.norm"),
        ("cls.predictions", "lm_head.decoder"),
        ("cls.predictions.decoder", "lm_head.decoder"),
    ],
    "sequence-classification": [("classifier", "classifier")],
    "token-classification": [("classifier", "classifier")],
    "question-answering": [("qa_outputs", "qa_outputs")],
}

HEADS = {
    "base": (VanillaEncoderModel, "BertModel"),
    "masked-lm": (VanillaEncoderForMaskedLM, "BertForMaskedLM"),
    "sequence-classification": (VanillaEncoderForSequenceClassification, "BertForSequenceClassification"),
    "token-classification": (VanillaEncoderForTokenClassification, "BertForTokenClassification"),
    "question-answering": (VanillaEncoderForQuestionAnswering, "BertForQuestionAnswering"),
}
ARCHITECTURE_HEADS = {bert: head for head, (_, bert) in HEADS.items()} | {"BertForPreTraining": "masked-lm"}

# BertConfig fields that carry over unchanged.
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "initializer_range", "pad_token_id", "classifier_dropout", "id2label", "label2id",
    "problem_type",
)


def head_for(bert_config: dict, requested: str) -> str:
    if requested != "auto":
        return requested
    architectures = bert_config.get("architectures") or ["BertModel"]
    if architectures[0] not in ARCHITECTURE_HEADS:
        raise ConversionError(
            f"No vanilla head matches the source architecture {architectures[0]!r}; pass --head with one of "
            f"{sorted(HEADS)} (e.g. --head base for the encoder alone)."
        )
    return ARCHITECTURE_HEADS[architectures[0]]


def vanilla_config(bert_config: dict) -> VanillaEncoderConfig:
    if bert_config.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(
            f"position_embedding_type={bert_config['position_embedding_type']!r} (relative positions) has no "
            f"vanilla equivalent; only absolute (learned) positions convert."
        )
    if bert_config.get("is_decoder") or bert_config.get("add_cross_attention"):
        raise ConversionError(
            "This BERT is a decoder (is_decoder/add_cross_attention). Convert an encoder-decoder with "
            "`python -m conversion bert2bert`, or warm-start one from an encoder with `warm-start`."
        )
    fields = {k: bert_config[k] for k in SHARED_FIELDS if k in bert_config}
    return VanillaEncoderConfig(**fields)


def normalise_keys(tensors: dict, head: str) -> dict:
    """Strip BERT's `bert.` prefix and rename TF-era LayerNorm `gamma`/`beta` (bert-base-uncased still has them)."""
    normalised = {}
    for key, tensor in tensors.items():
        key = key.removeprefix("bert.")
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        normalised[key] = tensor
    return normalised


def key_table(config: VanillaEncoderConfig, head: str) -> dict[str, str]:
    prefix = "" if head == "base" else "model."
    table = {bert: prefix + ours for bert, ours in expand_table(ENCODER_TABLE, config.num_hidden_layers).items()}
    table.update(expand_table(HEAD_TABLES[head], 0))
    return table


def dropped_keys(head: str, tensors: dict) -> dict[str, str]:
    """Source keys that are left out on purpose, with the reason."""
    dropped = {
        "embeddings.position_ids": "a buffer of 0..max_positions-1, recomputed by the model",
        "embeddings.token_type_ids": "a buffer of zeros, recomputed by the model",
        "cls.seq_relationship": "the next-sentence-prediction head, which has no vanilla counterpart",
    }
    if head != "masked-lm":
        dropped["cls.predictions"] = f"the masked-LM head, not part of the requested --head {head}"
    return dropped


def bert_to_vanilla(tensors: dict, bert_config: dict, head: str):
    """In-memory conversion: BERT tensors and config.json dict -> a VanillaEncoder* model (no copy of weights)."""
    config = vanilla_config(bert_config)
    tensors = normalise_keys(tensors, head)
    if head == "masked-lm":
        _check_tied_decoder(tensors)
    if "pooler.dense.weight" not in tensors:
        # BertModel(add_pooling_layer=False), and BertForMaskedLM/TokenClassification/QuestionAnswering, which
        # never build a pooler: ours gets none either, so every target tensor is still filled.
        config.use_pooler = False
    mapped, unknown = map_tensors(tensors, key_table(config, head), dropped_keys(head, tensors))
    model = build_model(HEADS[head][0], config, mapped, unknown)
    model.config.architectures = [HEADS[head][0].__name__]
    return model


def _check_tied_decoder(tensors: dict) -> None:
    decoder = tensors.pop("cls.predictions.decoder.weight", None)
    if decoder is not None and not torch.equal(decoder, tensors["embeddings.word_embeddings.weight"]):
        raise ConversionError(
            "The MLM decoder weight differs from the word embeddings (an untied checkpoint); the vanilla MLM head "
            "ties them, as BERT does. Convert with --head base to keep the encoder only."
        )
    bias, decoder_bias = tensors.get("cls.predictions.bias"), tensors.pop("cls.predictions.decoder.bias", None)
    if bias is None and decoder_bias is not None:
        tensors["cls.predictions.bias"] = decoder_bias


def verify(source_dir: Path, model, head: str, tolerance: float = 1e-5) -> tuple[bool, str]:
    """Run transformers' BERT and ours on a padded two-segment batch; print per-layer max |diff|."""
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForQuestionAnswering
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    auto = {
        "base": AutoModel, "masked-lm": AutoModelForMaskedLM, "sequence-classification":
        AutoModelForSequenceClassification, "token-classification": AutoModelForTokenClassification,
        "question-answering": AutoModelForQuestionAnswering,
    }[head]
    reference = auto.from_pretrained(source_dir, attn_implementation="eager", dtype=torch.float32).eval()
    batch = verification_batch(model.config)
    with torch.no_grad():
        ref_out = reference(**batch, output_hidden_states=True)
        our_out = model.float()(**batch, output_hidden_states=True)
    diffs = max_differences(ref_out.hidden_states, our_out.hidden_states, batch["attention_mask"])
    ok = report("hidden states", diffs, tolerance)
    extra = {"masked-lm": "logits", "sequence-classification": "logits", "token-classification": "logits",
             "question-answering": "start_logits"}.get(head)
    worst = max(diffs)
    if extra is not None:
        mask = batch["attention_mask"] if getattr(our_out, extra).dim() > 2 or head == "question-answering" else None
        head_diff = max_differences((getattr(ref_out, extra),), (getattr(our_out, extra),), mask)[0]
        print(f"  {extra}: max |diff| = {head_diff:.3e}")
        ok, worst = ok and head_diff <= tolerance * 5, max(worst, head_diff)
    elif our_out.pooler_output is not None:
        pool_diff = (ref_out.pooler_output - our_out.pooler_output).abs().max().item()
        print(f"  pooler output: max |diff| = {pool_diff:.3e}")
        ok, worst = ok and pool_diff <= tolerance, max(worst, pool_diff)
    return ok, f"max |diff| over every layer's hidden states and the head output: {worst:.2e} (fp32, tolerance {tolerance:g})"


def verification_batch(config, batch_size: int = 3, length: int = 24, seed: int = 0) -> dict:
    """Random ids, right-padded rows of different lengths, two segments when the model has token types."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (batch_size, length), generator=generator)
    lengths = torch.tensor([length, length * 2 // 3, length // 3])[:batch_size]
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id or 0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if config.type_vocab_size > 1:
        batch["token_type_ids"] = ((torch.arange(length)[None, :] >= lengths[:, None] // 2) & (attention_mask == 1)).long()
    return batch


def convert(source: str, output: str, head: str = "auto", dtype: str = "float32", force: bool = False,
            verify_parity: bool = True, command: str | None = None) -> Path:
    """BERT checkpoint (Hub id or directory) -> vanilla checkpoint directory. Returns the output path."""
    source_dir = resolve_source(source)
    bert_config = read_config(source_dir)
    require_model_type(bert_config, ("bert",), "bert", source_dir)
    head = head_for(bert_config, head)
    tensors = load_tensors(source_dir)
    check_finite(tensors)
    with atomic_output(output, force) as staging:
        model = bert_to_vanilla(tensors, bert_config, head)
        parity = "Not verified (--no-verify)."
        if verify_parity:
            print(f"Verifying against transformers' {HEADS[head][1]} (eager attention, padded batch):")
            ok, parity = verify(source_dir, model, head)
            if not ok:
                raise ConversionError(f"Parity check failed: {parity}. Nothing was written.")
            print(f"  OK: {parity}")
        save_checkpoint(model, staging, source_dir, dtype)
        write_model_card(staging, f"{Path(source).name} as a vanilla encoder", source,
                         command or f"python -m conversion bert --source {source} --output {output}", parity)
    return Path(output)


# ---- vanilla -> BERT --------------------------------------------------------------------------------------------


def to_bert(source: str, output: str, force: bool = False, dtype: str = "float32") -> Path:
    """A vanilla encoder checkpoint -> a standard transformers BERT checkpoint (same head, config, tokenizer)."""
    import hf_vanilla  # noqa: F401  (registers the Auto classes)
    from transformers import AutoConfig, BertConfig

    source_dir = resolve_source(source)
    config = AutoConfig.from_pretrained(source_dir)
    if config.model_type != "vanilla_encoder":
        raise ConversionError(f"{source_dir} holds a {config.model_type!r} model; to-bert reads vanilla_encoder.")
    refusals = {
        "position_embedding_type": ("learned", "BERT learns its positions"),
        "pre_norm": (False, "BERT is post-LN"),
        "scale_embeddings": (False, "BERT does not scale embeddings"),
        "embedding_layer_norm": (True, "BERT always normalises its embeddings"),
        "position_offset": (0, "BERT numbers positions from 0"),
        "embedding_size": (config.hidden_size, "BERT embeds at the model width"),
    }
    for field, (needed, why) in refusals.items():
        if getattr(config, field) != needed:
            raise ConversionError(
                f"{field}={getattr(config, field)!r} cannot be expressed as BERT ({why}); only configurations with "
                f"{field}={needed!r} convert back."
            )
    if config.type_vocab_size == 0:
        raise ConversionError("type_vocab_size=0 cannot be expressed as BERT, which always has token types.")
    tensors = load_tensors(source_dir)
    architecture = (config.architectures or ["VanillaEncoderModel"])[0]
    head = next((h for h, (cls, _) in HEADS.items() if cls.__name__ == architecture), None)
    if head is None:
        raise ConversionError(f"Unknown vanilla architecture {architecture!r}; expected one of "
                              f"{[cls.__name__ for cls, _ in HEADS.values()]}.")
    inverse = {ours: bert for bert, ours in key_table(config, head).items()}
    inverse.pop("lm_head.decoder", None)
    bert_prefix = "" if head == "base" else "bert."
    bert_tensors, unknown = {}, []
    for key, tensor in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module == "lm_head.decoder" and leaf == "bias":
            bert_tensors["cls.predictions.bias"] = tensor
        elif module in inverse:
            name = inverse[module]
            bert_tensors[(bert_prefix if not name.startswith(("cls.", "classifier", "qa_outputs")) else "") +
                         f"{name}.{leaf}"] = tensor
        else:
            unknown.append(key)
    if unknown:
        raise ConversionError(f"Tensors with no BERT counterpart: {unknown}")
    fields = {k: getattr(config, k) for k in SHARED_FIELDS if hasattr(config, k)}
    bert_config = BertConfig(**fields, architectures=[HEADS[head][1]])
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForQuestionAnswering
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    auto = {"base": AutoModel, "masked-lm": AutoModelForMaskedLM,
            "sequence-classification": AutoModelForSequenceClassification,
            "token-classification": AutoModelForTokenClassification,
            "question-answering": AutoModelForQuestionAnswering}[head]
    with torch.device("meta"):
        bert = auto.from_config(bert_config)
    if not config.use_pooler:
        raise ConversionError("This model has no pooler (use_pooler=False); BERT checkpoints converted back need one.")
    tied = set(bert.get_expanded_tied_weights_keys(all_submodels=True))
    expected = {k for k in bert.state_dict() if not k.endswith(("position_ids", "token_type_ids"))}
    missing = sorted(expected - set(bert_tensors) - tied)
    if missing:
        raise ConversionError(f"BERT tensors the source does not fill: {missing}")
    bert.load_state_dict(bert_tensors, strict=False, assign=True)
    bert.tie_weights()
    for module in bert.modules():  # BERT's index buffers are not in our checkpoint: rebuild them
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                module.register_buffer(name, torch.zeros(buffer.shape, dtype=buffer.dtype), persistent=False)
                bert._init_weights(module)
    with atomic_output(output, force) as staging:
        bert.to(DTYPES[dtype]).save_pretrained(staging)
        copy_side_files(source_dir, staging)
    return Path(output)


# ---- command line -----------------------------------------------------------------------------------------------


def register(subparsers) -> None:
    parser = subparsers.add_parser("bert", help="a transformers BERT checkpoint -> a vanilla encoder")
    parser.add_argument("--source", required=True, help="Hub id (bert-base-uncased) or local BERT checkpoint dir")
    parser.add_argument("--output", required=True, help="directory to write (refused if it exists, unless --force)")
    parser.add_argument("--head", default="auto", choices=["auto", *HEADS],
                        help="which model to build; auto follows the source's `architectures`")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of the saved weights")
    parser.add_argument("--force", action="store_true", help="replace an existing --output once conversion succeeds")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the layer-by-layer comparison with transformers' BERT")
    parser.set_defaults(run=lambda a: convert(a.source, a.output, a.head, a.dtype, a.force, a.verify,
                                              command="python -m conversion " + " ".join(sys.argv[1:])))

    parser = subparsers.add_parser("to-bert", help="a vanilla encoder checkpoint -> a transformers BERT checkpoint")
    parser.add_argument("--source", required=True, help="vanilla encoder checkpoint directory")
    parser.add_argument("--output", required=True, help="directory to write (refused if it exists, unless --force)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--force", action="store_true")
    parser.set_defaults(run=lambda a: to_bert(a.source, a.output, a.force, a.dtype))
