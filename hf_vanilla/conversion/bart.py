"""BART <-> the vanilla encoder-decoder, and BART's decoder alone <-> ours.

BART (Lewis et al., 2020, https://arxiv.org/abs/1910.13461) is the paper's encoder-decoder with BERT's habits: GELU,
learned positions (numbered from 2, after fairseq's padding index), and a LayerNorm on the summed embeddings.
`python -m conversion bart` maps each BART class into its vanilla counterpart; `to-bart` maps it back. Both read one
key table (fairseq's layer table, which Marian shares: seq2seq.py, plus its embeddings), the reverse right to left, so
the round trip returns every tensor bit for bit.
"""

from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from transformers import BartConfig, GenerationConfig

from ..configuration_vanilla import VanillaSeq2SeqConfig
from ..modeling_vanilla import (
    VanillaDecoderForCausalLM,
    VanillaSeq2SeqForConditionalGeneration,
    VanillaSeq2SeqForQuestionAnswering,
    VanillaSeq2SeqForSequenceClassification,
    VanillaSeq2SeqModel,
)
from .building import build_model
from .errors import ConversionError
from .mapping import map_tensors
from .parity import reference_model
from .reading import load_tensors, read_source
from .seq2seq import (
    fairseq_config,
    fairseq_embeddings,
    fairseq_fields,
    fairseq_layers,
    generation_ids,
    save_seq2seq,
    verify_seq2seq,
    with_generation_config,
)
from .writing import write_conversion, write_source_format

POSITION_OFFSET = 2  # BART numbers positions from padding_idx + 1, as fairseq did


class Head(NamedTuple):
    ours: type  # our class
    table: tuple = ()  # BART module -> ours, outside the stacks
    stacks: tuple = ("encoder", "decoder")
    decoder_inputs: bool = False  # called with a target (decoder_input_ids); the others read the shifted source
    generates: bool = False  # verified by its `generate()` tokens too


HEADS = {
    "BartModel": Head(VanillaSeq2SeqModel, decoder_inputs=True),
    "BartForConditionalGeneration": Head(VanillaSeq2SeqForConditionalGeneration, decoder_inputs=True, generates=True),
    "BartForSequenceClassification": Head(VanillaSeq2SeqForSequenceClassification, (
        ("classification_head.dense", "pooler"), ("classification_head.out_proj", "classifier"))),
    "BartForQuestionAnswering": Head(VanillaSeq2SeqForQuestionAnswering, (("qa_outputs", "qa_outputs"),)),
    # BART's decoder alone keeps cross-attention weights it never runs; ours is built without them.
    "BartForCausalLM": Head(VanillaDecoderForCausalLM, stacks=("decoder",), generates=True),
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


def head_for(bart: dict) -> str:
    architecture = (bart.get("architectures") or ["BartForConditionalGeneration"])[0]
    if architecture not in HEADS:
        raise ConversionError(f"No vanilla class matches {architecture!r}; `bart` converts {sorted(HEADS)}.")
    return architecture


def vanilla_config(bart: dict, head: str) -> VanillaSeq2SeqConfig:
    """BartConfig dict -> ours: learned positions numbered from 2, a LayerNorm on the embeddings, no segments."""
    if bart.get("normalize_before") or bart.get("add_final_layer_norm"):
        raise ConversionError("Pre-LN BART variants (mBART) need a final LayerNorm per stack; only BART converts.")
    return fairseq_config(
        bart, "BART",
        max_position_embeddings=bart.get("max_position_embeddings", 1024) + POSITION_OFFSET,
        position_offset=POSITION_OFFSET,
        position_embedding_type="learned",
        embedding_layer_norm=True,
        pad_token_id=bart.get("pad_token_id", 1),
        eos_token_id=bart.get("eos_token_id", 2),
        decoder_start_token_id=bart.get("decoder_start_token_id", 2),
        architectures=[HEADS[head].ours.__name__],
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


def bart_to_vanilla(tensors: dict, bart: dict, head: str):
    config = vanilla_config(bart, head)
    tensors = {("" if key.startswith(("model.", "lm_head", "final_logits", "classification_head", "qa_outputs"))
                else "model.") + key: tensor for key, tensor in tensors.items()}  # BartModel saves no `model.`
    embeddings = token_embeddings(tensors, config, head)
    mapped, unknown = map_tensors(tensors, key_table(config, head), unused_cross_attention(config, head))
    mapped.update(embeddings)
    if head == "BartModel":  # our base model has no `model.` prefix either
        mapped = {key.removeprefix("model."): tensor for key, tensor in mapped.items()}
    return build_model(HEADS[head].ours, config, mapped, unknown)


# ---- vanilla -> BART ----------------------------------------------------------------------------------------------


def bart_config_for(config: VanillaSeq2SeqConfig, head: str) -> BartConfig:
    """Ours -> BartConfig, refusing what BART cannot express (it would silently compute something else)."""
    refusals = [f"{field}={getattr(config, field)!r} (BART needs {value!r})" for field, value in (
        ("position_embedding_type", "learned"), ("position_offset", POSITION_OFFSET), ("embedding_layer_norm", True),
        ("pre_norm", False), ("type_vocab_size", 0), ("lm_head_transform", False), ("layer_norm_eps", 1e-5),
        ("embedding_size", config.hidden_size), ("tie_word_embeddings", True),
    ) if getattr(config, field) != value]
    if head != "BartForCausalLM" and not config.share_encoder_decoder_embeddings:
        refusals.append("share_encoder_decoder_embeddings=False (BART embeds source and target with one matrix)")
    if refusals:
        raise ConversionError("This model cannot be expressed as BART:\n  " + "\n  ".join(refusals))
    return BartConfig(
        **fairseq_fields(config), max_position_embeddings=config.max_position_embeddings - POSITION_OFFSET,
        id2label=config.id2label, label2id=config.label2id,
        is_decoder=head == "BartForCausalLM", is_encoder_decoder=head != "BartForCausalLM", architectures=[head],
    )


def vanilla_to_bart(tensors: dict, config: VanillaSeq2SeqConfig, head: str):
    bart_config = bart_config_for(config, head)
    tensors = {(key if head != "BartModel" else "model." + key): tensor for key, tensor in tensors.items()}
    table = {ours: bart for bart, ours in key_table(config, head).items()}
    mapped, unknown = map_tensors(tensors, table, {"model.decoder.embeddings.word_embeddings": "tied",
                                                   "lm_head.decoder.weight": "tied"})
    if head == "BartForCausalLM":
        mapped["model.decoder.embed_tokens.weight"] = tensors["model.decoder.embeddings.word_embeddings.weight"]
        if tensors["lm_head.decoder.bias"].any():
            raise ConversionError("The output projection has a bias, which BartForCausalLM does not: it cannot hold it.")
        unknown.remove("lm_head.decoder.bias")
        # BartForCausalLM builds cross-attention it never runs; ours has none to give it. Zeros, said so.
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in getattr(transformers, head)(bart_config).state_dict().items()}
        for key in (k for k in shapes if "encoder_attn" in k):
            mapped[key] = torch.ones(shapes[key]) if key.endswith("layer_norm.weight") else torch.zeros(shapes[key])
        print("Note: BartForCausalLM's cross-attention (never run without an encoder) is written as zeros.")
    else:
        mapped["model.shared.weight"] = tensors["model.encoder.embeddings.word_embeddings.weight"]
        unknown.remove("model.encoder.embeddings.word_embeddings.weight")
        if head == "BartForConditionalGeneration":
            mapped["final_logits_bias"] = tensors["lm_head.decoder.bias"][None]  # BART stores it (1, V)
            unknown.remove("lm_head.decoder.bias")
    if head == "BartModel":
        mapped = {key.removeprefix("model."): tensor for key, tensor in mapped.items()}
    return build_model(getattr(transformers, head), bart_config, mapped, unknown)


# ---- verification ------------------------------------------------------------------------------------------------


def verify_bart(reference, model, head: str) -> tuple[bool, str]:
    """`verify_seq2seq` with what `head` is called with, and whether it generates."""
    return verify_seq2seq(reference, model, decoder_inputs=HEADS[head].decoder_inputs, generation=HEADS[head].generates)


def convert(source: str, output: str, dtype: str = "float32", force: bool = False, verify_parity: bool = True,
            command: str | None = None) -> Path:
    source_dir, bart = read_source(source, ("bart",), "bart")
    head = head_for(bart)
    tensors = load_tensors(source_dir)

    def verify(model):
        print(f"Verifying against transformers' {head} (eager attention, padded batch):")
        return verify_bart(reference_model(getattr(transformers, head), tensors, source_dir), model, head)

    return write_conversion(
        output, force, source, source_dir,
        build=lambda: with_generation_config(bart_to_vanilla(tensors, bart, head), source_dir,
                                             generation_ids(source_dir, bart)),
        verify=verify if verify_parity else None,
        save=lambda model, directory: save_seq2seq(model, directory, source_dir, "BartTokenizer"),
        title=f"{Path(source).name} as a vanilla {HEADS[head].ours.__name__}",
        command=command or f"hf-vanilla bart --source {source} --output {output}",
        dtype=dtype,
    )


def to_bart(source: str, output: str, force: bool = False, verify_parity: bool = True) -> Path:
    """A vanilla encoder-decoder (or decoder alone) -> the transformers BART class of the same head."""
    source_dir, _ = read_source(source, (VanillaSeq2SeqConfig.model_type,), "to-bart")
    try:
        config = VanillaSeq2SeqConfig.from_pretrained(source_dir)
        config.check_architecture()
    except ValueError as error:
        raise ConversionError(f"{source_dir}/config.json is not a valid vanilla encoder-decoder config: {error}") from None
    ours = (config.architectures or ["VanillaSeq2SeqForConditionalGeneration"])[0]
    head = next((name for name, h in HEADS.items() if h.ours.__name__ == ours), None)
    if head is None:
        raise ConversionError(f"{source_dir} is a {ours!r}, which has no BART counterpart.")
    tensors = load_tensors(source_dir)
    bart = vanilla_to_bart(tensors, config, head)
    if (source_dir / "generation_config.json").is_file():  # forced_eos_token_id, num_beams...: what generate does
        bart.generation_config = GenerationConfig.from_pretrained(source_dir)

    def verify(staging):
        print(f"Verifying the written {head} against the vanilla source (padded batch):")
        reference = reference_model(HEADS[head].ours, tensors, source_dir)
        written = getattr(transformers, head).from_pretrained(staging, attn_implementation="eager")
        return verify_bart(written.eval(), reference, head)

    return write_source_format(output, force, source_dir, bart, verify if verify_parity else None)

