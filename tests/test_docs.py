"""The docs name what exists: every repository path and every dotted Python name in README.md and docs/*.md.

A path is a word starting with one of the repository's top-level folders (`hf_vanilla/runtimes/owned.py`,
`benchmarks/engines.py`, `docs/deploy.md`), or a Markdown link's target, which may also be relative to the page. A
dotted name is a code span (in backticks) whose first part is `hf_vanilla` or one of its modules
(`hf_vanilla.conversion.convert`, `flow.convert`, `conversion.flow`): it must import, and its attributes resolve.
Renaming a file or a function without its docs then fails here, with every broken name listed.
"""

import importlib
import importlib.util
import re
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


def test_the_performance_charts_show_the_tables_of_the_page(tmp_path):
    """benchmarks/charts.py draws each kept run (benchmarks/results/*.json) as PNGs, and the float32 figures it
    draws are the ones docs/performance.md's table gives for that run, engine by engine."""
    import json
    import runpy

    charts = runpy.run_path(str(REPOSITORY / "benchmarks" / "charts.py"))
    runs = sorted((REPOSITORY / "benchmarks" / "results").glob("*.json"))
    assert runs
    charts["main"](["--results", *map(str, runs), "--output", str(tmp_path)])
    page = (REPOSITORY / "docs" / "performance.md").read_text()
    names = {'runtime="onnxruntime"': '`runtime="onnxruntime"`', "onnxruntime, owned": "the same, `owned=True`",
             'runtime="openvino"': '`runtime="openvino"`', 'runtime="auto"': '`runtime="auto"`',
             "ONNX Runtime fused": "ORT fused"}  # a run's engine -> the page's column
    for run in runs:
        for chart in ("speedup", "precision"):
            assert (tmp_path / f"{run.stem}-{chart}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        section = page[page.index(f"images/{run.stem}-speedup.png"):]  # the run's table follows its chart
        header = re.search(r"^\| case \| hf_vanilla \| `runtime=\"onnxruntime\"` .*$", section, flags=re.M).group(0)
        columns = [cell.strip() for cell in header.strip("|").split("|")][1:]
        figures = json.loads(run.read_text())["float32"]
        for case, engines in figures.items():
            row = re.search(rf"^\| {re.escape(case)} \|(.*)$", section, flags=re.M).group(1)
            cells = [cell.strip().replace("*", "") for cell in row.strip("|").split("|")]
            shown = dict(zip(columns, cells))
            for engine, (idle, back) in engines.items():
                assert shown[names.get(engine, engine)] == f"{idle:.2f} / {back:.2f}", (case, engine)


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
