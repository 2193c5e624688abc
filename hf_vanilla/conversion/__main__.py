"""`python -m conversion FORMAT --source SRC --output OUT` (`hf-vanilla` once installed): see `cli.py`."""

import sys

from .cli import command_line, main  # noqa: F401  (main: tests and examples run the CLI in-process)

if __name__ == "__main__":
    sys.exit(command_line())
