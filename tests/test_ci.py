"""CI runs what README documents: .ci/run's command is README's second Quickstart command, character for character,
and the transformers range README states is the one pyproject.toml declares."""

import re
from pathlib import Path

from oldest_transformers import oldest_allowed

REPOSITORY = Path(__file__).resolve().parents[1]


def test_ci_runs_readme_test_command():
    readme = (REPOSITORY / "README.md").read_text()
    documented = re.search(r"^# 2\. .*\n(.*)$", readme, flags=re.M).group(1)
    assert documented.startswith("pip install torch==") and "python -m pytest" in documented
    assert (REPOSITORY / ".ci" / "run").read_text().rstrip().splitlines()[-1] == documented


def test_readme_states_the_oldest_transformers_pyproject_allows():
    readme = (REPOSITORY / "README.md").read_text()
    assert f"Tested with transformers {oldest_allowed()}" in readme
