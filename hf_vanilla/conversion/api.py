"""The Python calls of the converters, for scripts and notebooks: what `hf-vanilla FORMAT` and `hf-vanilla
to-FORMAT` do, with the same options (keywords named as the flags, `--model-type` -> `model_type`), the same checks
and the same output, bit for bit (one flow, run from the registry in commands.py):

    from hf_vanilla.conversion import convert, to_transformers

    convert("bert", "bert-base-uncased", "bert-vanilla", head="masked-lm", dtype="bfloat16")
    to_transformers("bert", "bert-vanilla", "bert-again")

A failure raises `ConversionError` with the message the command line prints after `error:`; an option the format
does not have raises TypeError, as any Python call does. The model card of a converted folder records the
`hf-vanilla` command that does the same.

The module-level `convert` names of the formats before they became one flow (`hf_vanilla.conversion.bert.convert`,
`marian.convert_marian`, `bart.to_bart`, ...) still work, with a DeprecationWarning naming the call that replaces
them (`deprecated`)."""

import warnings
from pathlib import Path

from .commands import CONVERSIONS, Conversion, run
from .errors import ConversionError


def convert(format: str, source, output, *, force: bool = False, verify: bool = True, **options) -> Path:
    """Convert a transformers checkpoint to a vanilla one (`hf-vanilla FORMAT --source SOURCE --output OUTPUT`).

    Args:
        format: "bert", "roberta", "distilbert", "electra" (an encoder and its head), "bart", "marian", "bert2bert"
            (a transformers EncoderDecoderModel of two BERTs) or "warm-start" (one BERT -> both stacks).
        source: a Hub id or a local checkpoint directory.
        output: the folder to write, whole or not at all; refused if it exists, unless `force` and this converter
            wrote it.
        force: replace an earlier output of this converter once the new one is complete.
        verify: compare the converted model with transformers' own, layer by layer, before anything is written
            (False is `--no-verify`).
        options: the format's own, as on its command line: `head` ("auto", or a head such as "masked-lm") and
            `dtype` ("float32", "float16", "bfloat16") for the encoders; `dtype` for the encoder-decoders; `seed`,
            `decoder_start_token_id` and `eos_token_id` for "warm-start".

    Returns the output folder. Raises `ConversionError` (the source, the options or the output is refused, or the
    converted model disagrees with transformers' beyond the parity rule)."""
    selected = _named(format, reverse=False)
    return run(selected, source, output, options=checked_options(selected, options), force=force, verify=verify)


def to_transformers(format: str, source, output, *, force: bool = False, verify: bool = True, **options) -> Path:
    """Convert a vanilla checkpoint back to the transformers class of the same head (`hf-vanilla to-FORMAT`).

    Args:
        format: "bert", "roberta", "distilbert", "electra", "bart" or "marian": the transformers format to write.
        source: a vanilla checkpoint directory (from `convert`, or a model saved with `save_pretrained`).
        output, force: as for `convert`.
        verify: load the written folder with transformers alone and compare it with the source (False is
            `--no-verify`).
        options: for the encoders, `dtype` (default None: as stored, which makes the round trip exact) and
            `model_type` ("xlm-roberta" writes an XLM-RoBERTa).

    Returns the output folder. Raises `ConversionError`, as `convert` does."""
    selected = _named(f"to-{format}", reverse=True)
    return run(selected, source, output, options=checked_options(selected, options), force=force, verify=verify)


def _named(name: str, reverse: bool) -> Conversion:
    """The conversion `name` in the direction of the call, or a ConversionError naming those there are."""
    if name not in CONVERSIONS or CONVERSIONS[name].reverse != reverse:
        forward = [n for n, c in CONVERSIONS.items() if not c.reverse]
        back = [n.removeprefix("to-") for n, c in CONVERSIONS.items() if c.reverse]
        raise ConversionError(f"No conversion {name.removeprefix('to-') if reverse else name!r} "
                              f"{'back to transformers' if reverse else 'to vanilla'}: convert() reads {forward}; "
                              f"to_transformers() writes {back}.")
    return CONVERSIONS[name]


def checked_options(conversion: Conversion, options: dict) -> dict:
    """`options` with every option of `conversion` (the defaults filled in), each value checked as the command
    line checks it: a choice among the flag's choices, an integer where it takes one."""
    known = {option.name: option for option in conversion.options}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"{conversion.name} takes no option {', '.join(map(repr, unknown))}; its options: "
                        f"{sorted(known) or 'none'} (and force, verify).")
    checked = {}
    for name, option in known.items():
        value = options.get(name, option.default)
        if option.choices is not None and value not in option.choices and value != option.default:
            raise ConversionError(f"{name}={value!r} is not one of {list(option.choices)} ({option.flag} of "
                                  f"hf-vanilla {conversion.name}).")
        if option.integer and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConversionError(f"{name}={value!r} is not an integer ({option.flag} of hf-vanilla "
                                  f"{conversion.name}).")
        checked[name] = value
    return checked


# ---- the names before the one flow -------------------------------------------------------------------------------


def deprecated(old: str, name: str, parameters: tuple):
    """The function `old` (e.g. "hf_vanilla.conversion.bert.convert") as it was called, positionally in the order of
    `parameters` after (source, output), with `verify_parity` for `verify`: it warns, naming the call that replaces
    it, and runs the conversion `name` ("bert", "to-marian") through that call."""
    back = name.startswith("to-")
    new = f"hf_vanilla.conversion.{'to_transformers' if back else 'convert'}({name.removeprefix('to-')!r}, ...)"

    def call(source, output, *args, **kwargs):
        warnings.warn(f"{old} is deprecated; call {new} instead (README.md, 'Converting weights').",
                      DeprecationWarning, stacklevel=2)
        if len(args) > len(parameters):
            raise TypeError(f"{old}() takes at most {2 + len(parameters)} positional arguments")
        kwargs = dict(zip(parameters, args)) | kwargs
        if "verify_parity" in kwargs:
            kwargs["verify"] = kwargs.pop("verify_parity")
        force, verify = kwargs.pop("force", False), kwargs.pop("verify", True)
        command = kwargs.pop("command", None)
        selected = CONVERSIONS[name]
        return run(selected, source, output, options=checked_options(selected, kwargs), force=force, verify=verify,
                   command=command)

    call.__name__ = call.__qualname__ = old.rsplit(".", 1)[1]
    call.__doc__ = f"Deprecated: {new} does this. {old}(source, output, {', '.join(parameters)})."
    return call
