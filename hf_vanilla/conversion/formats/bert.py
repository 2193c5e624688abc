"""BERT <-> vanilla encoder.

`python -m conversion bert --source SRC --output OUT` maps any transformers BERT checkpoint (bert-base-uncased and
every BERT-architecture model) into a `VanillaEncoder*` model; `python -m conversion to-bert --source OUT --output
BERT` maps it back. Both directions read the one key table below (every BERT module on the left, ours on the
right), the reverse right to left, so the round trip BERT -> vanilla -> BERT returns every tensor bit for bit.

BERT is the family's model: our encoder computes exactly what it computes, so every head of transformers' BERT has
a vanilla counterpart, the causal `BertLMHeadModel` and the pre-training model included. bert-base-uncased and its
kin call themselves BertForMaskedLM but store the whole pre-training model (pooler and next-sentence head too):
`--head auto` converts those to the pre-training head, so that nothing they hold is thrown away.
"""

from dataclasses import replace

from transformers import BertConfig

from ...configuration_vanilla import VanillaEncoderConfig
from .encoder import BASE_HEAD, TASK_HEADS, EncoderFormat, EncoderHead, masked_lm_head

# BERT module -> ours, within the base model (BERT's `bert.` prefix and our `model.` prefix are added for heads).
ENCODER_TABLE = (
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
)

# BERT keeps its MLM output bias as `cls.predictions.bias`; its decoder `cls.predictions.decoder` is tied to the word
# embeddings (weight) and to that bias, so checkpoints may or may not store it: checked and dropped on the way in,
# re-tied by transformers on the way out.
MASKED_LM = masked_lm_head("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions",
                           tied={"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
                                 "cls.predictions.decoder.bias": "cls.predictions.bias"})
NEXT_SENTENCE = (("cls.seq_relationship", "seq_relationship"),)
CLASSIFIER = (("classifier", "classifier"),)

HEADS = {
    "base": BASE_HEAD,
    "masked-lm": MASKED_LM,
    # BertLMHeadModel: the MLM head, reading a stack masked to the past.
    "causal-lm": replace(MASKED_LM, source_suffix="LMHeadModel", causal=True),
    "pretraining": replace(MASKED_LM, source_suffix="ForPreTraining", table=MASKED_LM.table + NEXT_SENTENCE),
    "next-sentence-prediction": EncoderHead("ForNextSentencePrediction", table=NEXT_SENTENCE),
    "multiple-choice": EncoderHead("ForMultipleChoice", table=CLASSIFIER),
    "sequence-classification": EncoderHead("ForSequenceClassification", table=CLASSIFIER),
    **TASK_HEADS,
}

# BertConfig fields that carry over unchanged, in both directions (RoBERTa's and ELECTRA's configs have them too).
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "initializer_range", "pad_token_id", "classifier_dropout", "id2label", "label2id",
    "problem_type", "is_decoder",
)


def vanilla_config(source: dict, head: str) -> VanillaEncoderConfig:
    return VanillaEncoderConfig(**{k: source[k] for k in SHARED_FIELDS if k in source})


def fixed_values(config: VanillaEncoderConfig) -> dict:
    return {
        "position_offset": (0, "BERT numbers positions from 0"),
        "embedding_size": (config.hidden_size, f"BERT embeds at hidden_size={config.hidden_size}"),
    }


def source_config(config: VanillaEncoderConfig, head: str, model_type: str) -> BertConfig:
    return BertConfig(**{k: getattr(config, k) for k in SHARED_FIELDS})


FORMAT = EncoderFormat(
    name="bert",
    title="BERT",
    model_types=("bert",),
    encoder_table=ENCODER_TABLE,
    heads=HEADS,
    vanilla_config=vanilla_config,
    source_config=source_config,
    fixed_values=fixed_values,
    mislabelled={"ForMaskedLM": ("pretraining", "cls.seq_relationship.weight")},
    decoder_hint="convert an encoder-decoder with the bert2bert sub-command, or warm-start one from an encoder with "
                 "`warm-start`.",
)

# In memory, without the flow (benchmarks/ and tests/ call it by this name): tensors and config -> our model.
bert_to_vanilla = FORMAT.to_vanilla
