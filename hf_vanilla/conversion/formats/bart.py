"""BART <-> the vanilla encoder-decoder, and BART's decoder alone <-> ours.

BART (Lewis et al., 2020, https://arxiv.org/abs/1910.13461) is the paper's encoder-decoder with BERT's habits: GELU,
learned positions (numbered from 2, after fairseq's padding index), and a LayerNorm on the summed embeddings.
`python -m conversion bart` maps each BART class into its vanilla counterpart; `to-bart` maps it back. Both read one
key table (fairseq's layer table, which Marian shares: fairseq.py, plus its embeddings), the reverse right to left,
so the round trip returns every tensor bit for bit. `FORMAT` below is the data; the flow is conversion/flow.py.
"""

import torch

from ...configuration_vanilla import VanillaSeq2SeqConfig
from ...modeling_decoder import VanillaDecoderForCausalLM
from ...modeling_seq2seq import (
    VanillaSeq2SeqForConditionalGeneration,
    VanillaSeq2SeqForQuestionAnswering,
    VanillaSeq2SeqForSequenceClassification,
    VanillaSeq2SeqModel,
)
from ..errors import ConversionError
from .fairseq import fairseq_config, fairseq_embeddings, fairseq_fields, fairseq_layers, fairseq_required
from .seq2seq import Seq2SeqFormat, Seq2SeqHead

POSITION_OFFSET = 2  # BART numbers positions from padding_idx + 1, as fairseq did

# The first is what a config without `architectures` holds.
HEADS = {
    "BartForConditionalGeneration": Seq2SeqHead(VanillaSeq2SeqForConditionalGeneration, decoder_inputs=True,
                                                generates=True),
    "BartModel": Seq2SeqHead(VanillaSeq2SeqModel, decoder_inputs=True, base=True),
    "BartForSequenceClassification": Seq2SeqHead(VanillaSeq2SeqForSequenceClassification, (
        ("classification_head.dense", "pooler"), ("classification_head.out_proj", "classifier"))),
    "BartForQuestionAnswering": Seq2SeqHead(VanillaSeq2SeqForQuestionAnswering, (("qa_outputs", "qa_outputs"),)),
    # BART's decoder alone keeps cross-attention weights it never runs; ours is built without them.
    "BartForCausalLM": Seq2SeqHead(VanillaDecoderForCausalLM, stacks=("decoder",), generates=True),
}


def key_table(config: VanillaSeq2SeqConfig, head: str) -> dict[str, str]:
    """BART module -> our module, in the key space of BART's head classes (`model.` prefixed)."""
    table = dict(HEADS[head].table)
    cross_attention = HEADS[head].stacks == ("encoder", "decoder")
    for stack in HEADS[head].stacks:
        prefix = f"model.{stack}."
        table[prefix + "embed_positions"] = prefix + "embeddings.position_embeddings"
        table[prefix + "layernorm_embedding"] = prefix + "embeddings.norm"
        num_layers = config.decoder_layers if stack == "decoder" else config.num_hidden_layers
        table.update(fairseq_layers(stack, num_layers, cross_attention=stack == "decoder" and cross_attention))
    return table


def unused_cross_attention(config: VanillaSeq2SeqConfig, head: str) -> dict[str, str]:
    """BartForCausalLM's layers carry cross-attention weights that it never runs (it has no encoder): dropped."""
    if head != "BartForCausalLM":
        return {}
    return {f"model.decoder.layers.{i}.encoder_attn": "cross-attention of a decoder that has no encoder to attend "
            "to (BartForCausalLM never runs it)" for i in range(config.decoder_layers)}


def vanilla_config(bart: dict, head: str) -> VanillaSeq2SeqConfig:
    """BartConfig dict -> ours: learned positions numbered from 2, a LayerNorm on the embeddings, no segments."""
    if bart.get("normalize_before") or bart.get("add_final_layer_norm"):
        raise ConversionError("Pre-LN BART variants (mBART) need a final LayerNorm per stack; only BART converts.")
    return fairseq_config(
        bart, "BART", {"pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2},
        max_position_embeddings=bart.get("max_position_embeddings", 1024) + POSITION_OFFSET,
        position_offset=POSITION_OFFSET,
        position_embedding_type="learned",
        embedding_layer_norm=True,
        architectures=[HEADS[head].model_class.__name__],
    )


def token_embeddings(tensors: dict, config: VanillaSeq2SeqConfig, head: str) -> dict:
    """BART's shared embeddings (and, for the generation heads, the output projection's bias) -> ours."""
    if head == "BartForCausalLM":
        embeddings = tensors.pop("model.decoder.embed_tokens.weight", None)
        output = tensors.pop("lm_head.weight", embeddings)
        if embeddings is None or not torch.equal(output, embeddings):
            raise ConversionError("BartForCausalLM's output projection must be its (tied) token embeddings.")
        return {"model.decoder.embeddings.word_embeddings.weight": embeddings,
                "lm_head.decoder.bias": torch.zeros(config.vocab_size)}  # BART's output has no bias
    mapped = fairseq_embeddings(tensors, config)
    if head != "BartForConditionalGeneration":
        mapped = {k: v for k, v in mapped.items() if not k.startswith("lm_head.")}
    return mapped


def prepare(tensors: dict, config: VanillaSeq2SeqConfig) -> dict:
    """The source's tensors under the head classes' keys: BartModel saves its own without `model.`."""
    return {("" if key.startswith(("model.", "lm_head", "final_logits", "classification_head", "qa_outputs"))
             else "model.") + key: tensor for key, tensor in tensors.items()}


# ---- vanilla -> BART ----------------------------------------------------------------------------------------------


def required(config: VanillaSeq2SeqConfig, head: str) -> dict:
    """What BART computes with one value only (any other it would silently compute as something else)."""
    needed = {
        "position_embedding_type": ("learned", "BART learns its positions"),
        "position_offset": (POSITION_OFFSET, "BART numbers positions from padding_idx + 1"),
        "embedding_layer_norm": (True, "BART LayerNorms the summed embeddings"),
        **fairseq_required(config, "BART"),
        "tie_word_embeddings": (True, "BART's output projection is its token embeddings"),
    }
    if head != "BartForCausalLM":
        needed["share_encoder_decoder_embeddings"] = (bool, "BART embeds source and target with one matrix")
    return needed


def bart_config_for(config: VanillaSeq2SeqConfig, head: str):
    """Ours -> BartConfig (`required` has refused what BART cannot express)."""
    from transformers import BartConfig

    return BartConfig(
        **fairseq_fields(config), max_position_embeddings=config.max_position_embeddings - POSITION_OFFSET,
        id2label=config.id2label, label2id=config.label2id,
        is_decoder=head == "BartForCausalLM", is_encoder_decoder=head != "BartForCausalLM", architectures=[head],
    )


def bart_embeddings(tensors: dict, config: VanillaSeq2SeqConfig, head: str, bart_config) -> dict:
    """Our token embeddings (and the generation head's output bias), popped from `tensors`, as BART stores them; our
    decoder's embeddings and output projection are tied to them. BartForCausalLM's cross-attention, which it builds
    and never runs, is written as zeros: ours has none to give it."""
    tensors.pop("lm_head.decoder.weight", None)  # tied to the token embeddings
    if head == "BartForCausalLM":
        import transformers

        mapped = {"model.decoder.embed_tokens.weight": tensors.pop("model.decoder.embeddings.word_embeddings.weight")}
        if tensors.pop("lm_head.decoder.bias").any():
            raise ConversionError("The output projection has a bias, which BartForCausalLM does not: it cannot hold "
                                  "it.")
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in getattr(transformers, head)(bart_config).state_dict().items()}
        for key in (k for k in shapes if "encoder_attn" in k):
            mapped[key] = torch.ones(shapes[key]) if key.endswith("layer_norm.weight") else torch.zeros(shapes[key])
        print("Note: BartForCausalLM's cross-attention (never run without an encoder) is written as zeros.")
        return mapped
    tensors.pop("model.decoder.embeddings.word_embeddings.weight", None)  # shared with the encoder's
    mapped = {"model.shared.weight": tensors.pop("model.encoder.embeddings.word_embeddings.weight")}
    if head == "BartForConditionalGeneration":
        mapped["final_logits_bias"] = tensors.pop("lm_head.decoder.bias")[None]  # BART stores it (1, V)
    return mapped


FORMAT = Seq2SeqFormat(
    name="bart",
    title="BART",
    model_types=("bart",),
    heads=HEADS,
    tokenizer_class="BartTokenizer",
    vanilla_config=vanilla_config,
    key_table=key_table,
    prepare=prepare,
    embeddings=token_embeddings,
    dropped=unused_cross_attention,
    required=required,
    source_config=bart_config_for,
    source_embeddings=bart_embeddings,
)
