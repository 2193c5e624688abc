"""RoBERTa / XLM-R <-> vanilla encoder.

`python -m conversion roberta --source SRC --output OUT` maps a transformers RoBERTa or XLM-RoBERTa checkpoint
(roberta-base, xlm-roberta-base and every model of those architectures) into a `VanillaEncoder*` model;
`python -m conversion to-roberta` maps it back, bit for bit.

RoBERTa is BERT's architecture with fairseq's conventions:
- positions are numbered from `padding_idx + 1` (2 for RoBERTa and XLM-R), which is why the position table has
  max_position_embeddings = 514 rows for 512 tokens: `position_offset = pad_token_id + 1` here;
- a single token type (type_vocab_size = 1): every token adds the same segment vector;
- an MLM head `lm_head` (dense, GELU, LayerNorm, decoder tied to the word embeddings, plus `lm_head.bias`).

Limitation (also on the converted model card): RoBERTa computes each token's position from `input_ids`
(`padding_idx + cumsum(input_ids != pad)`), so padding never takes a position; we number positions
`position_offset, position_offset + 1, ...` whatever the tokens are. The two agree on every real token of a
right-padded batch (what tokenizers produce by default) with no padding token inside a sequence. With left padding,
or pad ids between real tokens, the positions (and so the outputs) differ: pass `position_ids` explicitly then.

RoBERTa's sequence-classification head (dense + tanh + out_proj on <s>, no pooler) has no vanilla counterpart and is
refused; the encoder of such a checkpoint converts with `--head base`.
"""

from ...configuration_vanilla import VanillaEncoderConfig
from .bert import ENCODER_TABLE, SHARED_FIELDS
from .encoder import BASE_HEAD, TASK_HEADS, EncoderFormat, masked_lm_head

HEADS = {
    "base": BASE_HEAD,
    # lm_head.bias is the decoder's bias. Older checkpoints also store the tied decoder weight and a copy of the bias.
    "masked-lm": masked_lm_head("lm_head.dense", "lm_head.layer_norm", "lm_head", tied={
        "lm_head.decoder.weight": "embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    }),
    **TASK_HEADS,
}

LIMITATIONS = (
    "Positions: RoBERTa derives positions from `input_ids` (padding takes none); this model numbers them "
    "`pad_token_id + 1` onwards. Outputs match on right-padded batches without padding inside a sequence (the "
    "tokenizer's default); with left padding pass `position_ids` explicitly."
)


def vanilla_config(source: dict, head: str) -> VanillaEncoderConfig:
    fields = {k: source[k] for k in SHARED_FIELDS if k in source}
    # fairseq numbers positions after the padding index: the first token sits at row pad_token_id + 1.
    return VanillaEncoderConfig(**fields, position_offset=source["pad_token_id"] + 1)


def fixed_values(config: VanillaEncoderConfig) -> dict:
    return {
        "position_offset": (config.pad_token_id + 1, "RoBERTa numbers positions from pad_token_id + 1"),
        "embedding_size": (config.hidden_size, "RoBERTa embeds at the model width"),
    }


def source_config(config: VanillaEncoderConfig, head: str, model_type: str):
    from transformers import AutoConfig

    fields = {k: getattr(config, k) for k in SHARED_FIELDS if hasattr(config, k)}
    return AutoConfig.for_model(model_type, **fields)


FORMAT = EncoderFormat(
    name="roberta",
    title="RoBERTa",
    model_types=("roberta", "xlm-roberta"),
    encoder_table=ENCODER_TABLE,  # BERT's module names, pooler included
    heads=HEADS,
    refused={
        "ForSequenceClassification": "its head (dense + tanh + out_proj on <s>) has no vanilla counterpart",
    },
    task_modules=("classifier",),  # RobertaClassificationHead: classifier.dense, classifier.out_proj
    vanilla_config=vanilla_config,
    source_config=source_config,
    fixed_values=fixed_values,
    gelu_lm_head="RoBERTa's MLM head",
    limitations=LIMITATIONS,
)
