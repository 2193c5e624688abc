"""BERT encoder-decoders -> `VanillaSeq2SeqForConditionalGeneration`.

Two sub-commands:
    warm-start  one BERT checkpoint -> both stacks, cross-attention freshly initialised: the bert2bert of
                Rothe et al. 2020 (https://arxiv.org/abs/1907.12461), as `EncoderDecoderModel.from_encoder_decoder_
                pretrained(bert, bert)` builds it.
    bert2bert   a transformers `EncoderDecoderModel` (BertModel encoder, BertLMHeadModel decoder with cross-attention).

BERT layers map through `bert.ENCODER_TABLE`, used for both stacks; the decoder adds cross-attention. Every
conversion is checked against the transformers model it came from (`seq2seq.verify_seq2seq`): every hidden state and
the logits on a padded batch by the parity rule, and for trained models the token sequences of greedy and beam-search
`generate()`. `BERT2BERT` and `WARM_START` are the two formats' steps, which the one flow (conversion/flow.py) runs.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from ...configuration_vanilla import VanillaSeq2SeqConfig
from ...modeling_seq2seq import VanillaSeq2SeqForConditionalGeneration
from ..building import map_and_build
from ..errors import ConversionError
from ..io.reading import load_tensors
from ..mapping import check_layer_counts, expand_table, normalise_keys, untie
from ..parity import check, reference_model, rule, verification_batch
from .bert import ENCODER_TABLE
from .bert import FORMAT as BERT
from .seq2seq import copy_tokenizer, generation_ids, verify_against, verify_seq2seq, with_generation_config

# ---- BERT stacks ------------------------------------------------------------------------------------------------

BERT_LAYERS = next(source for source, _ in ENCODER_TABLE if "{i}" in source)  # where a BERT keeps its layers

# BERT's decoder layer (BertLMHeadModel with add_cross_attention) = an encoder layer + this, between self-attention
# and the feed-forward network, which is our decoder layer's order too.
CROSS_ATTENTION_TABLE = [
    ("encoder.layer.{i}.crossattention.self.query", "encoder.layers.{i}.cross_attn.q_proj"),
    ("encoder.layer.{i}.crossattention.self.key", "encoder.layers.{i}.cross_attn.k_proj"),
    ("encoder.layer.{i}.crossattention.self.value", "encoder.layers.{i}.cross_attn.v_proj"),
    ("encoder.layer.{i}.crossattention.output.dense", "encoder.layers.{i}.cross_attn.o_proj"),
    ("encoder.layer.{i}.crossattention.output.LayerNorm", "encoder.layers.{i}.cross_attn_norm"),
]

# BertConfig fields our config takes as they are (`decoder_*` sizes come from the decoder's BertConfig).
BERT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "initializer_range", "pad_token_id",
)
# Fields both stacks read from one value in our config: the two BERTs must agree on them.
SHARED_BY_STACKS = ("vocab_size", "hidden_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
                    "layer_norm_eps", "pad_token_id")


def bert_stack_table(stack: str, num_layers: int, cross_attention: bool) -> dict[str, str]:
    """BERT module (without `bert.`) -> our module inside `model.<stack>`; the pooler is not part of a stack."""
    table = list(ENCODER_TABLE) + (CROSS_ATTENTION_TABLE if cross_attention else [])
    return {bert: f"model.{stack}" + ours.removeprefix("encoder")
            for bert, ours in expand_table(table, num_layers).items() if bert != "pooler.dense"}


def bert_seq2seq_config(encoder: dict, decoder: dict, decoder_start_token_id, eos_token_id, bos_token_id,
                        share_embeddings: bool) -> VanillaSeq2SeqConfig:
    """Two BertConfig dicts -> our config: BERT's departures from the paper (learned positions, GELU, segments,
    embedding LayerNorm, eps 1e-12, no embedding scale, the MLM transform before the output projection)."""
    # encoder_config validates each BERT (absolute positions only) the way the encoder converter does; the decoder's
    # is_decoder/add_cross_attention flags are what make it a decoder here, not a reason to refuse.
    as_encoder = {k: v for k, v in decoder.items() if k not in ("is_decoder", "add_cross_attention")}
    enc, dec = BERT.encoder_config(encoder, "base"), BERT.encoder_config(as_encoder, "base")
    for field in SHARED_BY_STACKS:
        if getattr(enc, field) != getattr(dec, field):
            raise ConversionError(
                f"The encoder and decoder BERTs differ in {field} "
                f"({getattr(enc, field)!r} vs {getattr(dec, field)!r}); "
                f"the vanilla encoder-decoder shares it between its stacks (a different hidden_size would also need "
                f"transformers' enc_to_dec_proj, which it does not have)."
            )
    try:
        config = VanillaSeq2SeqConfig(
            **{k: getattr(enc, k) for k in BERT_FIELDS},
            decoder_layers=dec.num_hidden_layers,
            decoder_attention_heads=dec.num_attention_heads,
            decoder_intermediate_size=dec.intermediate_size,
            position_embedding_type="learned",
            embedding_layer_norm=True,
            scale_embeddings=False,
            lm_head_transform=True,
            share_encoder_decoder_embeddings=share_embeddings,
            tie_word_embeddings=decoder.get("tie_word_embeddings", True),
            decoder_start_token_id=decoder_start_token_id,
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            architectures=["VanillaSeq2SeqForConditionalGeneration"],
        )
        config.check_architecture()
    except ValueError as error:
        raise ConversionError(f"The source's configuration has no vanilla equivalent: {error}") from None
    return config


def bert2bert_tensors_to_vanilla(tensors: dict, config: VanillaSeq2SeqConfig, tie_word_embeddings: bool,
                                 config_file: str = "config.json"):
    """`EncoderDecoderModel(BertModel, BertLMHeadModel)` tensors -> our model, without copying them. `config_file`:
    where the config was read from, for messages."""
    encoder = normalise_keys({k.removeprefix("encoder."): v for k, v in tensors.items() if k.startswith("encoder.")},
                             "bert.")
    decoder = normalise_keys({k.removeprefix("decoder."): v for k, v in tensors.items() if k.startswith("decoder.")},
                             "bert.")
    check_layer_counts(encoder, [(BERT_LAYERS, "encoder.num_hidden_layers", config.num_hidden_layers)], config_file)
    check_layer_counts(decoder, [(BERT_LAYERS, "decoder.num_hidden_layers", config.decoder_layers)], config_file)
    others = [k for k in tensors if not k.startswith(("encoder.", "decoder."))]
    if tie_word_embeddings:
        try:
            # checks the output weight is the decoder's embedding matrix, then drops it
            untie(decoder, BERT.heads["masked-lm"].tied, "BERT", "")
        except ConversionError:
            raise ConversionError(
                "The decoder's output weights differ from its word embeddings, although its config ties them "
                "(tie_word_embeddings); set tie_word_embeddings to false in the source's decoder config to keep both."
            ) from None
    elif "cls.predictions.bias" in decoder:
        decoder.pop("cls.predictions.decoder.bias", None)  # the same bias, stored twice
    dropped = {"encoder": BERT.dropped_keys("base") | {
        "pooler": "BERT's pooler (tanh over [CLS]): an encoder-decoder's decoder reads every encoder state, never it"
    }, "decoder": BERT.dropped_keys("masked-lm")}
    tables = {"encoder": bert_stack_table("encoder", config.num_hidden_layers, cross_attention=False),
              "decoder": bert_stack_table("decoder", config.decoder_layers, cross_attention=True)}
    tables["decoder"].update(expand_table(list(BERT.heads["masked-lm"].table), 0))
    if not tie_word_embeddings:
        tables["decoder"]["cls.predictions.decoder"] = "lm_head.decoder"  # untied: an output matrix of its own
    # The two stacks under their transformers prefixes again (each read without `bert.`): one table holds both.
    def joined(parts: dict) -> dict:
        return {f"{stack}.{key}": value for stack, part in parts.items() for key, value in part.items()}

    normalised = joined({"encoder": encoder, "decoder": decoder})
    normalised.update((key, tensors[key]) for key in others)  # none maps: each is refused by name
    return map_and_build(VanillaSeq2SeqForConditionalGeneration, config, normalised, table=joined(tables),
                         dropped=joined(dropped))


# ---- bert2bert ----------------------------------------------------------------------------------------------------


def require_bert_sides(source_dir: Path, config: dict) -> None:
    """An `EncoderDecoderModel` converts when both its sides are BERTs and its decoder has cross-attention."""
    for side in ("encoder", "decoder"):
        model_type = config.get(side, {}).get("model_type")
        if model_type != "bert":
            raise ConversionError(
                f"{source_dir} is an encoder-decoder whose {side} is {model_type!r}; the bert2bert converter reads "
                f"BERT encoders and BERT decoders only (model_type 'bert' on both sides)."
            )
    if not config["decoder"].get("add_cross_attention"):
        raise ConversionError(f"{source_dir}: the decoder BERT has no cross-attention (add_cross_attention is false).")


def fill_tied_decoder(tensors: dict) -> list[str]:
    """`tie_encoder_decoder=True` (transformers 4) shared every encoder module with the decoder, so checkpoints
    may store each such tensor once, under `encoder.`. Give the decoder its own copy of what it lacks."""
    filled = []
    for key in [k for k in tensors if k.startswith("encoder.") and not k.startswith("encoder.pooler.")]:
        twin = "decoder.bert." + key.removeprefix("encoder.")
        if twin not in tensors:
            tensors[twin] = tensors[key].clone()
            filled.append(twin)
    return filled


@dataclass(frozen=True)
class Bert2BertSource:
    """An `EncoderDecoderModel` as `Bert2Bert.read` found it: its tensors (the decoder's filled-in copies too:
    transformers 5 no longer ties encoder and decoder), our config for it, and its generation ids."""

    directory: Path
    tensors: dict
    config: VanillaSeq2SeqConfig
    ids: dict


class Bert2Bert:
    """`bert2bert`: a transformers `EncoderDecoderModel` of two BERTs -> ours; the steps flow.convert runs."""

    name, model_types = "bert2bert", ("encoder-decoder",)

    @staticmethod
    def read(source_dir: Path, config: dict) -> Bert2BertSource:
        require_bert_sides(source_dir, config)
        ids = generation_ids(source_dir, config)
        tensors = load_tensors(source_dir)
        tie_encoder_decoder = bool(config.get("tie_encoder_decoder", False))
        filled = fill_tied_decoder(tensors) if tie_encoder_decoder else []
        if filled:
            print(f"tie_encoder_decoder: the decoder shares the encoder's weights; copied {len(filled)} tensors into "
                  f"it.")
        vanilla = bert_seq2seq_config(config["encoder"], config["decoder"], ids["decoder_start_token_id"],
                                      eos_token_id=ids["eos_token_id"], bos_token_id=ids["bos_token_id"],
                                      # One shared matrix needs the output tied too; else equal copies serve as well.
                                      share_embeddings=tie_encoder_decoder
                                      and config["decoder"].get("tie_word_embeddings", True))
        return Bert2BertSource(source_dir, tensors, vanilla, ids)

    @staticmethod
    def build(source: Bert2BertSource):
        model = bert2bert_tensors_to_vanilla(source.tensors, source.config, source.config.tie_word_embeddings,
                                             f"{source.directory}/config.json")
        return with_generation_config(model, source.directory, source.ids)

    @staticmethod
    def verify(source: Bert2BertSource, model) -> tuple[bool, str]:
        return verify_against("EncoderDecoderModel", source.tensors, source.directory, model, with_token_types=True)

    @staticmethod
    def side_files(source: Bert2BertSource, directory: Path) -> None:
        copy_tokenizer(source.directory, directory, "BertTokenizer")

    @staticmethod
    def card(source: Bert2BertSource, name: str) -> tuple[str, str]:
        return f"{Path(name).name} as a vanilla encoder-decoder", ""


BERT2BERT = Bert2Bert()


# ---- warm-start -------------------------------------------------------------------------------------------------


def fresh_cross_attention(hidden_size: int, num_layers: int, std: float, generator) -> dict:
    """New cross-attention in BERT's names, initialised as BERT initialises new modules (and as
    `from_encoder_decoder_pretrained` leaves them): weights ~ N(0, initializer_range), zero biases, unit LayerNorm."""
    tensors = {}
    for i in range(num_layers):
        prefix = f"decoder.bert.encoder.layer.{i}.crossattention."
        for name in ("self.query", "self.key", "self.value", "output.dense"):
            tensors[f"{prefix}{name}.weight"] = torch.randn(hidden_size, hidden_size, generator=generator) * std
            tensors[f"{prefix}{name}.bias"] = torch.zeros(hidden_size)
        tensors[f"{prefix}output.LayerNorm.weight"] = torch.ones(hidden_size)
        tensors[f"{prefix}output.LayerNorm.bias"] = torch.zeros(hidden_size)
    return tensors


def fresh_lm_head(hidden_size: int, vocab_size: int, std: float, generator) -> dict:
    """BERT's MLM head, new: the transform initialised as above, the output bias zero (its weight is the tied
    embedding matrix)."""
    return {
        "decoder.cls.predictions.transform.dense.weight":
            torch.randn(hidden_size, hidden_size, generator=generator) * std,
        "decoder.cls.predictions.transform.dense.bias": torch.zeros(hidden_size),
        "decoder.cls.predictions.transform.LayerNorm.weight": torch.ones(hidden_size),
        "decoder.cls.predictions.transform.LayerNorm.bias": torch.zeros(hidden_size),
        "decoder.cls.predictions.bias": torch.zeros(vocab_size),
    }


def special_ids(source_dir: Path, decoder_start_token_id, eos_token_id) -> tuple[int, int]:
    """[CLS] starts the target and [SEP] ends it, as in the published bert2bert models."""
    if decoder_start_token_id is not None and eos_token_id is not None:
        return decoder_start_token_id, eos_token_id
    if not any((source_dir / name).is_file() for name in ("tokenizer.json", "vocab.txt")):
        # Without a vocabulary AutoTokenizer still builds a BERT tokenizer, of five special tokens: wrong ids.
        raise ConversionError(
            f"{source_dir} has no tokenizer (tokenizer.json or vocab.txt) to read [CLS] and [SEP] from; pass "
            f"--decoder-start-token-id and --eos-token-id (101 and 102 for BERT's uncased vocabulary)."
        )
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source_dir)
        cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    except Exception as error:
        raise ConversionError(
            f"Could not read [CLS] and [SEP] from the tokenizer in {source_dir} ({type(error).__name__}: {error}); "
            f"pass --decoder-start-token-id and --eos-token-id (101 and 102 for BERT's uncased vocabulary)."
        ) from None
    if cls is None or sep is None:
        raise ConversionError(f"The tokenizer in {source_dir} has no [CLS]/[SEP]; pass --decoder-start-token-id "
                              f"and --eos-token-id.")
    return (decoder_start_token_id if decoder_start_token_id is not None else cls,
            eos_token_id if eos_token_id is not None else sep)


def warm_start_tensors(bert_tensors: dict, bert_config: dict, seed: int) -> tuple[dict, bool]:
    """The tensors of the `EncoderDecoderModel` that `from_encoder_decoder_pretrained(bert, bert)` builds: BERT as
    the encoder, an own copy of BERT as the decoder, new cross-attention, and the MLM head (new if BERT has none).
    Returns them and whether the LM head came from the source."""
    bert = normalise_keys(bert_tensors, "bert.")
    if any(".crossattention." in k for k in bert):
        raise ConversionError("The source BERT already has cross-attention: it is half of an encoder-decoder. "
                              "Convert the whole model with the bert2bert sub-command.")
    generator = torch.Generator().manual_seed(seed)
    size, std = bert_config["hidden_size"], bert_config.get("initializer_range", 0.02)
    tensors = {}
    for key, tensor in bert.items():
        if key.startswith("cls."):
            tensors[f"decoder.{key}"] = tensor.clone()
        elif not key.startswith("pooler."):  # BertLMHeadModel has no pooler; the encoder (BertModel) keeps it
            tensors[f"encoder.{key}"] = tensor
            tensors[f"decoder.bert.{key}"] = tensor.clone()  # the decoder holds its own copy
        else:
            tensors[f"encoder.{key}"] = tensor
    tensors.update(fresh_cross_attention(size, bert_config["num_hidden_layers"], std, generator))
    has_head = "decoder.cls.predictions.transform.dense.weight" in tensors
    if not has_head:
        tensors.update(fresh_lm_head(size, bert_config["vocab_size"], std, generator))
    for key in [k for k in tensors if k.startswith("decoder.cls.seq_relationship.")]:
        del tensors[key]  # next-sentence prediction: BertLMHeadModel has no such head
    return tensors, has_head


@dataclass(frozen=True)
class WarmStartSource:
    """A BERT as `WarmStart.read` found it: its own tensors (the encoder's reference), those of the
    `EncoderDecoderModel` warm-started from it (fresh cross-attention), the two BERT configs, ours, and the ids."""

    directory: Path
    bert_tensors: dict
    tensors: dict
    encoder_config: dict
    decoder_config: dict
    config: VanillaSeq2SeqConfig
    ids: dict


class WarmStart:
    """`warm-start`: one BERT -> both stacks of ours, cross-attention fresh; the steps flow.convert runs."""

    name, model_types = "warm-start", ("bert",)

    @staticmethod
    def read(source_dir: Path, bert_config: dict, seed: int = 0, decoder_start_token_id: int | None = None,
             eos_token_id: int | None = None) -> WarmStartSource:
        start, eos = special_ids(source_dir, decoder_start_token_id, eos_token_id)
        bert_tensors = load_tensors(source_dir)
        encoder_config = {k: v for k, v in bert_config.items() if k not in ("is_decoder", "add_cross_attention")}
        decoder_config = encoder_config | {"is_decoder": True, "add_cross_attention": True}
        pad = bert_config.get("pad_token_id", 0)
        # The sizes are checked before any fresh tensor is made for them.
        config = bert_seq2seq_config(encoder_config, decoder_config, start, eos_token_id=eos, bos_token_id=start,
                                     share_embeddings=False)
        check_layer_counts(normalise_keys(bert_tensors, "bert."), [(BERT_LAYERS, "num_hidden_layers",
                                                                    config.num_hidden_layers)],
                           f"{source_dir}/config.json")
        tensors, has_head = warm_start_tensors(bert_tensors, bert_config, seed)
        print("Decoder LM head: " + ("BERT's masked-LM head." if has_head else
              "the source has no masked-LM head: transform freshly initialised, output bias zero, output weights tied "
              "to the decoder's word embeddings."))
        print(f"Cross-attention: freshly initialised (N(0, {bert_config.get('initializer_range', 0.02)}), seed "
              f"{seed}).")
        ids = {"decoder_start_token_id": start, "bos_token_id": start, "eos_token_id": eos, "pad_token_id": pad}
        return WarmStartSource(source_dir, bert_tensors=bert_tensors, tensors=tensors, encoder_config=encoder_config,
                               decoder_config=decoder_config, config=config, ids=ids)

    @staticmethod
    def build(source: WarmStartSource):
        model = bert2bert_tensors_to_vanilla(source.tensors, source.config, tie_word_embeddings=True)
        return with_generation_config(model, None, source.ids, ids_from=(
            f"warm-start (--decoder-start-token-id and --eos-token-id, else the tokenizer's [CLS] and [SEP]; "
            f"pad_token_id from {source.directory}/config.json)"))

    @staticmethod
    def verify(source: WarmStartSource, model) -> tuple[bool, str]:
        return verify_warm_start(source.directory, source.bert_tensors, model, tensors=source.tensors,
                                 encoder_config=source.encoder_config, decoder_config=source.decoder_config,
                                 ids=source.ids)

    @staticmethod
    def side_files(source: WarmStartSource, directory: Path) -> None:
        copy_tokenizer(source.directory, directory, "BertTokenizer", copy_generation_config=False)

    @staticmethod
    def card(source: WarmStartSource, name: str) -> tuple[str, str]:
        return (f"bert2bert warm-started from {Path(name).name}",
                "Cross-attention is freshly initialised: fine-tune before use.")


WARM_START = WarmStart()


def verify_warm_start(source_dir: Path, bert_tensors: dict, model, tensors: dict, encoder_config: dict,
                      decoder_config: dict, ids: dict) -> tuple[bool, str]:
    """The encoder against transformers' BertModel (the source's `bert_tensors`) layer by layer, then the whole model
    against the `EncoderDecoderModel` holding `tensors`, the same weights (the same fresh cross-attention): both by
    the parity rule. Generation is not compared: an untrained cross-attention makes near ties, not a translation."""
    from transformers import BertConfig, BertModel, EncoderDecoderConfig, EncoderDecoderModel

    print("Verifying the encoder against transformers' BertModel (eager attention, padded batch):")
    bert = reference_model(BertModel, bert_tensors, source_dir)
    batch = verification_batch(model.config)
    with torch.no_grad():
        expected = bert(**batch, output_hidden_states=True).hidden_states
        ours = model.model.encoder(**batch, output_hidden_states=True).hidden_states
    encoder_ok, diff = check("encoder", expected, ours, mask=batch["attention_mask"], dtype=model.dtype)
    del bert

    print("Verifying the whole model against transformers' bert2bert with the same weights:")
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig.from_dict(encoder_config), BertConfig.from_dict(decoder_config), **ids)
    reference = reference_model(EncoderDecoderModel, tensors, config=config)
    ok, summary = verify_seq2seq(reference, model, with_token_types=True, generation=False)
    encoder = f"encoder hidden states max |diff| {diff:.2e} ({rule(model.dtype)})"
    return encoder_ok and ok, f"{encoder}; {summary}"
