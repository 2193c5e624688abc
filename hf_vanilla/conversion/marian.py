"""Marian (OPUS-MT) <-> the vanilla encoder-decoder.

`python -m conversion marian` maps a transformers `MarianMTModel` into `VanillaSeq2SeqForConditionalGeneration`.
Marian is the paper's model with three choices of its own: swish, sinusoids stored sines-then-cosines
("concatenated"), and a final logits bias (our output projection's bias). Its layers carry fairseq's names, as BART's
do (seq2seq.py holds that table).
"""

from pathlib import Path

from hf_vanilla import VanillaSeq2SeqConfig, VanillaSeq2SeqForConditionalGeneration

from .common import build_model, load_tensors, map_tensors, read_source, write_conversion
from .errors import ConversionError
from .seq2seq import (
    fairseq_config,
    fairseq_embeddings,
    fairseq_layers,
    generation_ids,
    save_seq2seq,
    verifier,
    with_generation_config,
)

MARIAN_DROPPED = {
    "model.encoder.embed_positions": "the sinusoidal table, recomputed from the config (checked equal when present)",
    "model.decoder.embed_positions": "the sinusoidal table, recomputed from the config (checked equal when present)",
}


def marian_table(config: VanillaSeq2SeqConfig) -> dict[str, str]:
    """Marian module -> ours: fairseq's layers in both stacks (the embeddings are mapped by `fairseq_embeddings`)."""
    return fairseq_layers("encoder", config.num_hidden_layers, False) | fairseq_layers("decoder",
                                                                                       config.decoder_layers, True)


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
    embeddings = fairseq_embeddings(tensors, config)
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
        verify=verifier("MarianMTModel", tensors, source_dir) if verify_parity else None,
        save=lambda model, directory: save_seq2seq(model, directory, source_dir, "MarianTokenizer"),
        title=f"{Path(source).name} as a vanilla encoder-decoder",
        command=command or f"hf-vanilla marian --source {source} --output {output}",
        dtype=dtype,
    )
