"""Encoder-decoders as data: Marian and BART each fill in a `Seq2SeqFormat` (marian.py, bart.py), whose methods are
the steps the one flow (conversion/flow.py) asks a format for, as the BERT-family encoders fill in an
`EncoderFormat` (encoder.py). bert2bert.py's two formats read other sources through the same pieces: the source's
generation settings, its tokenizer copied next to ours, and the verification of a whole encoder-decoder (every
hidden state and output by the parity rule, parity.py, then the tokens `generate()` gives).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...configuration_vanilla import VanillaSeq2SeqConfig
from ..building import map_and_build
from ..errors import ConversionError
from ..io.reading import Source, check_generation_settings, load_tensors, read_generation_config, read_json
from ..io.writing import TOKENIZER_FILES, copy_side_files
from ..mapping import check_layer_counts
from ..parity import PRECISION_NAMES, check, compare_generation, reference_model, reference_side, rule, worse
from .fairseq import fairseq_layer_counts


@dataclass(frozen=True)
class Seq2SeqHead:
    """One transformers class of an encoder-decoder format and the vanilla class it converts to.

    Args:
        model_class: our class.
        table: source module -> ours, outside the stacks (a classification head, say).
        stacks: the stacks the class has: a decoder alone has no encoder, nor cross-attention in its layers.
        decoder_inputs: the class is called with a target (decoder_input_ids); the others read the shifted source.
        generates: the class generates text: verified by the tokens of its `generate()` too.
        base: the base model, whose keys (the source's and ours) carry no `model.` prefix.
    """

    model_class: type
    table: tuple = ()
    stacks: tuple = ("encoder", "decoder")
    decoder_inputs: bool = False
    generates: bool = False
    base: bool = False


@dataclass(frozen=True)
class Seq2SeqFormat:
    """An encoder-decoder source format as data; the methods are the steps flow.py runs, both ways.

    A format module (formats/marian.py, bart.py) fills one in: its key table, its heads, and how its config and its
    token embeddings map onto ours and back. Both ways the same strictness: every tensor mapped or dropped with a
    reason, verified against transformers' model (every hidden state and output by the parity rule, and the tokens
    `generate()` gives), the source's generation config and tokenizer kept.

    Args:
        name: the sub-command ("bart"); the reverse one is "to-" + name.
        title: how the format is called in messages ("BART").
        model_types: the source `model_type`s the format reads.
        heads: transformers class name -> `Seq2SeqHead`; the first is assumed when a config names no
            `architectures`.
        tokenizer_class: written into the converted tokenizer config when the source's names none.
        vanilla_config: (source config dict, head) -> `VanillaSeq2SeqConfig`; raises `ConversionError`.
        key_table: (our config, head) -> source module -> ours, in the key space of the head classes (`model.`
            prefixed), the token embeddings aside.
        prepare: (source tensors, our config) -> a new dict of them as `key_table` reads them (renamed, checked).
        embeddings: (tensors, our config, head) -> our embeddings and output projection, popped from `tensors`.
        dropped: (our config, head) -> {source key prefix: why it is left out}.
        required: (our config, head) -> {field: (value, why)}: what the format computes with one value only (or a
            test of the value); the reverse conversion refuses any other, every such field named at once.
        source_config: (our config, head) -> the transformers config.
        source_embeddings: (our tensors, our config, head, the transformers config) -> the source's embeddings,
            output projection and whatever else the class holds outside `key_table`, popped from our tensors.
        reverse_hint: the way out named under the reverse conversion's refusals.
    """

    name: str
    title: str
    model_types: tuple
    heads: dict
    tokenizer_class: str
    vanilla_config: object
    key_table: object
    prepare: object
    embeddings: object
    dropped: object
    required: object
    source_config: object
    source_embeddings: object
    reverse_hint: str = ""

    def head_for(self, source_config: dict) -> str:
        """The transformers class the source's `architectures` names, refused unless the format converts it."""
        architecture = (source_config.get("architectures") or [next(iter(self.heads))])[0]
        if architecture not in self.heads:
            raise ConversionError(f"No vanilla class matches {architecture!r}; `{self.name}` converts "
                                  f"{sorted(self.heads)}.")
        return architecture

    def to_vanilla(self, tensors: dict, source_config: dict, head: str, config_file: str = "config.json"):
        """In memory: source tensors and config dict -> a vanilla model sharing their storage. `config_file`: where
        the config was read from, for messages."""
        config = self.vanilla_config(source_config, head)
        tensors = self.prepare(tensors, config)
        check_layer_counts(tensors, fairseq_layer_counts(config, self.heads[head].stacks), config_file)
        embeddings = self.embeddings(tensors, config, head)  # popped from `tensors`: before the table is read
        return map_and_build(self.heads[head].model_class, config, tensors, table=self.key_table(config, head),
                             dropped=self.dropped(config, head), extra=embeddings,
                             unprefix="model." if self.heads[head].base else "")  # our base model has no `model.`

    # ---- the flow's steps, source -> vanilla (flow.convert) ----

    def read(self, source_dir: Path, source_config: dict) -> Source:
        head = self.head_for(source_config)
        ids = generation_ids(source_dir, source_config)
        return Source(source_dir, source_config, tensors=load_tensors(source_dir), head=head, ids=ids)

    def build(self, source: Source):
        model = self.to_vanilla(source.tensors, source.config, source.head, f"{source.directory}/config.json")
        return with_generation_config(model, source.directory, source.ids)

    def verify(self, source: Source, model) -> tuple[bool, str]:
        spec = self.heads[source.head]
        return verify_against(source.head, source.tensors, source.directory, model,
                              decoder_inputs=spec.decoder_inputs, generation=spec.generates)

    def side_files(self, source: Source, directory: Path) -> None:
        copy_tokenizer(source.directory, directory, self.tokenizer_class)

    def card(self, source: Source, name: str) -> tuple[str, str]:
        # A format of one class converts "an encoder-decoder"; of several, it names the one it wrote.
        what = "encoder-decoder" if len(self.heads) == 1 else self.heads[source.head].model_class.__name__
        return f"{Path(name).name} as a vanilla {what}", ""

    # ---- the flow's steps, vanilla -> source (flow.to_source) ----

    vanilla_config_class = VanillaSeq2SeqConfig
    vanilla_what = "encoder-decoder"

    def vanilla_class(self, head: str) -> type:
        return self.heads[head].model_class

    def vanilla_classes(self) -> list[str]:
        return [spec.model_class.__name__ for spec in self.heads.values()]  # the default (generation) first

    def head_of(self, architecture: str) -> str | None:
        return next((name for name, spec in self.heads.items() if spec.model_class.__name__ == architecture), None)

    def target(self, config: VanillaSeq2SeqConfig, head: str):
        import transformers

        return getattr(transformers, head), self.source_config(config, head)

    def to_source_model(self, tensors: dict, config: VanillaSeq2SeqConfig, head: str, target, source_dir: Path):
        """Our tensors and config -> the transformers class `head` holding them, `key_table` inverted, with the
        source's generation config (forced_eos_token_id, num_beams...: what generate does)."""
        source_class, source_config = target
        base = self.heads[head].base
        tensors = {("model." if base else "") + key: tensor for key, tensor in tensors.items()}
        inverse = {ours: theirs for theirs, ours in self.key_table(config, head).items()}
        embeddings = self.source_embeddings(tensors, config, head, source_config)
        model = map_and_build(source_class, source_config, tensors, inverse, extra=embeddings,
                              unprefix="model." if base else "")
        generation = read_generation_config(source_dir, config.vocab_size)
        if generation is not None:
            model.generation_config = generation
        return model

    def compare_written(self, vanilla, written, head: str) -> tuple[bool, str]:
        """The written model against the vanilla source, which is the reference (read in float32): by the rule of
        the dtype written, as the encoders' `compare_written` does (a bfloat16 model goes back in bfloat16)."""
        spec = self.heads[head]
        return verify_seq2seq(vanilla, written, decoder_inputs=spec.decoder_inputs, generation=spec.generates)


# ---- generation settings and the tokenizer --------------------------------------------------------------------


def generation_ids(source_dir: Path, config: dict) -> dict:
    """decoder_start / eos / pad / bos ids: the source's generation_config.json first, then its config.json."""
    path = source_dir / "generation_config.json"
    generation = read_json(path, "generation config") if path.is_file() else {}
    if generation and generation.get("decoder_start_token_id", generation.get("bos_token_id")) is None:
        start = config.get("decoder_start_token_id")
        raise ConversionError(
            f"{path} sets neither decoder_start_token_id nor bos_token_id: transformers' generate() cannot start a "
            f"target sentence with it (it does not fall back to config.json). Add \"decoder_start_token_id\": "
            f"{start if start is not None else 'the id that starts a target sentence'} to it.")
    ids = {}
    for name in ("decoder_start_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        ids[name] = generation.get(name, config.get(name, config.get("decoder", {}).get(name)))
    if ids["decoder_start_token_id"] is None:
        raise ConversionError(
            f"{source_dir} sets no decoder_start_token_id (neither generation_config.json nor config.json): "
            f"generation would not know how to start. Set it in the source's config ([CLS], 101, for bert2bert)."
        )
    return ids


def with_generation_config(model, source_dir: Path | None, ids: dict, ids_from: str | None = None):
    """`model`, given the source's generation config whole (forced_eos_token_id, bad_words_ids, num_beams... all
    change what `generate` returns); without one, the special ids alone, read from `ids_from` (the source's
    config.json by default). Either is refused, naming the file and the field, where `generate` would fail on it: a
    token id outside the model's vocabulary, a setting of the wrong type or range (io/reading.py)."""
    from transformers import GenerationConfig

    vocab_size = model.config.vocab_size
    generation = read_generation_config(source_dir, vocab_size) if source_dir is not None else None
    if generation is None:
        generation = GenerationConfig(**{k: v for k, v in ids.items() if v is not None})
        check_generation_settings(generation, ids_from or f"{source_dir}/config.json", vocab_size)
    model.generation_config = generation
    return model


def copy_tokenizer(source_dir: Path, directory: Path, tokenizer_class: str, copy_generation_config: bool = True):
    """The source's tokenizer files, and its generation_config.json byte for byte, next to our checkpoint.

    Sentence-transformers files are left behind: they describe an embedding model (pooling, normalisation), which an
    encoder-decoder is not. The tokenizer config names its class when the source's did not: AutoTokenizer found it
    through the source's model_type, which the converted config no longer has (OPUS-MT's tokenizer_config.json
    holds only the languages, and Marian has no tokenizer.json to fall back on)."""
    generation = ("generation_config.json",) if copy_generation_config else ()
    copied = copy_side_files(source_dir, directory, TOKENIZER_FILES + generation, folders=())
    if set(copied) - set(generation):
        path = directory / "tokenizer_config.json"
        tokenizer_config = json.loads(path.read_text()) if path.is_file() else {}
        if "tokenizer_class" not in tokenizer_config:
            tokenizer_config["tokenizer_class"] = tokenizer_class
            path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


# ---- verification ----------------------------------------------------------------------------------------------


def verify_against(reference_class: str, tensors: dict, source_dir: Path, model, **options) -> tuple[bool, str]:
    """transformers' `reference_class`, holding the source's `tensors`, against ours (`verify_seq2seq`, with
    `options`)."""
    import transformers

    reference = reference_model(getattr(transformers, reference_class), tensors, source_dir)
    print(f"Verifying against transformers' {reference_class} (eager attention, padded batches):")
    return verify_seq2seq(reference, model, **options)


def source_batch(config, batch_size: int = 3, length: int = 12, seed: int = 0, low: int = 5) -> dict:
    """Random source ids, right-padded rows of different lengths (one full, one with a single token), ending with
    eos where the model has one; special ids are avoided inside the text."""
    generator = torch.Generator().manual_seed(seed)
    special = {config.pad_token_id, config.eos_token_id, config.bos_token_id, config.decoder_start_token_id}
    allowed = torch.tensor([i for i in range(low, config.vocab_size) if i not in special])
    input_ids = allowed[torch.randint(len(allowed), (batch_size, length), generator=generator)]
    lengths = torch.tensor([length, length * 2 // 3, 1])[:batch_size]
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    if isinstance(config.eos_token_id, int):
        input_ids[torch.arange(batch_size), lengths - 1] = config.eos_token_id
    input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# Outputs compared, and the label each one's report lines carry.
OUTPUTS = {"encoder_hidden_states": "encoder", "decoder_hidden_states": "decoder", "hidden_states": "hidden states",
           "last_hidden_state": "last_hidden_state", "logits": "logits", "start_logits": "start_logits",
           "end_logits": "end_logits"}


def verify_seq2seq(reference, model, decoder_inputs: bool = True, generation: bool = True,
                   with_token_types: bool = False, max_new_tokens: int = 10, num_beams: int = 4) -> tuple[bool, str]:
    """Every hidden state and output of both models on a padded source batch (with `decoder_inputs`, a padded target
    batch too, opened by the decoder start token), by the parity rule for `model`'s dtype at real tokens; then, with
    `generation`, the token sequences of greedy and beam-search `generate()` from each model's generation config.

    Tokens are compared in float32 only: in half precision rounding may rightly swap two nearly tied tokens, and the
    float32 check (which the flow, flow.py, runs first) has compared them. Returns (ok, a one-line summary)."""
    config = model.config
    batch = source_batch(config)
    inputs, target_mask = dict(batch), batch["attention_mask"]
    if decoder_inputs:
        target = source_batch(config, seed=1, length=9)
        target["input_ids"][:, 0] = config.decoder_start_token_id
        inputs |= {"decoder_input_ids": target["input_ids"], "decoder_attention_mask": target["attention_mask"]}
        target_mask = target["attention_mask"]
    if with_token_types and config.type_vocab_size > 1:
        inputs["token_type_ids"] = (torch.arange(batch["input_ids"].shape[1]) >= 4).long().expand_as(
            batch["input_ids"]) * batch["attention_mask"]
    model.eval()
    with torch.no_grad():
        with reference_side(reference):
            ref_out = reference(**inputs, output_hidden_states=True)
        our_out = model(**inputs, output_hidden_states=True)
    ok, worst = True, 0.0
    for name, label in OUTPUTS.items():
        ref, ours = getattr(ref_out, name, None), getattr(our_out, name, None)
        if ref is None or ours is None:
            continue
        # Decoder states line up with the target, which for the heads that read the shifted source is that source.
        mask = batch["attention_mask"] if name == "encoder_hidden_states" else target_mask
        within, diff = check(label, ref, ours, mask=mask, dtype=model.dtype)
        ok, worst = ok and within, worse(worst, diff)
    summary = (f"max |diff| {worst:.1e} over every hidden state and output ({PRECISION_NAMES[model.dtype]}, padded "
               f"batch, {rule(model.dtype)})")
    if not generation or model.dtype != torch.float32:
        return ok, summary
    if not config.is_encoder_decoder:
        # A decoder alone continues its prompts. Ours takes the positions `generate` derives from a left-padded mask
        # (GPT-2's convention); BartForCausalLM takes none and counts from the row's left edge, padding included, so
        # the two agree on prompts without padding, which is what is compared.
        batch = {"input_ids": batch["input_ids"][:1], "attention_mask": batch["attention_mask"][:1]}
    same, generated = compare_generation(reference, model, batch, max_new_tokens=max_new_tokens, num_beams=num_beams)
    return ok and same, f"{summary}; {generated}"
