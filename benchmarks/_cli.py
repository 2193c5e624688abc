"""What the benchmark scripts share on their command line: option types that refuse a bad value in argparse's form
(`memory.py: error: argument --shapes: ...`, exit status 2) before any work, and child processes whose failure
ends the script with the child's own error rather than a CalledProcessError that drops it.

The option types `at_least` and `existing` are the examples' (examples/_arguments.py, which imports nothing heavy).
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "examples"))
from _arguments import at_least, existing  # noqa: E402, F401  (re-exported: the benchmarks' option types)

TRACEBACK = "Traceback (most recent call last):"
ERROR = re.compile(r"(\S+: )?error: ")  # a line that reports an error: `error: ...` or `script.py: error: ...`
ERROR_LINES = 8  # of a failed child's stderr, shown at most


def shape(text: str) -> tuple[int, int]:
    """A request shape `ROWSxTOKENS`, e.g. 8x128: two whole numbers of at least 1."""
    found = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    sizes = (int(found[1]), int(found[2])) if found else (0, 0)
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected rows x tokens, two whole numbers of at least 1 joined by x "
                                         f"(e.g. 8x128), got {text!r}")
    return sizes


def last_error(stderr: str) -> str:
    """What a failed process said was wrong: the exception its last Python traceback ends with (without the frames,
    which are the child's code), else its last `error: ...` line (argparse's, `python -m conversion`'s and the
    examples' form), else its last lines. Not simply the last lines: a process can write more after its error, e.g.
    nanobind's report of objects leaked at exit (triton's bindings, which torch loads)."""
    text = stderr.rstrip().splitlines()
    headers = [i for i, line in enumerate(text) if line.startswith(TRACEBACK)]
    if headers:
        after = text[headers[-1] + 1:]  # indented frames, then the exception from the line's start
        start = next((i for i, line in enumerate(after) if not line.startswith(" ")), len(after))
        text = after[start:start + ERROR_LINES]
    else:
        text = [line for line in text if ERROR.match(line)][-1:] or text[-ERROR_LINES:]
    return "\n".join(text) or "(nothing on stderr)"


def child_output(command: list, *, case: str, **options) -> str:
    """The stdout of `command`, run to its end (`options` go to subprocess.run). Where it fails, the script stops
    here with exit status 1 and no traceback of its own, saying which `case` failed and how the child ended."""
    result = subprocess.run(command, capture_output=True, text=True, **options)
    if result.returncode != 0:
        error = "\n".join(f"    {line}" for line in last_error(result.stderr).splitlines())
        sys.exit(f"{Path(sys.argv[0]).name}: error: {case} failed in its own process (exit status "
                 f"{result.returncode}):\n{error}")
    return result.stdout
