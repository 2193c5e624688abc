"""The lower ends of the ranges pyproject.toml declares, each tested in a virtual environment of its own.

pyproject.toml declares a range for torch (`torch>=X`) and for transformers (`transformers>=Y,<6`). The main test
run checks the newest releases; tests/oldest_transformers.py and tests/oldest_torch.py check the lower bounds, with
what this module gives them: a bound as pyproject.toml writes it, their one `main` (`oldest_main`), and
`run_in_new_environment`, which makes a virtual environment in a temporary folder, installs into it, runs pytest
there once per selection of tests, and removes it. A run fails if a test fails, or if a selection runs no test.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

from kernel_variants import junit_counts
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest brings tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def dependencies(extra: str | None = None) -> list[Requirement]:
    """hf_vanilla's requirements, as pyproject.toml declares them; with `extra`, also those of that extra and of the
    extras it names (`hf_vanilla[examples,onnx]`)."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        project = tomllib.load(file)["project"]
    found = [Requirement(text) for text in project["dependencies"]]
    pending, seen = [extra] if extra else [], set()
    while pending:
        name = pending.pop()
        seen.add(name)
        for requirement in map(Requirement, project["optional-dependencies"][name]):
            if requirement.name == project["name"]:
                pending.extend(requirement.extras - seen)
            else:
                found.append(requirement)
    return found


def lower_bound(name: str, written: str) -> str:
    """X in pyproject.toml's requirement on `name`, written as `written` shows (e.g. `torch>=X`)."""
    for requirement in dependencies():
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if requirement.name == name and len(floors) == 1:
            return floors[0]
    raise SystemExit(f"error: pyproject.toml gives {name} no lower bound: write it as {written}")


def parse_arguments(parser, argv=None):
    """(the script's own arguments, the pytest arguments after `--`)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        return parser.parse_args(argv), []
    return parser.parse_args(argv[:argv.index("--")]), argv[argv.index("--") + 1:]


def oldest_main(package: str, description: str, oldest_allowed, plan, argv=None) -> int:
    """The command line of tests/oldest_<package>.py: `--<package> VERSION` (default `oldest_allowed()`, the lower
    bound pyproject.toml declares) and pytest arguments after `--`; `plan(version)` gives the installs and the
    selections of tests that `run_in_new_environment` runs."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument(f"--{package}", metavar="VERSION", default=None,
                        help=f"the {package} version to test (default: the lower bound in pyproject.toml)")
    args, pytest_args = parse_arguments(parser, argv)
    version = getattr(args, package) or oldest_allowed()
    installs, selections = plan(version)
    return run_in_new_environment(f"{package} {version}", installs, selections, pytest_args)


def check(command: list, **kwargs) -> None:
    if subprocess.run(command, **kwargs).returncode != 0:
        raise SystemExit(f"error: {' '.join(map(str, command))} failed (its output is above)")


def run_in_new_environment(name: str, installs: list[list], selections: list[list[str]], pytest_args: list[str]) -> int:
    """Make a virtual environment, run `pip install` there with each of `installs` in turn, then pytest from the
    repository root once per selection (its arguments, then `pytest_args`). Prints the counts; returns the exit
    status: 1 if a test failed or a selection ran none."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_vanilla-environment-") as directory:
        environment = Path(directory) / "venv"
        print(f"==== {name}: a virtual environment in {environment}", flush=True)
        venv.create(environment, with_pip=True)
        python = environment / "bin" / "python"
        # As if activated, and without this process's PYTHONPATH, which could name other versions; torch's
        # compiled kernels cached in a folder of this environment's own (tests/test_compile_cache.py).
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        env |= {"VIRTUAL_ENV": str(environment), "PATH": f"{environment / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                "TORCHINDUCTOR_CACHE_DIR": str(Path(directory) / "compiled")}
        for arguments in installs:
            check([python, "-m", "pip", "install", "-q", *arguments], env=env)
        installed = time.perf_counter()

        totals, problems = {"passed": 0, "failed": 0, "skipped": 0}, []
        for number, selection in enumerate(selections):
            print(f"==== {name}: pytest {' '.join(selection)}", flush=True)
            report = Path(directory) / f"report-{number}.xml"
            command = [python, "-m", "pytest", *selection, "-q", f"--junit-xml={report}", *pytest_args]
            status = subprocess.run(command, cwd=ROOT, env=env).returncode
            counts = junit_counts(report)
            totals = {key: totals[key] + counts[key] for key in totals}
            if status in (0, 5) and not counts["passed"]:
                problems.append(f"no test ran (pytest {' '.join(selection)})")
            elif status != 0:
                problems.append(f"pytest {' '.join(selection)} exited with status {status}")
        tested = time.perf_counter()

    print(f"{name}: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped "
          f"(environment {installed - start:.0f} s, tests {tested - installed:.0f} s)")
    for problem in problems:
        print(f"error: {name}: {problem}")
    return 1 if problems else 0
