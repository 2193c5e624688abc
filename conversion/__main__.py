"""`python -m conversion FORMAT --source SRC --output OUT` from a checkout of the repository: the same command as
`hf-vanilla` once installed. The converters live in the package, `hf_vanilla/conversion/`; this folder only runs them.
"""

import sys

from hf_vanilla.conversion.cli import command_line

if __name__ == "__main__":
    sys.exit(command_line())
