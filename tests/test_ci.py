"""CI runs what README documents: .ci/run's command is README's second Quickstart command, character for character,
and the torch and transformers ranges README states are the ones pyproject.toml declares and CI tests at both ends."""

import re
from pathlib import Path

from oldest_torch import oldest_allowed as oldest_torch
from oldest_transformers import oldest_allowed as oldest_transformers
from packaging.version import Version

REPOSITORY = Path(__file__).resolve().parents[1]


def readme_command(number: int) -> str:
    """The line under README's Quickstart comment `# {number}. ...`."""
    readme = (REPOSITORY / "README.md").read_text()
    return re.search(rf"^# {number}\. .*\n(.*)$", readme, flags=re.M).group(1)


def test_ci_runs_readme_test_command():
    documented = readme_command(2)
    assert documented.startswith("pip install torch==") and "python -m pytest" in documented
    assert (REPOSITORY / ".ci" / "run").read_text().rstrip().splitlines()[-1] == documented


def test_readme_states_the_oldest_transformers_pyproject_allows():
    readme = (REPOSITORY / "README.md").read_text()
    assert f"Tested with transformers {oldest_transformers()}" in readme
    assert "python tests/oldest_transformers.py" in readme_command(2)  # CI tests it


def test_readme_states_the_torch_range_ci_tests():
    """Every test runs on the torch README installs (both Quickstart commands, and the CPU-only line, name the same
    release); the torch-sensitive ones also on the lower bound pyproject.toml declares (tests/oldest_torch.py reads
    it there); README's "Tested with torch X to Y" names the two."""
    readme = (REPOSITORY / "README.md").read_text()
    newest = re.match(r"pip install torch==([\w.+]+) ", readme_command(2)).group(1)
    assert set(re.findall(r"pip install torch==([\w.+]+)", readme)) == {newest}
    assert readme_command(1).startswith(f"pip install torch=={newest} ")
    assert "python tests/oldest_torch.py" in readme_command(2)
    assert Version(oldest_torch()) < Version(newest)
    assert f"Tested with torch {oldest_torch()} to {newest}" in readme
