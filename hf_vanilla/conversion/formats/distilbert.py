"""DistilBERT <-> vanilla encoder.

`python -m conversion distilbert --source SRC --output OUT` maps a transformers DistilBERT checkpoint
(distilbert-base-uncased and every model of that architecture) into a `VanillaEncoder*` model;
`python -m conversion to-distilbert` maps it back, bit for bit.

DistilBERT is a 6-layer BERT distilled from BERT (Sanh et al., 2019) with its own names and three removals:
- no token types (`type_vocab_size = 0`): its tokenizer emits no `token_type_ids`;
- no pooler (`use_pooler = False`): its classifiers start from the [CLS] hidden state;
- LayerNorm epsilon fixed at 1e-12 in the code, not in its config.
Its MLM head (vocab_transform, activation, vocab_layer_norm, vocab_projector tied to the word embeddings) is BERT's
with other names, and applies the config's `activation`, as ours applies `hidden_act`.

DistilBERT's sequence classifier (pre_classifier + ReLU + dropout + classifier on [CLS]) has no vanilla counterpart
and is refused; the encoder of such a checkpoint converts with `--head base`. Its question-answering head converts,
without the extra training-time dropout `qa_dropout` (the outputs are the same).
"""

from ...configuration_vanilla import VanillaEncoderConfig
from ..errors import ConversionError
from .encoder import BASE_HEAD, TASK_HEADS, EncoderFormat, masked_lm_head

# DistilBERT module -> ours, within the base model.
ENCODER_TABLE = (
    ("embeddings.word_embeddings", "encoder.embeddings.word_embeddings"),
    ("embeddings.position_embeddings", "encoder.embeddings.position_embeddings"),
    ("embeddings.LayerNorm", "encoder.embeddings.norm"),
    ("transformer.layer.{i}.attention.q_lin", "encoder.layers.{i}.self_attn.q_proj"),
    ("transformer.layer.{i}.attention.k_lin", "encoder.layers.{i}.self_attn.k_proj"),
    ("transformer.layer.{i}.attention.v_lin", "encoder.layers.{i}.self_attn.v_proj"),
    ("transformer.layer.{i}.attention.out_lin", "encoder.layers.{i}.self_attn.o_proj"),
    ("transformer.layer.{i}.sa_layer_norm", "encoder.layers.{i}.self_attn_norm"),
    ("transformer.layer.{i}.ffn.lin1", "encoder.layers.{i}.ffn.up_proj"),
    ("transformer.layer.{i}.ffn.lin2", "encoder.layers.{i}.ffn.down_proj"),
    ("transformer.layer.{i}.output_layer_norm", "encoder.layers.{i}.ffn_norm"),
)

HEADS = {
    "base": BASE_HEAD,
    "masked-lm": masked_lm_head("vocab_transform", "vocab_layer_norm", "vocab_projector",
                                # stored by older writers
                                tied={"vocab_projector.weight": "embeddings.word_embeddings.weight"}),
    # DistilBertForTokenClassification: dropout(config.dropout) then a linear classifier, as ours.
    # DistilBertForQuestionAnswering drops out at qa_dropout before qa_outputs; ours does not (training only:
    # the outputs are the same).
    **TASK_HEADS,
}

# DistilBertConfig name -> ours; the rest of our fields are fixed by the architecture (below).
RENAMED = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "activation": "hidden_act",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
}
SAME = ("vocab_size", "max_position_embeddings", "initializer_range", "pad_token_id", "id2label", "label2id",
        "problem_type")
LAYER_NORM_EPS = 1e-12  # hard-coded in DistilBERT's modules


def vanilla_config(source: dict, head: str) -> VanillaEncoderConfig:
    fields = {ours: source[theirs] for theirs, ours in RENAMED.items()}
    fields.update({k: source[k] for k in SAME if k in source})
    return VanillaEncoderConfig(**fields, type_vocab_size=0, layer_norm_eps=LAYER_NORM_EPS, use_pooler=False)


def fixed_values(config: VanillaEncoderConfig) -> dict:
    return {
        "type_vocab_size": (0, "DistilBERT has no token types"),
        "use_pooler": (False, "DistilBERT has no pooler"),
        "layer_norm_eps": (LAYER_NORM_EPS, "DistilBERT's LayerNorm epsilon is fixed at 1e-12"),
        "position_offset": (0, "DistilBERT numbers positions from 0"),
        "embedding_size": (config.hidden_size, "DistilBERT embeds at the model width"),
    }


def source_config(config: VanillaEncoderConfig, head: str, model_type: str):
    from transformers import DistilBertConfig

    if config.classifier_dropout not in (None, config.hidden_dropout_prob):
        raise ConversionError("DistilBERT's token classifier drops out at `dropout`; classifier_dropout must be None.")
    fields = {theirs: getattr(config, ours) for theirs, ours in RENAMED.items()}
    fields.update({k: getattr(config, k) for k in SAME})
    return DistilBertConfig(**fields, sinusoidal_pos_embds=False)  # positions are stored as a learned table


FORMAT = EncoderFormat(
    name="distilbert",
    title="DistilBERT",
    model_types=("distilbert",),
    encoder_table=ENCODER_TABLE,
    heads=HEADS,
    refused={
        "ForSequenceClassification": "its head (pre_classifier + ReLU + classifier on [CLS]) has no vanilla "
                                     "counterpart",
    },
    task_modules=("pre_classifier", "classifier"),  # the sequence-classification and multiple-choice heads
    vanilla_config=vanilla_config,
    source_config=source_config,
    fixed_values=fixed_values,
    layers_field="n_layers",
)
