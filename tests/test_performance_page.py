"""docs/performance.md's figures are its kept runs' (benchmarks/results/): the page's rendered blocks are exactly what
benchmarks/report.py makes of the results, a figure changed in a results file fails the check, and the prose around
them carries no figure of a run (commit hashes, history) that could drift from it."""

import json
import re
import runpy
import shutil
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
REPORT = runpy.run_path(str(REPOSITORY / "benchmarks" / "report.py"))
PAGE = REPOSITORY / "docs" / "performance.md"


def test_the_page_is_its_results_rendered():
    page = PAGE.read_text()
    rendered = REPORT["blocks"]()
    assert REPORT["differences"](page, rendered) == [], "run python benchmarks/report.py"
    assert {match["name"] for match in REPORT["BLOCK"].finditer(page)} == set(rendered), "every block on the page"
    assert len(page.splitlines()) <= 250


def test_a_figure_changed_in_a_results_file_fails_the_check(tmp_path):
    """Copy the results, change one float32 figure of the newest encoder run: its block renders the new figure, and
    the page no longer matches."""
    results = tmp_path / "results"
    shutil.copytree(REPOSITORY / "benchmarks" / "results", results)
    newest, run = REPORT["runs"](results)["engines"][0]
    case, figures = next(iter(run["float32"].items()))
    engine = next(iter(figures))
    figures[engine] = [figures[engine][0] + 0.37, figures[engine][1]]
    newest = results / newest.name
    newest.write_text(json.dumps(run))
    rendered = REPORT["blocks"](results)
    assert f"{figures[engine][0]:.2f}" in rendered["engines"]
    assert "engines" in REPORT["differences"](PAGE.read_text(), rendered)


def test_the_prose_holds_no_commit_or_date():
    """Outside the rendered blocks the page is prose: a commit hash or a date there is a figure of some run."""
    prose = REPORT["BLOCK"].sub("", PAGE.read_text())
    assert not re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", prose)
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", prose)
