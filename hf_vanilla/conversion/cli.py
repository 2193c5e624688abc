"""Convert checkpoints between transformers formats and hf_vanilla models, and export them to ONNX.

    hf-vanilla FORMAT --source SRC --output OUT        (installed command)
    python -m conversion FORMAT ...                    (from a checkout of the repository)

Every conversion is checked against transformers' own model before anything is written, writes its output folder
whole or not at all, and never replaces what it did not write (docs/errors_and_safety.md). A failure prints one
`error:` line and exits with status 2 (1 for a bug in the converter); `--debug` adds the traceback.

This module imports argparse only: `--help` and usage errors are answered without torch and transformers (seconds
to import). Each sub-command imports the flow (flow.py) and its format (formats/) when it runs.
"""

import argparse
import importlib
import os
import shlex
import sys

from ..heads import converter_heads, export_tasks
from .errors import report_failure

DTYPES = ("float32", "float16", "bfloat16")
ONNX_TASKS = tuple(export_tasks().values())  # hf_vanilla/heads.py declares which class exports as which task

# BERT-family formats: sub-command -> (title, --head choices, --model-type choices of the reverse conversion). The
# heads are read from hf_vanilla/heads.py (import-free), which each format (formats/) is checked against on import.
# tests/test_cli.py checks the model types against the converters' own tables.
ENCODER_FORMATS = {
    "bert": ("BERT", converter_heads("bert"), ("bert",)),
    "roberta": ("RoBERTa", converter_heads("roberta"), ("roberta", "xlm-roberta")),
    "distilbert": ("DistilBERT", converter_heads("distilbert"), ("distilbert",)),
    "electra": ("ELECTRA", converter_heads("electra"), ("electra",)),
}


def _flow():
    """The conversion flow, imported when a sub-command runs (it imports torch, transformers and hf_vanilla)."""
    return importlib.import_module(".flow", __package__)


def _format(module: str, name: str = "FORMAT"):
    """A format's data (formats/), imported when its sub-command runs."""
    return getattr(importlib.import_module(f".formats.{module}", __package__), name)


def _io_arguments(parser, source_help: str, force_help: str = "replace an earlier output of this converter once "
                                                                "the new one is complete") -> None:
    parser.add_argument("--source", required=True, help=source_help)
    parser.add_argument("--output", required=True,
                        help="folder to write; refused if it exists, unless --force and this converter wrote it")
    parser.add_argument("--force", action="store_true", help=force_help)
    parser.add_argument("--debug", action="store_true", help="on an error, print the traceback too")


def _encoder_commands(subparsers, name: str, title: str, heads: tuple, model_types: tuple) -> None:
    parser = subparsers.add_parser(name, help=f"a transformers {title} checkpoint -> a vanilla encoder")
    _io_arguments(parser, f"Hub id or local {title} checkpoint directory")
    parser.add_argument("--head", default="auto", choices=["auto", *heads],
                        help="which model to build; auto follows the source's `architectures`")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the saved weights")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help=f"skip the layer-by-layer comparison with transformers' {title}")
    parser.set_defaults(run=lambda a: _flow().convert(_format(name), a.source, a.output, a.dtype, a.force, a.verify,
                                                      a.command, head=a.head))

    parser = subparsers.add_parser(f"to-{name}", help=f"a vanilla encoder checkpoint -> a transformers {title} "
                                                      f"checkpoint")
    _io_arguments(parser, "vanilla encoder checkpoint directory")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="dtype of the saved weights (default: as stored, which makes the round trip exact)")
    parser.add_argument("--model-type", default=model_types[0], choices=model_types, help="the model_type to write")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help=f"skip loading the written {title} with transformers and comparing it with the source")
    parser.set_defaults(run=lambda a: _flow().to_source(_format(name), a.source, a.output, a.force, a.verify, a.dtype,
                                                        model_type=a.model_type))


def _seq2seq_commands(subparsers) -> None:
    def common(parser, source_help):
        _io_arguments(parser, source_help)
        parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the saved weights")
        parser.add_argument("--no-verify", dest="verify", action="store_false",
                            help="skip the comparison with the transformers model")

    parser = subparsers.add_parser("warm-start",
                                   help="one BERT checkpoint -> both stacks of a vanilla encoder-decoder (bert2bert)")
    common(parser, "Hub id (bert-base-uncased) or local BERT checkpoint dir")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh cross-attention")
    parser.add_argument("--decoder-start-token-id", type=int, default=None,
                        help="first decoder token; default the tokenizer's [CLS]")
    parser.add_argument("--eos-token-id", type=int, default=None, help="end of a target; default the tokenizer's [SEP]")
    parser.set_defaults(run=lambda a: _flow().convert(
        _format("bert2bert", "WARM_START"), a.source, a.output, a.dtype, a.force, a.verify, a.command, seed=a.seed,
        decoder_start_token_id=a.decoder_start_token_id, eos_token_id=a.eos_token_id))

    parser = subparsers.add_parser("bert2bert",
                                   help="a transformers EncoderDecoderModel (BERT encoder + BERT decoder) -> vanilla")
    common(parser, "Hub id or local EncoderDecoderModel checkpoint dir")
    parser.set_defaults(run=lambda a: _flow().convert(_format("bert2bert", "BERT2BERT"), a.source, a.output, a.dtype,
                                                      a.force, a.verify, a.command))

    parser = subparsers.add_parser("marian", help="a transformers MarianMTModel (OPUS-MT) -> vanilla")
    common(parser, "Hub id (Helsinki-NLP/opus-mt-en-de) or local MarianMTModel checkpoint dir")
    parser.set_defaults(run=lambda a: _flow().convert(_format("marian"), a.source, a.output, a.dtype, a.force,
                                                      a.verify, a.command))

    parser = subparsers.add_parser("to-marian", help="a vanilla encoder-decoder converted from Marian -> a "
                                                     "transformers MarianMTModel")
    _io_arguments(parser, "vanilla encoder-decoder checkpoint directory")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip loading the written MarianMTModel with transformers and comparing it with the "
                             "source")
    parser.set_defaults(run=lambda a: _flow().to_source(_format("marian"), a.source, a.output, a.force, a.verify))

    parser = subparsers.add_parser("bart", help="a transformers BART checkpoint (BartModel or any BartFor* head) -> "
                                                "its vanilla counterpart")
    common(parser, "Hub id (facebook/bart-base) or local BART checkpoint dir")
    parser.set_defaults(run=lambda a: _flow().convert(_format("bart"), a.source, a.output, a.dtype, a.force, a.verify,
                                                      a.command))

    parser = subparsers.add_parser("to-bart", help="a vanilla encoder-decoder (or decoder alone) -> the transformers "
                                                   "BART class of the same head")
    _io_arguments(parser, "vanilla encoder-decoder checkpoint directory")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip loading the written BART with transformers and comparing it with the source")
    parser.set_defaults(run=lambda a: _flow().to_source(_format("bart"), a.source, a.output, a.force, a.verify))


def _onnx_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "onnx", help="a vanilla checkpoint -> ONNX graph(s), checked with ONNX Runtime (needs the onnx extra)",
        description="Export a vanilla checkpoint to ONNX and check the graphs with ONNX Runtime. Needs onnx, "
                    "onnxscript and onnxruntime: pip install \"hf_vanilla[onnx]\".")
    _io_arguments(parser, "vanilla checkpoint directory (from another sub-command)",
                  force_help="replace an earlier output of this converter once the export succeeds")
    parser.add_argument("--task", default="auto", choices=["auto", *ONNX_TASKS],
                        help="which model and outputs to export; auto follows the checkpoint's `architectures`")
    parser.set_defaults(run=lambda a: importlib.import_module(".onnx_export", __package__).convert(
        a.source, a.output, a.task, a.force))


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     epilog="`%(prog)s FORMAT --help` describes a sub-command.")
    subparsers = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    _encoder_commands(subparsers, "bert", *ENCODER_FORMATS["bert"])
    _seq2seq_commands(subparsers)
    for name in ("roberta", "distilbert", "electra"):
        _encoder_commands(subparsers, name, *ENCODER_FORMATS[name])
    _onnx_command(subparsers)
    return parser


def _prog() -> str:
    """How the user called us, for usage lines and the command recorded on model cards."""
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.basename(script).removesuffix(".exe") == "hf-vanilla":
        return "hf-vanilla"
    if os.path.basename(os.path.dirname(os.path.abspath(script))) == "conversion" and not script.endswith(
            os.path.join("hf_vanilla", "conversion", "__main__.py")):
        return "python -m conversion"  # the repository's runner, conversion/__main__.py
    return f"python -m {__package__}"


def main(argv=None) -> int:
    """Run one sub-command; returns the exit status (0, or 2 for an error, 1 for a bug: see `report_failure`)."""
    prog = _prog()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = build_parser(prog).parse_args(argv)
    args.command = f"{prog} {shlex.join(argv)}"
    from transformers.utils import logging as transformers_logging  # only now: the sub-command needs it anyway

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards": our lines say more
    try:
        result = args.run(args)
    except Exception as error:  # noqa: BLE001  (one error path: an `error:` line and an exit status)
        return report_failure(error, args.debug)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    print(f"Wrote {result}")
    return 0


def command_line() -> int:
    """The `hf-vanilla` console command: `main`, then a fast exit."""
    import gc

    status = main()
    # At exit the interpreter's last garbage collections walk every object torch and transformers created: about
    # 1 s of a 5 s bert-base conversion, to collect nothing this ending process needs back. Exit handlers still run.
    gc.freeze()
    return status
