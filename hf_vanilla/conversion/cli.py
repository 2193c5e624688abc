"""Convert checkpoints between transformers formats and hf_vanilla models, and export them to ONNX.

    hf-vanilla FORMAT --source SRC --output OUT        (installed command)
    python -m conversion FORMAT ...                    (from a checkout of the repository)

Every conversion is checked against transformers' own model before anything is written, writes its output folder
whole or not at all, and never replaces what it did not write (docs/errors_and_safety.md). A failure prints one
`error:` line and exits with status 2 (1 for a bug in the converter); `--debug` adds the traceback.

This module imports argparse only: `--help` and usage errors are answered without torch and transformers (seconds
to import). The sub-commands and their options are the registry's (commands.py), which the Python calls (api.py)
share; each imports the flow (flow.py) and its format (formats/) when it runs.
"""

import argparse
import importlib
import os
import shlex
import sys

from ..heads import export_tasks
from .commands import CONVERSIONS, run
from .errors import report_failure

ONNX_TASKS = tuple(export_tasks().values())  # hf_vanilla/heads.py declares which class exports as which task


def _io_arguments(parser, source_help: str, force_help: str = "replace an earlier output of this converter once "
                                                                "the new one is complete") -> None:
    parser.add_argument("--source", required=True, help=source_help)
    parser.add_argument("--output", required=True,
                        help="folder to write; refused if it exists, unless --force and this converter wrote it")
    parser.add_argument("--force", action="store_true", help=force_help)
    parser.add_argument("--debug", action="store_true", help="on an error, print the traceback too")


def _conversion_command(subparsers, conversion) -> None:
    """One sub-command of the registry (commands.py): its options as flags, run as the Python call runs it."""
    parser = subparsers.add_parser(conversion.name, help=conversion.help)
    _io_arguments(parser, conversion.source_help)
    for option in conversion.options:
        parser.add_argument(option.flag, dest=option.name, default=option.default, choices=option.choices,
                            type=int if option.integer else None, help=option.help)
    parser.add_argument("--no-verify", dest="verify", action="store_false", help=conversion.verify_help)

    def run_conversion(a):
        options = {option.name: getattr(a, option.name) for option in conversion.options}
        return run(conversion, a.source, a.output, options=options, force=a.force, verify=a.verify, command=a.command)

    parser.set_defaults(run=run_conversion)


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
    for conversion in CONVERSIONS.values():
        _conversion_command(subparsers, conversion)
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
    # At exit the interpreter's last garbage collections walk every object torch and transformers created: a sizeable
    # share of a short conversion, to collect nothing this ending process needs back. Exit handlers still run.
    gc.freeze()
    return status
