"""The conversion flow, written once for every format, in both directions:

    convert     read the source -> map its tensors -> build our model -> verify it -> write it
    to_source   read ours -> map back -> build the transformers model -> write it -> verify what was written

A format (formats/: BERT, RoBERTa, DistilBERT, ELECTRA, bert2bert, warm-start, BART, Marian) is data: its key
tables, how its config maps onto ours, its reference classes and what it refuses. Each step below asks the format
for its part and goes on; nothing calls back into the flow. What a format answers:

    model_types, name, title           which checkpoints it reads, how the command and the messages name it
    read(source_dir, config, **choices) -> job     the source's tensors and the model to build (refusals first)
    build(job) -> model                            its key table through the one map -> build step
                                                   (building.map_and_build)
    verify(job, model) -> (ok, summary)            ours against transformers' model of the source (parity.py)
    side_files(job, directory)                     what is copied next to the weights (tokenizer, ...)
    card(job, source) -> (title, notes)            the model card's heading and its notes

and for the way back:

    vanilla_config_class, vanilla_what             the config our checkpoints of this kind hold
    head_of(architecture) -> head | None           which of its heads our class is
    vanilla_class(head), vanilla_classes()         our class of a head; all it converts back, the default first
    required(config, head) -> {field: (value, why)}  what the format computes with one value only (or a test)
    reverse_hint                                   the way out named under those refusals
    target(config, head, **choices) -> (class, config)   the transformers class and config to write
    to_source_model(tensors, config, head, target, source_dir) -> model   (map_and_build, the table inverted)
    compare_written(vanilla, written, head) -> (ok, summary)

Every step is strict and every output atomic (io/output.py): nothing is written unless every step passes. A new
format is its module in formats/ and its rows in the registry of conversions (commands.py), from which the command
line and the Python calls (api.py) are made.
"""

from pathlib import Path

from .errors import ConversionError
from .io.output import atomic_output
from .io.reading import check_tokenizer, load_tensors, read_source
from .io.writing import cast_for_saving, copy_side_files, save_checkpoint, write_model_card
from .mapping import check_layer_counts, vanilla_layer_counts
from .parity import PRECISION_NAMES, reference_model, require_parity


def convert(fmt, source: str, output: str, dtype: str = "float32", force: bool = False, verify: bool = True,
            command: str | None = None, **choices) -> Path:
    """A transformers checkpoint (Hub id or directory) -> a vanilla checkpoint directory; returns its path.

    The model is verified in float32, which compares the conversion exactly, and, for a half precision `dtype`,
    again as it will be saved (`cast_for_saving`); `verify=False` (--no-verify) skips both. `choices` are the
    format's own options (--head, --seed, ...)."""
    source_dir, config = read_source(source, fmt.model_types, fmt.name)  # read
    job = fmt.read(source_dir, config, **choices)
    with atomic_output(output, force, sources=(source_dir,)) as staging:
        model = fmt.build(job)  # map -> build
        check_tokenizer(source_dir, model.config.vocab_size)
        parity = "Not verified (--no-verify)."
        if verify:  # verify
            ok, parity = fmt.verify(job, model.float())
            require_parity(ok, parity)
        cast_for_saving(model, dtype)
        if verify and dtype != "float32":
            print(f"Verifying the model as saved, in {dtype}:")
            ok, saved = fmt.verify(job, model)
            require_parity(ok, saved)
            parity = f"{parity}\n\nAs saved ({dtype}): {saved}"
        save_checkpoint(model, staging)  # write
        fmt.side_files(job, staging)
        title, notes = fmt.card(job, source)
        command = command or f"hf-vanilla {fmt.name} --source {source} --output {output}"
        write_model_card(staging, title, source, command=command, parity=f"{parity}\n\n{notes}".strip())
    return Path(output)


def to_source(fmt, source: str, output: str, force: bool = False, verify: bool = True, dtype: str | None = None,
              **choices) -> Path:
    """A vanilla checkpoint -> the transformers class of the same head (weights, config, the tokenizer files), the
    format's key table read backwards: the same tensors under their source names. `dtype=None` keeps the stored
    dtype, so the round trip is bit-exact. Unless `verify` is False, the written folder is loaded with transformers
    alone, as saved, and compared with the vanilla source. `choices` are the format's own (--model-type)."""
    from huggingface_hub.errors import StrictDataclassError

    source_dir, _ = read_source(source, (fmt.vanilla_config_class.model_type,), f"to-{fmt.name}")  # read ours
    try:
        config = fmt.vanilla_config_class.from_pretrained(source_dir)
        config.check_architecture()
    except (ValueError, TypeError, StrictDataclassError) as error:
        raise ConversionError(f"{source_dir}/config.json is not a valid vanilla {fmt.vanilla_what} config: "
                              f"{error}") from None
    architecture = (config.architectures or [fmt.vanilla_classes()[0]])[0]
    head = fmt.head_of(architecture)
    if head is None:
        raise ConversionError(f"{source_dir} is a {architecture!r}, which has no {fmt.title} counterpart; "
                              f"to-{fmt.name} converts {sorted(fmt.vanilla_classes())}.")
    require_expressible(fmt, config, head)  # before the weights are read
    target_class, target_config = fmt.target(config, head, **choices)
    tensors = load_tensors(source_dir)
    check_layer_counts((key.removeprefix("model.") for key in tensors), vanilla_layer_counts(config),
                       f"{source_dir}/config.json")
    model = fmt.to_source_model(tensors, config, head, target=(target_class, target_config),  # map back -> build
                                source_dir=source_dir)
    if dtype is not None:
        cast_for_saving(model, dtype)
    check_tokenizer(source_dir, model.config.vocab_size)
    with atomic_output(output, force, sources=(source_dir,)) as staging:
        model.save_pretrained(staging)  # write
        copy_side_files(source_dir, staging)
        if verify:  # what a user will do: load the written folder with transformers alone, as saved
            print(f"Verifying the written {target_class.__name__} against the vanilla source (padded batches, "
                  f"{PRECISION_NAMES[model.dtype]}):")
            vanilla = reference_model(fmt.vanilla_class(head), tensors, source_dir)
            written = target_class.from_pretrained(staging, attn_implementation="eager", dtype=model.dtype)
            require_parity(*fmt.compare_written(vanilla, written.eval(), head))
    return Path(output)


def require_expressible(fmt, config, head: str) -> None:
    """Refuse a model the format cannot express, every field at once so that one fix is enough: `fmt.required`
    maps a field to the one value the format computes with (or a test of the value) and why."""
    refusals = []
    for name, (value, why) in fmt.required(config, head).items():
        actual = getattr(config, name)
        if callable(value):
            if not value(actual):
                refusals.append(f"{name}={actual!r} ({why})")
        elif actual != value:
            refusals.append(f"{name}={actual!r} ({why}; needs {value!r})")
    if refusals:
        raise ConversionError(f"This model cannot be expressed as {fmt.title}:\n  " + "\n  ".join(refusals)
                              + (f"\n{fmt.reverse_hint}" if fmt.reverse_hint else ""))
