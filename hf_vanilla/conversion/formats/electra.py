"""ELECTRA <-> vanilla encoder.

`python -m conversion electra --source SRC --output OUT` maps a transformers ELECTRA checkpoint into a
`VanillaEncoder*` model; `python -m conversion to-electra` maps it back, bit for bit.

ELECTRA (Clark et al., 2020) is BERT's encoder trained as a discriminator: which tokens did a small generator
replace? Its checkpoints differ from BERT's in three ways:
- small models embed in a narrower width (`embedding_size`, 128 for electra-small) and project the embeddings up
  to `hidden_size` after their LayerNorm and dropout (`embeddings_project`): ours is `config.embedding_size` and
  `VanillaEmbeddings.projection`. As in transformers, `hidden_states[0]` is the projected tensor;
- no pooler;
- the discriminator head (`ElectraForPreTraining`: dense h->h, hidden_act, dense_prediction h->1) is
  `VanillaEncoderForReplacedTokenDetection`, loaded with its class (`AutoModelForPreTraining` is BERT's pre-training
  model).
Generators (`ElectraForMaskedLM`) convert to `VanillaEncoderForMaskedLM`: dense h->embedding_size, GELU, LayerNorm,
and the tied decoder, which is our `VanillaLMHead`.

ELECTRA's sequence-classification head (dense + GELU + out_proj on [CLS]) has no vanilla counterpart and is refused;
the encoder of such a checkpoint converts with `--head base`.
"""

from ...configuration_vanilla import VanillaEncoderConfig
from .bert import ENCODER_TABLE as BERT_ENCODER_TABLE
from .bert import SHARED_FIELDS
from .encoder import BASE_HEAD, TASK_HEADS, EncoderFormat, EncoderHead, masked_lm_head

# BERT's module names, without the pooler, plus the projection from embedding_size up to hidden_size.
ENCODER_TABLE = tuple(row for row in BERT_ENCODER_TABLE if row[1] != "pooler") + (
    ("embeddings_project", "encoder.embeddings.projection"),
)

HEADS = {
    "base": BASE_HEAD,
    "replaced-token-detection": EncoderHead("ForPreTraining", table=(
        ("discriminator_predictions.dense", "rtd_head.dense"),
        ("discriminator_predictions.dense_prediction", "rtd_head.prediction"),
    )),
    "masked-lm": masked_lm_head("generator_predictions.dense", "generator_predictions.LayerNorm", "generator_lm_head",
                                # stored by older writers
                                tied={"generator_lm_head.weight": "embeddings.word_embeddings.weight"}),
    **TASK_HEADS,
}


def vanilla_config(source: dict, head: str) -> VanillaEncoderConfig:
    fields = {k: source[k] for k in SHARED_FIELDS if k in source}
    return VanillaEncoderConfig(**fields, embedding_size=source["embedding_size"], use_pooler=False)


def fixed_values(config: VanillaEncoderConfig) -> dict:
    return {
        "use_pooler": (False, "ELECTRA has no pooler"),
        "position_offset": (0, "ELECTRA numbers positions from 0"),
    }


def source_config(config: VanillaEncoderConfig, head: str, model_type: str):
    from transformers import ElectraConfig

    fields = {k: getattr(config, k) for k in SHARED_FIELDS if hasattr(config, k)}
    return ElectraConfig(**fields, embedding_size=config.embedding_size)


FORMAT = EncoderFormat(
    name="electra",
    title="ELECTRA",
    model_types=("electra",),
    encoder_table=ENCODER_TABLE,
    heads=HEADS,
    refused={
        "ForSequenceClassification": "its head (dense + GELU + out_proj on [CLS]) has no vanilla counterpart",
    },
    task_modules=("classifier", "sequence_summary"),  # the sequence-classification and multiple-choice heads
    vanilla_config=vanilla_config,
    source_config=source_config,
    fixed_values=fixed_values,
    gelu_lm_head="ELECTRA's generator head",
)
