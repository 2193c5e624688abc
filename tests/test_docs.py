"""The docs name what exists: every repository path and every dotted Python name in README.md and docs/*.md.

A path is a word starting with one of the repository's top-level folders (`hf_vanilla/runtimes/owned.py`,
`benchmarks/engines.py`, `docs/deploy.md`), or a Markdown link's target, which may also be relative to the page. A
dotted name is a code span (in backticks) whose first part is `hf_vanilla` or one of its modules
(`hf_vanilla.conversion.convert`, `flow.convert`, `conversion.flow`): it must import, and its attributes resolve.
Renaming a file or a function without its docs then fails here, with every broken name listed.

Also: every link's `#anchor` is a heading of the page it points into; README.md keeps to 250 lines; and the code's
own text (hf_vanilla's comments and docstrings) says what and why, never how fast: a speed-up, a time or a CPU model
there would only grow old, where docs/performance.md's figures are regenerated from a benchmark's result file.
"""

import importlib
import importlib.util
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

import hf_vanilla

REPOSITORY = Path(__file__).resolve().parents[1]
DOCS = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
TOP = sorted(p.name for p in REPOSITORY.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
             and p.name not in ("build", "dist")) + [".ci"]
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(map(re.escape, TOP)))
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")


@cache
def modules() -> dict[str, list[str]]:
    """A module's last name (and its dotted tails: `conversion.flow`) -> the full names of hf_vanilla's modules."""
    package = Path(hf_vanilla.__file__).parent  # read from the files: importing every module would take seconds
    names = [".".join(("hf_vanilla", *path.relative_to(package).with_suffix("").parts)).removesuffix(".__init__")
             for path in sorted(package.rglob("*.py"))]
    short = {}
    for name in names:
        parts = name.split(".")
        for start in range(1, len(parts)):
            short.setdefault(".".join(parts[start:]), []).append(name)
    return short


def resolves(dotted: str) -> bool:
    """Whether `dotted` is an hf_vanilla module, or an attribute (of an attribute...) of one: the longest module
    prefix is imported, the rest looked up."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        candidates = [head] if head == "hf_vanilla" or head.startswith("hf_vanilla.") else modules().get(head, [])
        for module_name in candidates:
            try:
                target = importlib.import_module(module_name)
            except ImportError:
                continue
            try:
                for attribute in parts[cut:]:
                    target = getattr(target, attribute)
            except AttributeError:
                continue
            return True
    return False


def checked_name(span: str) -> str | None:
    """The dotted name a code span names, if it is one this test checks: `hf_vanilla...` or a module of it, with
    call parentheses and arguments dropped (`convert("bert", ...)` -> `convert`)."""
    name = span.split("(")[0].strip()
    if not DOTTED.match(name) or name.endswith((".py", ".md", ".json", ".txt", ".toml")):
        return None
    first = name.split(".")[0]
    if first == "hf_vanilla" or (first in modules() and not installed_elsewhere(first)):
        return name
    return None


@cache
def installed_elsewhere(name: str) -> bool:
    """Whether `name` is a package of its own (onnxruntime, openvino), which one of our modules is named after."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None and REPOSITORY not in Path(spec.origin).parents


def broken_names(text: str, page: Path, root: Path = REPOSITORY) -> list[str]:
    """The paths and dotted names `text` (the page `page`) mentions that do not exist, each once."""
    broken = []
    for path in PATH.findall(text):
        if not (root / path).exists() and path not in broken:
            broken.append(path)
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not ((page.parent / target).exists() or (root / target).exists()) and target not in broken:
            broken.append(target)
    for span in CODE.findall(text):
        name = checked_name(span)
        if name is not None and not resolves(name) and name not in broken:
            broken.append(name)
    return broken


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(REPOSITORY)) for p in DOCS])
def test_every_name_in_the_docs_exists(page):
    broken = broken_names(page.read_text(), page)
    assert not broken, f"{page.relative_to(REPOSITORY)} names what does not exist: {broken}"


def test_the_check_finds_a_broken_name(tmp_path):
    """On a page of its own: each kind of broken name is reported, and only those."""
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "there.md").write_text("")
    (tmp_path / "hf_vanilla").mkdir()
    (tmp_path / "hf_vanilla" / "masks.py").write_text("")
    text = ("See hf_vanilla/masks.py and hf_vanilla/runtimes/onnxruntime.py, [a page](there.md), "
            "[gone](missing.md), [site](https://example.org/x.md), `hf_vanilla.conversion.convert(\"bert\", ...)`, "
            "`onnxruntime.InferenceSession`, "
            "`hf_vanilla.conversion.convert_all`, `flow.to_source`, `flow.no_such_step`, "
            "`conversion.flow.convert`, `model.config.hidden_size`, `torch.compile`.")
    assert broken_names(text, page, root=tmp_path) == [
        "hf_vanilla/runtimes/onnxruntime.py", "missing.md", "hf_vanilla.conversion.convert_all",
        "flow.no_such_step"]


def test_the_performance_charts_are_drawn_from_every_kept_run(tmp_path):
    """benchmarks/charts.py draws each kept encoder run (benchmarks/results/*.json) as PNGs; the page's tables are
    the same runs rendered (tests/test_performance_page.py)."""
    import runpy

    charts = runpy.run_path(str(REPOSITORY / "benchmarks" / "charts.py"))
    runs = sorted((REPOSITORY / "benchmarks" / "results").glob("*.json"))
    assert runs
    charts["main"](["--results", *map(str, runs), "--output", str(tmp_path)])
    for run in runs:
        for chart in ("speedup", "precision"):
            assert (tmp_path / f"{run.stem}-{chart}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_kept_by_the_benchmark_is_what_the_charts_draw(tmp_path, monkeypatch):
    """`benchmarks/engines.py --json` keeps a run as benchmarks/charts.py reads it: speed-ups as its tables print them
    (median of paired per-round ratios, one per timing method), each engine under the name the page's columns use,
    the reduced precisions with their lowest token cosine; and it never writes over an existing file."""
    import json
    import runpy
    import subprocess
    import sys

    import torch

    monkeypatch.syspath_prepend(str(REPOSITORY / "benchmarks"))  # its own imports, as when run as a script
    engines = runpy.run_path(str(REPOSITORY / "benchmarks" / "engines.py"))
    Engine, Case = engines["Engine"], engines["Case"]
    torch.manual_seed(0)
    want = torch.randn(1, 4, 8)

    def engine(name, precision, idle, back, output=want, first=None):  # seconds per call under each timing method
        times = {0.05: [idle] * 3, 0: [back] * 3, engines["FIRST"]: [idle] * 2 if first is None else first}
        return Engine(name, precision, None, times=times, output=output)

    reference = engine("transformers", "fp32", 0.012, 0.010)
    int8 = engine("hf_vanilla OV int8", "int8", 0.003, 0.002, want + 0.1 * torch.randn(1, 4, 8))
    timed = [reference, engine("hf_vanilla OV", "fp32", 0.004, 0.005, first=[0.012, 0.004]),
             engine("ORT", "fp32", 0.006, 0.004), int8, engine("OV default", "bf16", 0.004, 0.004)]
    record = engines["run_record"]([(Case("short", "bert-base 1x16", "bert-base", [4]), timed, reference)],
                                   [0.05, 0], threads=2)
    assert record["float32"] == {"bert-base 1x16": {'runtime="openvino"': [3.0, 2.0], "ONNX Runtime": [2.0, 2.5]}}
    cosine = torch.nn.functional.cosine_similarity(int8.output[0].double(), want[0].double(), dim=-1).min().item()
    assert record["precision"]["points"] == [
        {"case": "bert-base 1x16", "engine": 'runtime="openvino" int8', "speedup": 4.0, "cosine": round(cosine, 5)},
        {"case": "bert-base 1x16", "engine": "OpenVINO default (bf16)", "speedup": 3.0, "cosine": 1.0}]
    assert 'runtime="auto"' in record["ours"] and "ONNX Runtime" not in record["ours"]
    first = record["first_requests"]  # a case's first calls after two: their speed-up, their cost over steady calls
    assert first["speedup"]["bert-base 1x16"]['runtime="openvino"'] == 1.5
    assert first["over_steady"]["bert-base 1x16"]['runtime="openvino"'] == 2.0
    assert first["over_steady"]["bert-base 1x16"]['runtime="openvino" int8'] == 1.0
    kept = tmp_path / "run.json"
    kept.write_text(json.dumps(record))
    charts = runpy.run_path(str(REPOSITORY / "benchmarks" / "charts.py"))
    charts["main"](["--results", str(kept), "--output", str(tmp_path)])
    assert (tmp_path / "run-speedup.png").exists() and (tmp_path / "run-precision.png").exists()
    refused = subprocess.run([sys.executable, str(REPOSITORY / "benchmarks" / "engines.py"), "--json", str(kept)],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "exists: name a new file" in refused.stderr
    assert json.loads(kept.read_text()) == record


# ---- anchors, lengths ------------------------------------------------------------------------------------------------

ANCHORED = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")  # [text](page.md#heading) or [text](#heading)
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)
README_LINES = 250


def slugs(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, links reduced to their text, every character but
    letters, digits, `_`, `-` and spaces dropped, spaces made hyphens; a repeated heading's with -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def broken_anchors(text: str, page: Path, root: Path = REPOSITORY) -> list[str]:
    """The `page.md#anchor` (and `#anchor`) links of `text` whose page has no heading of that anchor."""
    broken = []
    for target, anchor in ANCHORED.findall(FENCE.sub("", text)):
        if "://" in target or (target and not target.endswith(".md")):
            continue
        linked = page if not target else next(
            (path for path in (page.parent / target, root / target) if path.is_file()), None)
        if linked is not None and anchor not in slugs(text if not target else linked.read_text()):
            broken.append(f"{target}#{anchor}")
    return broken


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(REPOSITORY)) for p in DOCS])
def test_every_anchor_in_the_docs_is_a_heading(page):
    broken = broken_anchors(page.read_text(), page)
    assert not broken, f"{page.relative_to(REPOSITORY)} links to headings that do not exist: {broken}"


def test_the_anchor_check_finds_a_missing_heading(tmp_path):
    (tmp_path / "there.md").write_text("# There\n\n## Which path to pick\n\n## `runtime=\"auto\"`: how\n\n"
                                       "## Notes\n\n## Notes\n")
    page = tmp_path / "page.md"
    text = ("## Here\n\n[a](there.md#which-path-to-pick) [b](there.md#runtimeauto-how) [c](there.md#notes-1) "
            "[d](#here) [e](there.md#gone) [f](#nowhere) [g](https://example.org/x.md#y)\n```\n[h](#in-code)\n```\n")
    assert broken_anchors(text, page, root=tmp_path) == ["there.md#gone", "#nowhere"]


def test_the_readme_is_short():
    lines = len((REPOSITORY / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines, at most {README_LINES}: move detail into docs/"


def test_the_auto_module_docstring_is_short():
    """runtime="auto"'s module docstring says what it does and why; each step's reasons are docs/deploy.md's."""
    import ast

    docstring = ast.get_docstring(ast.parse((REPOSITORY / "hf_vanilla/runtimes/auto.py").read_text()), clean=False)
    assert len(docstring.splitlines()) <= 30


# ---- figures in the code's own text ----------------------------------------------------------------------------------

# A speed-up: a number glued to "x" and followed by neither a word character nor another number ("2.3x", "1.6-2.8x",
# "3.1x faster", "5x and 3x"; not a shape "8x128" or "1x16", not hex "0x1f", not "384 x 384"), or a percentage that
# is faster, slower or sooner. A time: a number and a unit ("12.3 ms", "6 us", "10-30 s", "0.2 seconds"). A CPU model:
# the names a measurement is quoted for; instruction sets (AVX2, AVX-512, AMX, VNNI) and vendors (AMD, Intel), which
# the code decides on, are not figures.
NUMBER = r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?"
FIGURES = {
    "a speed-up": re.compile(rf"{NUMBER}x(?![\w.]|\.\d)|{NUMBER}\s?%\s(?:faster|slower|sooner|quicker)\b"),
    "a time": re.compile(rf"{NUMBER}\s?(?:ms|µs|μs|us|ns|s|milliseconds|microseconds|seconds)\b(?!-)"),
    "a CPU model": re.compile(r"\bZen\s?\d|\b(?:EPYC|Xeon|Ryzen|Genoa|Turin|Milan|Skylake)\b"
                              r"|\b(?:Sapphire|Granite|Emerald) Rapids\b|\b(?:Ice|Cascade|Cooper) Lake\b"),
}


def prose(source: str):
    """(line number, line) of the comments and docstrings of Python `source`: every comment, and every string
    that begins a statement (module, class and function docstrings, and strings standing alone)."""
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and previous in (
                tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type


def figures(source: str, name: str) -> list[str]:
    """`name:line: what 'figure'` for every speed-up, time and CPU model in `source`'s comments and docstrings."""
    found = []
    for number, line in prose(source):
        for what, pattern in FIGURES.items():
            found += [f"{name}:{number}: {what} {match.group(0)!r}" for match in pattern.finditer(line)]
    return found


def test_the_code_states_no_speed_figures():
    """Docstrings and comments say what the code does and why; a speed-up, a time or a CPU model goes to
    docs/performance.md, rendered from a benchmark's result file, where it can be regenerated."""
    package = REPOSITORY / "hf_vanilla"
    found = [figure for path in sorted(package.rglob("*.py"))
             for figure in figures(path.read_text(), str(path.relative_to(REPOSITORY)))]
    assert not found, "say why, not how fast (the figures belong in docs/performance.md):\n" + "\n".join(found)


def test_the_figure_check_finds_figures_and_only_those():
    source = '''\
"""Runs MiniLM 1.6-2.8x faster at 8-16 rows on AMD Zen 4.

Where AVX-512 VNNI or AMX multiply bf16, a (B, T) = 8x128 batch, a 384 x 384 weight, hex 0x1f, x86-64 and int8.
"""
LIMIT = 0.05  # seconds: 11.5 of 12.3 ms in `FullyConnected` on an EPYC
SHAPE = "1x16"  # a 3.1x speed-up, 15% sooner; 1e-5 of the magnitude, 10-30 s, 6 us on Sapphire Rapids
message = f"took {LIMIT} s, 2x"  # not prose: a value the code prints


def f(x):
    """Version 2.5.1x is not one, nor 2x2, 0.5e-6, 2 seconds-long or 3 sentences; 4x is."""
    return 0x1f * x
'''
    assert figures(source, "m.py") == [
        "m.py:1: a speed-up '1.6-2.8x'", "m.py:1: a CPU model 'Zen 4'", "m.py:5: a time '12.3 ms'",
        "m.py:5: a CPU model 'EPYC'", "m.py:6: a speed-up '3.1x'", "m.py:6: a speed-up '15% sooner'",
        "m.py:6: a time '10-30 s'", "m.py:6: a time '6 us'", "m.py:6: a CPU model 'Sapphire Rapids'",
        "m.py:11: a speed-up '4x'"]
