"""Encoder-decoder formats: one flow for Marian and BART, each of which fills in a `Seq2SeqFormat` (marian.py,
bart.py), as the BERT-family encoders fill in an `EncoderFormat` (encoder_format.py).

bert2bert (bert2bert.py) reads a transformers `EncoderDecoderModel`, two BERTs each with its own key space, and
warm-starts one from a single BERT with fresh cross-attention: its two sub-commands keep their own functions, built
from the same pieces (seq2seq.py's settings, saving and verification).
"""

from dataclasses import dataclass
from pathlib import Path

from ..configuration_vanilla import VanillaSeq2SeqConfig
from .building import build_model
from .errors import ConversionError
from .mapping import check_layer_counts, map_tensors, vanilla_layer_counts
from .parity import reference_model
from .reading import load_tensors, read_generation_config, read_source
from .seq2seq import (
    fairseq_layer_counts,
    generation_ids,
    save_seq2seq,
    verifier,
    verify_seq2seq,
    with_generation_config,
)
from .writing import write_conversion, write_source_format


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
    """An encoder-decoder source format as data; the methods convert it to a vanilla model and back, and check parity.

    A format module (conversion/marian.py, bart.py) fills one in: its key table, its heads, and how its config and
    its token embeddings map onto ours and back. The flow is shared: read the source (never running its code), map
    every tensor or drop it with a reason, build, verify against transformers' model of the source (every hidden
    state and output by the parity rule, and the tokens `generate()` gives), write atomically with the source's
    generation config and tokenizer; the reverse builds the source's class from the same table, inverted, and checks
    what it wrote by loading it with transformers alone.

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
        source_config: (our config, head) -> the transformers config; raises `ConversionError` for what the format
            cannot express, every such field named at once.
        source_embeddings: (our tensors, our config, head, the transformers config) -> the source's embeddings,
            output projection and whatever else the class holds outside `key_table`, popped from our tensors.
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
    source_config: object
    source_embeddings: object

    def head_for(self, source_config: dict) -> str:
        """The transformers class the source's `architectures` names, refused unless the format converts it."""
        architecture = (source_config.get("architectures") or [next(iter(self.heads))])[0]
        if architecture not in self.heads:
            raise ConversionError(f"No vanilla class matches {architecture!r}; `{self.name}` converts "
                                  f"{sorted(self.heads)}.")
        return architecture

    # ---- source -> vanilla ----

    def to_vanilla(self, tensors: dict, source_config: dict, head: str, config_file: str = "config.json"):
        """In memory: source tensors and config dict -> a vanilla model sharing their storage. `config_file`: where
        the config was read from, for messages."""
        config = self.vanilla_config(source_config, head)
        tensors = self.prepare(tensors, config)
        check_layer_counts(tensors, fairseq_layer_counts(config, self.heads[head].stacks), config_file)
        embeddings = self.embeddings(tensors, config, head)
        mapped, unknown = map_tensors(tensors, self.key_table(config, head), self.dropped(config, head))
        mapped.update(embeddings)
        if self.heads[head].base:  # our base model has no `model.` prefix either
            mapped = {key.removeprefix("model."): tensor for key, tensor in mapped.items()}
        return build_model(self.heads[head].model_class, config, mapped, unknown)

    def convert(self, source: str, output: str, dtype: str = "float32", force: bool = False,
                verify_parity: bool = True, command: str | None = None) -> Path:
        """Source checkpoint (Hub id or directory) -> vanilla checkpoint directory. Returns the output path."""
        source_dir, source_config = read_source(source, self.model_types, self.name)
        head = self.head_for(source_config)
        ids = generation_ids(source_dir, source_config)
        tensors = load_tensors(source_dir)
        spec = self.heads[head]
        # A format of one class converts "an encoder-decoder"; of several, it names the one it wrote.
        what = "encoder-decoder" if len(self.heads) == 1 else spec.model_class.__name__
        return write_conversion(
            output, force, source, source_dir,
            build=lambda: with_generation_config(
                self.to_vanilla(tensors, source_config, head, f"{source_dir}/config.json"), source_dir, ids),
            verify=verifier(head, tensors, source_dir, decoder_inputs=spec.decoder_inputs,
                            generation=spec.generates) if verify_parity else None,
            save=lambda model, directory: save_seq2seq(model, directory, source_dir, self.tokenizer_class),
            title=f"{Path(source).name} as a vanilla {what}",
            command=command or f"hf-vanilla {self.name} --source {source} --output {output}",
            dtype=dtype,
        )

    # ---- vanilla -> source ----

    def to_source_model(self, tensors: dict, config: VanillaSeq2SeqConfig, head: str, source_config):
        """In memory: our tensors and config -> the transformers class `head` (configured by `source_config`, from
        `self.source_config`) holding them, `key_table` inverted."""
        import transformers

        base = self.heads[head].base
        tensors = {("model." if base else "") + key: tensor for key, tensor in tensors.items()}
        inverse = {ours: theirs for theirs, ours in self.key_table(config, head).items()}
        embeddings = self.source_embeddings(tensors, config, head, source_config)
        mapped, unknown = map_tensors(tensors, inverse, {})
        mapped.update(embeddings)
        if base:
            mapped = {key.removeprefix("model."): tensor for key, tensor in mapped.items()}
        return build_model(getattr(transformers, head), source_config, mapped, unknown)

    def to_source(self, source: str, output: str, force: bool = False, verify_parity: bool = True) -> Path:
        """A vanilla checkpoint -> the transformers class of the same head (weights, config, the generation config,
        the tokenizer files). Unless `verify_parity` is False, the written folder is loaded with transformers alone and
        compared with the vanilla source: every output by the parity rule, and for the classes that generate the
        tokens of greedy and beam-search `generate()`."""
        import transformers

        source_dir, _ = read_source(source, (VanillaSeq2SeqConfig.model_type,), f"to-{self.name}")
        try:
            config = VanillaSeq2SeqConfig.from_pretrained(source_dir)
            config.check_architecture()
        except ValueError as error:
            raise ConversionError(f"{source_dir}/config.json is not a valid vanilla encoder-decoder config: "
                                  f"{error}") from None
        ours = (config.architectures or ["VanillaSeq2SeqForConditionalGeneration"])[0]
        head = next((name for name, spec in self.heads.items() if spec.model_class.__name__ == ours), None)
        if head is None:
            raise ConversionError(f"{source_dir} is a {ours!r}, which has no {self.title} counterpart; "
                                  f"to-{self.name} converts "
                                  f"{sorted(spec.model_class.__name__ for spec in self.heads.values())}.")
        spec, source_config = self.heads[head], self.source_config(config, head)  # refused before reading weights
        tensors = load_tensors(source_dir)
        check_layer_counts((key.removeprefix("model.") for key in tensors), vanilla_layer_counts(config),
                           f"{source_dir}/config.json")
        model = self.to_source_model(tensors, config, head, source_config)
        # forced_eos_token_id, num_beams...: what generate does
        generation = read_generation_config(source_dir, config.vocab_size)
        if generation is not None:
            model.generation_config = generation

        def verify(staging):
            print(f"Verifying the written {head} against the vanilla source (padded batches):")
            reference = reference_model(spec.model_class, tensors, source_dir)
            written = getattr(transformers, head).from_pretrained(staging, attn_implementation="eager")
            return verify_seq2seq(written.eval(), reference, decoder_inputs=spec.decoder_inputs,
                                  generation=spec.generates)

        return write_source_format(output, force, source_dir, model, verify if verify_parity else None)
