"""Run the tests that touch what changes between torch releases against the oldest torch that pyproject.toml
allows, in a virtual environment of their own.

What torch changes from release to release is what these tests touch: tracing (torch.compile, torch.export, and
the ONNX exporter built on it: tests/test_export.py, tests/test_onnx.py), the ONNX Runtime engine, which exports the
model when it attaches (tests/test_runtime_onnx.py), every execution path's battery (tests/test_conformance.py:
torch.compile, int8's quantized kernels, pickling), and the tests marked `generation` or `parity` (`generate()`
with static caches and compilation, the attention backends, transformers' own models and model tests on that torch).
The main test run checks every test on the torch README installs, the newest release when it was last raised; this
script checks these at the other end of the range that pyproject.toml declares (`torch>=X`), so that the declared
range is the tested one. How X was found, release by release: docs/torch_versions.md.

    python tests/oldest_torch.py                       # CI runs it after tests/oldest_transformers.py
    python tests/oldest_torch.py --torch 2.7.1         # another release (to find the lowest that passes)
    python tests/oldest_torch.py -- -x                 # pytest arguments after -- (each selection gets them)

The environment is made in a temporary folder and removed afterwards: this clone (editable), then its requirements
and its `test` extra's with torch pinned (to any release, in the declared range or not), so transformers and the
rest are the newest that pip resolves beside that torch. From PyPI on Linux x86-64 torch is the CUDA build (about
5 GB installed; a minute or two here). Exit status 1 if a test fails, or if a selection runs no test.
"""

import sys

from declared_range import ROOT, dependencies, lower_bound, oldest_main

# One pytest run each: pytest selects by marker or by file, not by the union of the two.
SELECTIONS = [["-m", "generation or parity"],
              ["tests/test_export.py", "tests/test_onnx.py", "tests/test_runtime_onnx.py", "tests/test_conformance.py"]]


def oldest_allowed() -> str:
    """X in pyproject.toml's `torch>=X`."""
    return lower_bound("torch", "torch>=X")


def plan(version: str) -> tuple[list, list]:
    """(installs, selections) for torch `version`."""
    # hf_vanilla without its requirements, then those and the test extra's with torch pinned: pip would refuse (or
    # upgrade) a release below the declared bound, and trying one is how a new bound is found.
    others = [str(requirement) for requirement in dependencies("test") if requirement.name != "torch"]
    return [["--no-deps", "-e", ROOT], [f"torch=={version}", *others]], SELECTIONS


def main(argv=None) -> int:
    return oldest_main("torch", __doc__, oldest_allowed, plan, argv)


if __name__ == "__main__":
    sys.exit(main())
