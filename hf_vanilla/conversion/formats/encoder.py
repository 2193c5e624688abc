"""BERT-family encoders as data: BERT, RoBERTa, DistilBERT and ELECTRA each fill in an `EncoderFormat` (bert.py,
roberta.py, distilbert.py, electra.py), whose methods are the steps the one flow (conversion/flow.py) asks a format
for, written once for the family: its key tables expanded and inverted, its config mapped and refused, its
layer-by-layer comparison."""

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from ... import modeling_encoder
from ...configuration_vanilla import VanillaEncoderConfig
from ...heads import class_for_head, converter_heads
from ..building import map_and_build
from ..errors import ConversionError
from ..io.reading import Source, load_tensors
from ..io.writing import copy_side_files
from ..mapping import check_layer_counts, expand_table, normalise_keys, untie
from ..parity import PRECISION_NAMES, check, reference_model, rule, verification_batch


def require_encoder(source_config: dict, title: str, decoder_hint: str = "only encoders convert.",
                    causal: bool = False) -> None:
    """Refuse what a vanilla encoder cannot compute: relative positions, cross-attention, and (unless the format
    carries `is_decoder` over, `causal`) a stack masked to the past."""
    if source_config.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(
            f"position_embedding_type={source_config['position_embedding_type']!r} (relative positions) has no "
            f"vanilla equivalent; only absolute (learned) positions convert."
        )
    if source_config.get("add_cross_attention") or (source_config.get("is_decoder") and not causal):
        raise ConversionError(f"This {title} is a decoder (is_decoder/add_cross_attention); {decoder_hint}")


# Buffers BERT-family checkpoints may store (module-relative keys): left out, the model recomputes them.
BUFFERS = {
    "embeddings.position_ids": "a buffer of 0..max_positions-1, recomputed by the model",
    "embeddings.token_type_ids": "a buffer of zeros, recomputed by the model",
}


def compare(reference, model) -> tuple[bool, str]:
    """Feed both models `verification_batch`; check every layer's hidden states and the head's outputs
    (pooler_output, logits, start/end logits) by the parity rule (`parity.check`) for `model`'s dtype, at real tokens
    only (padding positions carry no meaning). Returns (all within the rule, a one-line summary)."""
    batch = verification_batch(model.config)
    mask = batch["attention_mask"]
    if type(model).__name__.endswith("ForMultipleChoice"):  # one question, whose choices are the batch's rows
        batch = {name: tensor[None] for name, tensor in batch.items()}  # (1, C, T)
    with torch.no_grad():
        ref_out = reference(**batch, output_hidden_states=True)
        our_out = model(**batch, output_hidden_states=True)
    ok, worst = check("hidden states", ref_out.hidden_states, our_out.hidden_states, mask=mask, dtype=model.dtype)
    summary = [f"hidden states (every layer) {worst:.1e}"]
    for name in ("pooler_output", "logits", "prediction_logits", "seq_relationship_logits", "start_logits",
                 "end_logits"):
        ref, ours = getattr(ref_out, name, None), getattr(our_out, name, None)
        if ref is None or ours is None:  # a base model without a pooler, or an output this head has not
            continue
        within, diff = check(name, ref, ours, mask=mask, dtype=model.dtype)
        ok = ok and within
        summary.append(f"{name} {diff:.1e}")
    return ok, (f"max |diff| against {type(reference).__name__}: " + ", ".join(summary) +
                f" ({PRECISION_NAMES[model.dtype]}, eager attention, right-padded batch; {rule(model.dtype)} for "
                f"every layer and head output).")


@dataclass(frozen=True)
class EncoderHead:
    """One head of a BERT-family format: how the source stores it. The vanilla class that holds it is not named
    here: hf_vanilla/heads.py declares it once for the head's name (`EncoderFormat.model_class`).

    Args:
        source_suffix: the transformers class name after the family prefix ("ForMaskedLM" -> RobertaForMaskedLM).
        table: source module -> ours, for the head's own modules (outside the base model).
        tied: source key -> the key it duplicates (keys without the format's prefix). Older checkpoints store tied
            weights twice; each copy must equal its original (else the checkpoint is untied and refused) and is then
            dropped; a copy whose original is missing stands in for it.
        causal: the head reads a stack masked to the past (BERT's `BertLMHeadModel`): the converted config gets
            `is_decoder=True`.
    """

    source_suffix: str
    table: tuple = ()
    tied: dict = field(default_factory=dict)
    causal: bool = False


# The encoder alone, which every format has.
BASE_HEAD = EncoderHead("Model")


def masked_lm_head(dense: str, norm: str, decoder: str, tied: dict) -> EncoderHead:
    """A format's MLM head under its own module names: dense, activation, LayerNorm, and the decoder tied to the
    word embeddings (its bias kept) -- BERT's head, which is our `VanillaLMHead`. `tied`: see `EncoderHead`."""
    return EncoderHead("ForMaskedLM", table=((dense, "lm_head.dense"), (norm, "lm_head.norm"),
                                             (decoder, "lm_head.decoder")), tied=tied)


# The task heads every BERT-family format names as BERT does (`classifier`, `qa_outputs`), as ours do.
TASK_HEADS = {
    "token-classification": EncoderHead("ForTokenClassification", table=(("classifier", "classifier"),)),
    "question-answering": EncoderHead("ForQuestionAnswering", table=(("qa_outputs", "qa_outputs"),)),
}

# transformers' classes of the family that a format without the matching head refuses, and why (`EncoderFormat`).
UNCONVERTED_CLASSES = {
    "ForMultipleChoice": "this format's multiple-choice head is not converted",
    "ForCausalLM": "it is a decoder",
}


@dataclass(frozen=True)
class EncoderFormat:
    """A BERT-family source format as data; the methods are the steps flow.py runs, both ways, and check parity.

    A format module (formats/bert.py, roberta.py, distilbert.py, electra.py) fills one in: its key tables, its
    heads, and how its config maps onto `VanillaEncoderConfig` and back. The flow is shared so that the formats behave
    alike: the same strictness (every source tensor mapped or dropped with a reason, every target tensor filled,
    shapes checked, errors naming the checkpoint's own keys), the same atomic output, the same layer-by-layer
    verification, and the reverse conversion built from the same table, inverted, and checked by loading what it
    wrote with transformers.

    Args:
        name: the sub-command ("roberta"); the reverse one is "to-" + name.
        title: how the format is called in messages ("RoBERTa").
        model_types: the source `model_type`s the format reads ("roberta", "xlm-roberta"); the first is what the
            reverse conversion writes by default. transformers names their classes (`class_prefix`) and where its
            head models keep the encoder (`prefix`).
        encoder_table: source module -> ours within the base model, `{i}` marking the layer. A row whose target is
            "pooler" is used only by heads that read the pooler (the base model's, when the checkpoint has one).
        heads: head name (the --head choice) -> `EncoderHead`: the heads hf_vanilla/heads.py declares for this
            format (its `formats`), each converting to the class declared there.
        vanilla_config: (full source config dict, head) -> `VanillaEncoderConfig`; raises `ConversionError`.
        source_config: (`VanillaEncoderConfig`, head, model_type) -> the transformers config; raises
            `ConversionError` for what the format cannot express beyond `fixed_values` and what every format checks.
        fixed_values: (`VanillaEncoderConfig`) -> {field: (value, why)}: our config fields that the format computes
            with one value only; the reverse conversion refuses any other, every such field named at once.
        refused: source class suffix -> why that head cannot be expressed (the message adds the way out); merged
            over `UNCONVERTED_CLASSES` for the suffixes `heads` lacks.
        task_modules: source modules of the refused heads ("classifier" for RoBERTa's dense + out_proj): left out,
            with every other head's modules, when the encoder alone is converted (--head base).
        mislabelled: source class suffix -> (head, key): a checkpoint whose `architectures` names that class but
            that stores `key` holds `head` (bert-base-uncased says BertForMaskedLM and is BERT's whole pre-training
            model), which `--head auto` converts so that nothing it holds is thrown away.
        decoder_hint: the way out named when a decoder (cross-attention, or a causal stack where no head is
            causal) is refused.
        limitations: appended to the converted model card's parity section.
        layers_field: the source config's field for the number of layers (DistilBERT's "n_layers").
        gelu_lm_head: how messages name the format's MLM head where it applies GELU whatever `hidden_act` says
            (RoBERTa's, ELECTRA's generator's); ours applies `hidden_act`, so that head converts, both ways, only
            with hidden_act="gelu". Empty where the source's head applies `hidden_act` too.
    """

    name: str
    title: str
    model_types: tuple
    encoder_table: tuple
    heads: dict
    vanilla_config: object
    source_config: object
    fixed_values: object
    refused: dict = field(default_factory=dict)
    task_modules: tuple = ()
    mislabelled: dict = field(default_factory=dict)
    decoder_hint: str = "only encoders convert."
    limitations: str = ""
    layers_field: str = "num_hidden_layers"
    gelu_lm_head: str = ""

    def __post_init__(self):
        """`heads` must be the heads hf_vanilla/heads.py declares for this format (what the command line offers): a
        head added to one and not the other fails here, on import."""
        declared = converter_heads(self.name)
        if set(self.heads) != set(declared):
            raise TypeError(f"The {self.title} format's heads {sorted(self.heads)} are not those hf_vanilla/heads.py "
                            f"declares for {self.name!r}, {sorted(declared)}: declare each head once there, with "
                            f"its `formats`.")

    # ---- names and tables ----

    @staticmethod
    def model_class(head: str) -> type:
        """The vanilla class that `head` converts to, as hf_vanilla/heads.py declares it."""
        return getattr(modeling_encoder, class_for_head(head))

    @staticmethod
    def class_prefix(model_type: str) -> str:
        """What transformers' classes of `model_type` start with ("xlm-roberta" -> "XLMRoberta")."""
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        return MODEL_MAPPING_NAMES[model_type].removesuffix("Model")

    def source_class(self, model_type: str, head: str):
        import transformers

        return getattr(transformers, self.class_prefix(model_type) + self.heads[head].source_suffix)

    @property
    def prefix(self) -> str:
        """Where the source's head models keep the encoder ("roberta."): source keys are read without it
        (transformers' loader accepts either too), and the reverse conversion writes it for head models."""
        return self.source_class(self.model_types[0], "base").base_model_prefix + "."

    def reads_pooler(self, head: str) -> bool:
        """Whether `head` keeps the source's pooler: the base model (when it has one) and heads whose class reads it
        (`uses_pooler`); for the others it is left out."""
        return head == "base" or self.model_class(head).uses_pooler

    def head_for(self, source_config: dict, requested: str, tensors: dict) -> str:
        """The head to build: as requested, else as the source's `architectures` says (see `mislabelled`)."""
        if requested != "auto":
            return requested
        model_type = source_config["model_type"]
        architecture = (source_config.get("architectures") or [self.class_prefix(model_type) + "Model"])[0]
        prefixes = [self.class_prefix(t) for t in self.model_types]
        prefix = max((p for p in prefixes if architecture.startswith(p)), key=len, default="")
        suffix = architecture.removeprefix(prefix)
        heads = {spec.source_suffix: head for head, spec in self.heads.items()}
        refused = {s: why for s, why in (UNCONVERTED_CLASSES | self.refused).items() if s not in heads}
        if suffix in refused:
            raise ConversionError(
                f"{architecture} cannot be converted: {refused[suffix]}. Convert the encoder alone with "
                f"--head base (its task head is then dropped)."
            )
        if suffix in self.mislabelled:
            head, key = self.mislabelled[suffix]
            if any(name.endswith(key) for name in tensors):
                return head
        if suffix not in heads:
            raise ConversionError(
                f"No vanilla head matches the source architecture {architecture!r}; pass --head with one of "
                f"{sorted(self.heads)} (e.g. --head base for the encoder alone)."
            )
        return heads[suffix]

    def key_table(self, num_layers: int, head: str, source_prefix: str = "") -> dict[str, str]:
        """Source module -> ours for every module of `head`; `source_prefix` ("roberta.") is what the source's head
        models put before the encoder's modules, as `model.` does before ours."""
        our_prefix = "" if head == "base" else "model."
        rows = [row for row in self.encoder_table if row[1] != "pooler" or self.reads_pooler(head)]
        table = {source_prefix + s: our_prefix + o for s, o in expand_table(rows, num_layers).items()}
        table.update(expand_table(list(self.heads[head].table), 0))
        return table

    def dropped_keys(self, head: str) -> dict[str, str]:
        """Source key prefixes (without the format's prefix) left out on purpose, with the reason: the buffers, an
        unread pooler, and the modules of the other heads (a pre-training checkpoint holds two)."""
        dropped = dict(BUFFERS)
        if not self.reads_pooler(head):
            dropped["pooler."] = f"the pooler, which neither {self.title}'s {head} model nor ours builds or reads"
        own = {module for module, _ in self.heads[head].table}
        others = [module for spec in self.heads.values() for module, _ in spec.table]
        for module in others + (list(self.task_modules) if head == "base" else []):
            if module not in own:
                dropped.setdefault(module + ".", f"a head other than the requested --head {head}")
        return dropped

    def require_gelu(self, hidden_act: str | None, head: str, way_out: str) -> None:
        """Refuse the MLM head of a format whose head applies GELU (`gelu_lm_head`) under any other `hidden_act`,
        naming `way_out`, what converts instead."""
        if self.gelu_lm_head and head == "masked-lm" and hidden_act != "gelu":
            raise ConversionError(
                f"{self.gelu_lm_head} applies GELU whatever hidden_act says, and the vanilla head applies hidden_act "
                f"({hidden_act!r}): {way_out}."
            )

    # ---- source -> vanilla ----

    def encoder_config(self, source_config: dict, head: str) -> VanillaEncoderConfig:
        """The source's config (a dict) as ours, refused if a vanilla encoder cannot compute what it describes."""
        from huggingface_hub.errors import StrictDataclassError

        causal = any(spec.causal for spec in self.heads.values())  # the format carries `is_decoder` over
        require_encoder(source_config, self.title, self.decoder_hint, causal=causal)
        self.require_gelu(source_config.get("hidden_act"), head, "convert with --head base")  # DistilBERT's is absent
        try:
            config = self.vanilla_config(source_config, head)
            config.check_architecture()
        except (ValueError, StrictDataclassError) as error:
            raise ConversionError(f"The source's config.json describes no valid encoder: {error}") from None
        return config

    def to_vanilla(self, tensors: dict, source_config: dict, head: str, config_file: str = "config.json"):
        """In memory: source tensors and full config dict -> a vanilla model sharing their storage. `config_file`:
        where the config was read from, for messages."""
        config = self.encoder_config(source_config, head)
        spec = self.heads[head]
        normalised = normalise_keys(tensors, self.prefix)
        layers = next(source for source, _ in self.encoder_table if "{i}" in source)
        check_layer_counts(normalised, [(layers, self.layers_field, config.num_hidden_layers)], config_file)
        checkpoint_names = dict(zip(normalised, tensors))  # for messages: the names the user's checkpoint has
        untie(normalised, spec.tied, self.title, "Convert with --head base to keep the encoder only.")
        # A base model has a pooler when saved with one (BertModel(add_pooling_layer=False) has none); a head that
        # reads it needs it (a checkpoint without one is reported as missing it); other heads never build one.
        pooler = [f"{module}.weight" for module, ours in self.encoder_table if ours == "pooler"]
        config.use_pooler = self.reads_pooler(head) and (head != "base" or any(k in normalised for k in pooler))
        if spec.causal:
            config.is_decoder = True
        model_class = self.model_class(head)
        model = map_and_build(model_class, config, normalised, table=self.key_table(config.num_hidden_layers, head),
                              dropped=self.dropped_keys(head), checkpoint_names=checkpoint_names)
        model.config.architectures = [model_class.__name__]
        return model

    # ---- the flow's steps, source -> vanilla (flow.convert) ----

    def read(self, source_dir: Path, raw_config: dict, head: str = "auto") -> Source:
        """The source's config, completed from its config class, its tensors, and the head to build."""
        from transformers import AutoConfig

        # Fields left at their defaults may be missing from config.json: read them from the source's config class.
        try:
            source_config = AutoConfig.for_model(**raw_config).to_dict()
        except Exception as error:
            raise ConversionError(f"{source_dir}/config.json is not a valid {self.title} config: {error}") from None
        tensors = load_tensors(source_dir)
        return Source(source_dir, source_config, tensors, self.head_for(source_config, head, tensors))

    def build(self, source: Source):
        return self.to_vanilla(source.tensors, source.config, source.head, f"{source.directory}/config.json")

    def verify(self, source: Source, model) -> tuple[bool, str]:
        """transformers' model (loaded from the source's tensors) and ours on a right-padded batch, every layer's
        hidden states and every head output by the parity rule (`compare`). Returns (ok, summary)."""
        reference_class = self.source_class(source.config["model_type"], source.head)
        print(f"Verifying against transformers' {reference_class.__name__} (eager attention, padded batch):")
        # A causal head follows ours: BertLMHeadModel masks its self-attention to the past only when told to.
        overrides = {"is_decoder": True} if self.heads[source.head].causal else {}
        config = reference_class.config_class.from_pretrained(source.directory, **overrides)
        reference = reference_model(reference_class, source.tensors, source.directory, config=config)
        return compare(reference, model)

    @staticmethod
    def side_files(source: Source, directory: Path) -> None:
        copy_side_files(source.directory, directory)  # the tokenizer, and sentence-transformers' files

    def card(self, source: Source, name: str) -> tuple[str, str]:
        return f"{Path(name).name} as a vanilla encoder", self.limitations

    # ---- the flow's steps, vanilla -> source (flow.to_source) ----

    vanilla_config_class = VanillaEncoderConfig
    vanilla_what = "encoder"
    reverse_hint = ""

    def vanilla_class(self, head: str) -> type:
        return self.model_class(head)

    def vanilla_classes(self) -> list[str]:
        return [class_for_head(head) for head in self.heads]  # "base" first: a config without `architectures`

    def head_of(self, architecture: str) -> str | None:
        return next((head for head in self.heads if class_for_head(head) == architecture), None)

    def required(self, config: VanillaEncoderConfig, head: str, model_type: str | None = None) -> dict:
        """What this format computes with one value only: {field: (value, why)}, or (test, why) for a range."""
        source_class = self.source_class(model_type or self.model_types[0], head)
        needed = {
            "position_embedding_type": ("learned", f"{self.title} learns its position embeddings"),
            "pre_norm": (False, f"{self.title} normalises after each residual sum (post-LN)"),
            "scale_embeddings": (False, f"{self.title} does not scale its token embeddings"),
            "embedding_layer_norm": (True, f"{self.title} always LayerNorms the summed embeddings"),
        }
        if head != "base" and self.reads_pooler(head):
            needed["use_pooler"] = (True, f"{source_class.__name__} reads its pooler")
        if self.model_class(head)._tied_weights_keys:
            needed["tie_word_embeddings"] = (True, f"{self.title}'s MLM decoder is the word embedding matrix")
        needed |= self.fixed_values(config)
        # BERT, RoBERTa and ELECTRA always add a token type vector; DistilBERT (no such field) has none.
        if hasattr(source_class.config_class(), "type_vocab_size"):
            needed["type_vocab_size"] = (lambda size: size != 0, f"{self.title} always adds a token type embedding; "
                                                                 f"needs >= 1")
        return needed

    def target(self, config: VanillaEncoderConfig, head: str, model_type: str | None = None):
        """The transformers class of `head` and its config; refuses what `source_config` cannot express."""
        source_class = self.source_class(model_type or self.model_types[0], head)
        self.require_gelu(config.hidden_act, head, "only hidden_act='gelu' converts back with this head")
        target_config = self.source_config(config, head, model_type or self.model_types[0])
        target_config.architectures = [source_class.__name__]
        return source_class, target_config

    def to_source_model(self, tensors: dict, config: VanillaEncoderConfig, head: str, target, source_dir: Path):
        """Our tensors -> the transformers class of `head` holding them, the key table inverted."""
        import inspect

        source_class, target_config = target
        ours = dict(tensors)  # `tensors` stays whole for the verification's reference
        untie(ours, self.model_class(head)._tied_weights_keys or {}, self.title,
              "Save the model again (save_pretrained re-ties it) or fix the checkpoint.")
        inverse = {o: s for s, o in self.key_table(config.num_hidden_layers, head,
                                                   "" if head == "base" else self.prefix).items()}
        # Checkpoints converted before heads stopped building an unread pooler have one.
        dropped = {} if self.reads_pooler(head) else {"model.pooler.": f"{source_class.__name__} has no pooler"}
        build_class = source_class
        if "add_pooling_layer" in inspect.signature(source_class.__init__).parameters:
            build_class = partial(source_class, add_pooling_layer=config.use_pooler)
        return map_and_build(build_class, target_config, ours, table=inverse, dropped=dropped)

    @staticmethod
    def compare_written(vanilla, written, head: str) -> tuple[bool, str]:
        return compare(vanilla, written)
