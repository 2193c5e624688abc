"""Every line of the repository speaks to a user or a maintainer of hf_vanilla: no tracker numbers (an issue number
means nothing in a clone; git's history keeps them), no word of the machines or sessions the work was done on (a
figure names its CPU, which is a fact of the figure, not of how it was made), and Python's words for Python's things
(a module or a package, not a room, a house or a floor). Read from every file git tracks, as test_docs.py reads names."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT = (".py", ".md", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".sh")

FORBIDDEN = {
    "an issue or pull-request number": r"\b(?:issues?|PR|pull request)\s*#?\d+|\(#\d+\)|\bheads of issue\b",
    "the sessions or machines the work was done on": r"\bthis (?:session|workplace)\b|/etc/xdg|\bproject's machines\b"
                                                     r"|\bbuild machines?\b",
    "a room, a house or a floor for a module or a package": r"\b(?:one|this|a|every) room\b(?! for)|\broom per\b"
                                                            r"|\bin the house\b|\bhouse's\b|\bfloor up\b",
}


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.split("\0")  # this file spells the words it looks for
            if name and (name.endswith(TEXT) or name == ".ci/run") and (ROOT / name).is_file()
            and ROOT / name != Path(__file__).resolve()]


@pytest.mark.parametrize("what", FORBIDDEN)
def test_no_line_speaks_of(what):
    pattern = re.compile(FORBIDDEN[what], re.IGNORECASE)
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
             for path in tracked_text_files()
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if pattern.search(line)]
    assert not found, f"{len(found)} lines speak of {what}:\n" + "\n".join(found)
