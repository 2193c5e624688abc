"""The conversions as data, in one registry: each sub-command's format (formats/), its direction and its options.

The command line (cli.py) builds its parser from this table, and the Python calls (api.py) check their keywords
against it, so that both offer the same options, refuse the same values and run the same flow (`run`). A new format
is its module in formats/ and its rows here (heads it converts are declared once, in hf_vanilla/heads.py).

Import-light: reading this table imports neither torch nor transformers (`--help` answers without them); `run`
imports the flow and the format when a conversion runs.
"""

import importlib
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..heads import converter_heads
from .errors import ConversionError

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Option:
    """One option of a conversion: the keyword `name` in Python, `--name` (dashed) on the command line."""

    name: str
    default: object
    help: str
    choices: tuple | None = None
    integer: bool = False  # an int (or the None default), as the command line's type=int

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Conversion:
    """One sub-command: `name` converts `source_help`'s checkpoint with the format `formats.<module>.<attribute>`,
    forward (a transformers checkpoint -> ours, flow.convert) or `reverse` (ours -> transformers, flow.to_source)."""

    name: str
    help: str
    source_help: str
    verify_help: str
    module: str
    attribute: str = "FORMAT"
    reverse: bool = False
    options: tuple = ()

    def format(self):
        """The format's data (formats/), imported now (it imports torch and transformers)."""
        return getattr(importlib.import_module(f".formats.{self.module}", __package__), self.attribute)


def _dtype(default="float32", saved="dtype of the saved weights") -> Option:
    return Option("dtype", default, saved, DTYPES)


def _encoder(name: str, title: str, model_types: tuple) -> tuple:
    """A BERT-family format both ways: --head follows hf_vanilla/heads.py, --model-type the format's own table
    (tests/test_cli.py holds the two to the format modules)."""
    return (
        Conversion(name, f"a transformers {title} checkpoint -> a vanilla encoder",
                   source_help=f"Hub id or local {title} checkpoint directory",
                   verify_help=f"skip the layer-by-layer comparison with transformers' {title}", module=name, options=(
                       Option("head", "auto", "which model to build; auto follows the source's `architectures`",
                              ("auto", *converter_heads(name))),
                       _dtype())),
        Conversion(f"to-{name}", f"a vanilla encoder checkpoint -> a transformers {title} checkpoint",
                   source_help="vanilla encoder checkpoint directory",
                   verify_help=f"skip loading the written {title} with transformers and comparing it with the source",
                   module=name, reverse=True, options=(
                       _dtype(None, "dtype of the saved weights (default: as stored, which makes the round trip "
                                    "exact)"),
                       Option("model_type", model_types[0], "the model_type to write", model_types))),
    )


def _seq2seq(name: str, help: str, source_help: str, module: str, attribute: str = "FORMAT",
             options: tuple = ()) -> Conversion:
    return Conversion(name, help, source_help=source_help,
                      verify_help="skip the comparison with the transformers model", module=module, attribute=attribute,
                      options=(_dtype(), *options))


def _back(name: str, title: str, help: str) -> Conversion:
    return Conversion(f"to-{name}", help, source_help="vanilla encoder-decoder checkpoint directory",
                      verify_help=f"skip loading the written {title} with transformers and comparing it with the "
                                  "source", module=name, reverse=True)


# In the order `--help` lists them.
CONVERSIONS = {conversion.name: conversion for conversion in (
    *_encoder("bert", "BERT", ("bert",)),
    _seq2seq("warm-start", "one BERT checkpoint -> both stacks of a vanilla encoder-decoder (bert2bert)",
             "Hub id (bert-base-uncased) or local BERT checkpoint dir", module="bert2bert", attribute="WARM_START",
             options=(
                 Option("seed", 0, "seed of the fresh cross-attention", integer=True),
                 Option("decoder_start_token_id", None, "first decoder token; default the tokenizer's [CLS]",
                        integer=True),
                 Option("eos_token_id", None, "end of a target; default the tokenizer's [SEP]", integer=True))),
    _seq2seq("bert2bert", "a transformers EncoderDecoderModel (BERT encoder + BERT decoder) -> vanilla",
             "Hub id or local EncoderDecoderModel checkpoint dir", module="bert2bert", attribute="BERT2BERT"),
    _seq2seq("marian", "a transformers MarianMTModel (OPUS-MT) -> vanilla",
             "Hub id (Helsinki-NLP/opus-mt-en-de) or local MarianMTModel checkpoint dir", "marian"),
    _back("marian", "MarianMTModel", "a vanilla encoder-decoder converted from Marian -> a transformers MarianMTModel"),
    _seq2seq("bart", "a transformers BART checkpoint (BartModel or any BartFor* head) -> its vanilla counterpart",
             "Hub id (facebook/bart-base) or local BART checkpoint dir", "bart"),
    _back("bart", "BART", "a vanilla encoder-decoder (or decoder alone) -> the transformers BART class of the same "
                          "head"),
    *_encoder("roberta", "RoBERTa", ("roberta", "xlm-roberta")),
    *_encoder("distilbert", "DistilBERT", ("distilbert",)),
    *_encoder("electra", "ELECTRA", ("electra",)),
)}


def command_line(conversion: Conversion, source, output, options: dict, force: bool, verify: bool) -> str:
    """The `hf-vanilla` command that does what a Python call did, for the model card (every option not at its
    default, in the table's order)."""
    words = ["hf-vanilla", conversion.name, "--source", str(source), "--output", str(output)]
    for option in conversion.options:
        if options[option.name] != option.default:
            words += [option.flag, str(options[option.name])]
    words += ["--force"] * force + ["--no-verify"] * (not verify)
    return shlex.join(words)


def run(conversion: Conversion, source, output, options: dict, force: bool = False, verify: bool = True,
        command: str | None = None) -> Path:
    """Run one conversion through the one flow (flow.py) with `options` (every option of `conversion`, checked);
    `command` is the command line recorded on the model card (a forward conversion writes one)."""
    for name, value in (("force", force), ("verify", verify)):
        if not isinstance(value, bool):
            raise ConversionError(f"{name}={value!r} is not True or False (--{name if name == 'force' else 'no-verify'}"
                                  f" of hf-vanilla {conversion.name}).")
    flow = importlib.import_module(".flow", __package__)
    if conversion.reverse:
        return flow.to_source(conversion.format(), str(source), str(output), force=force, verify=verify, **options)
    return flow.convert(conversion.format(), str(source), str(output), force=force, verify=verify,
                        command=command or command_line(conversion, source, output, options=options, force=force,
                                                        verify=verify),
                        **options)
