"""argparse `type=` functions for the options of the examples and of benchmarks/ (benchmarks/_cli.py imports them).

A value they refuse ends the script in argparse's own form, `script.py: error: argument --steps: ...`, exit status
2, before any model is loaded. This module imports nothing heavy: benchmarks/charts.py, which needs no torch, uses it.
"""

import argparse
from pathlib import Path


def at_least(minimum: int, meaning: str = ""):
    """A whole number of at least `minimum`. `meaning`, e.g. " (0: never)", says in the error what the least value
    means where it is a setting of its own rather than a count."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {minimum}{meaning}, got {text!r}")
        return value

    return whole_number


def existing(kind: str):
    """The path of a `kind` ("folder" or "file") that exists."""
    is_kind = Path.is_dir if kind == "folder" else Path.is_file

    def path(text: str) -> Path:
        found = Path(text)
        if not is_kind(found):
            there = f"a {'file' if kind == 'folder' else 'folder'}" if found.exists() else "nothing"
            raise argparse.ArgumentTypeError(f"{text} is not a {kind} ({there} is there): pass an existing {kind}")
        return found

    return path
