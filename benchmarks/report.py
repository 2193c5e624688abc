"""docs/performance.md's tables, rendered from the runs the benchmarks keep as JSON in benchmarks/results/.

    python benchmarks/report.py            # rewrite the page's rendered blocks (and --charts: its PNG charts)
    python benchmarks/report.py --check    # exit 1, naming the block, where the page differs from its results

The page's prose is written by hand; its figures are not. Each rendered block sits between
`<!-- report: NAME -->` and `<!-- /report -->` and is made here from the results alone, so a figure on the page is
the figure of a kept run, with its CPU, date, commit and command beside it, and tests/test_performance_page.py fails
where the page and the results part. The blocks:

    which-path    what to pick for each kind of work, each row's figure from the newest run that measured it
    engines       per kept encoder run (benchmarks/engines.py --json): float32 speed-ups and reduced precisions
    generation    per kept translation run (benchmarks/generation.py): every contender per case, first calls
    training      per kept training run (benchmarks/training.py --json): one optimizer step against transformers

A new run is kept by writing its JSON under benchmarks/results/ and running this script; nothing else changes.
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
BLOCK = re.compile(r"(<!-- report: (?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- /report -->)", re.S)


# ---- the kept runs ---------------------------------------------------------------------------------------------------

def runs(folder: Path) -> dict:
    """Every kept run by kind, newest first: encoder runs at the folder's top, generation/ and training/ below it."""
    def load(paths):
        kept = [(path, json.loads(path.read_text())) for path in paths]
        return sorted(kept, key=lambda item: (item[1].get("date", ""), item[0].name), reverse=True)

    return {"engines": load(folder.glob("*.json")), "generation": load((folder / "generation").glob("*.json")),
            "training": load((folder / "training").glob("*.json"))}


def heading(run: dict) -> list[str]:
    """A run's heading and first line: the CPU, then when the run was made, at which commit, and its command."""
    return [f"### {run['cpu']}", "", f"{run['date']}, at {run['commit']}: `{run['command']}`"]


def ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


# ---- encoder inference -----------------------------------------------------------------------------------------------

def best(figures: dict, engines, timing: int):
    """The fastest of `engines` in a case at one timing (0: 50 ms idle before each call, 1: back to back)."""
    measured = [(figures[e][timing], e) for e in engines if e in figures and figures[e][timing] is not None]
    return max(measured) if measured else (None, None)


def float32_table(run: dict) -> list[str]:
    engines = list(dict.fromkeys(e for figures in run["float32"].values() for e in figures))
    ours, others = [e for e in engines if e in run["ours"]], [e for e in engines if e not in run["ours"]]
    lines = ["| case | " + " | ".join(f"`{e}`" if e in ours else e for e in engines) + " | ours / best other |",
             "|---|" + "---:|" * (len(engines) + 1)]
    for case, figures in run["float32"].items():
        cells = []
        for engine in engines:
            pair = figures.get(engine, [None, None])
            marks = [best(figures, engines, t)[1] == engine for t in (0, 1)]
            cells.append(" / ".join(("**%s**" if mark else "%s") % ratio(v) for v, mark in zip(pair, marks)))
        versus = [best(figures, ours, t)[0] / best(figures, others, t)[0] for t in (0, 1)]
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {ratio(versus[0])} / {ratio(versus[1])} |")
    return lines


def precision_table(run: dict) -> list[str]:
    lines = ["| case | engine | speed-up (50 ms idle) | lowest token cosine against float32 |", "|---|---|---:|---:|"]
    points = sorted(run["precision"]["points"], key=lambda p: (list(run["float32"]).index(p["case"])
                                                               if p["case"] in run["float32"] else 99, -p["speedup"]))
    for point in points:
        engine = point["engine"]
        name = f"`{engine}`" if engine.startswith(tuple(run["ours"])) else engine
        lines.append(f"| {point['case']} | {name} | {point['speedup']:.2f} | {point['cosine']:.5f} |")
    return lines


def engines_block(kept: list) -> str:
    parts = []
    for path, run in kept:
        versions = run.get("versions") or "; ".join(line for line in run["machine"]
                                                     if line.startswith(("python", "onnxruntime")))
        *title, line = heading(run)
        parts += [*title, line + f"; {versions}.", ""]
        if (ROOT / "docs" / "images" / f"{path.stem}-speedup.png").exists():
            parts += [f"![float32 speed-up over transformers per case and engine, {run['cpu']}]"
                      f"(images/{path.stem}-speedup.png)", ""]
        parts += ["Float32 speed-up over transformers fp32 (median of paired ratios), \"50 ms idle before each call /"
                  " back to back\"; ours in code type, the fastest of each case in bold:", "", *float32_table(run), ""]
        if run.get("precision"):
            parts += ["Reduced precisions, the same run:", "", *precision_table(run), ""]
    return "\n".join(parts)


# ---- translation -----------------------------------------------------------------------------------------------------

def generation_block(kept: list) -> str:
    parts = []
    for _, run in kept:
        model = run["model"]
        *title, line = heading(run)
        parts += [*title, line + f"; {run['threads']} threads; a Marian-shaped model, "
                  f"{model['layers']} + {model['layers']} layers, E={model['width']}, {model['vocab']} words, random "
                  f"weights; {run['method']}.", ""]
        absent = [f"{name} ({c['status']}: {c['reason'].split(' (')[0]})" for name, c in run["contenders"].items()
                  if c["status"] != "ran"]
        parts += [f"Not in this run: {'; '.join(absent)}.", ""] if absent else []
        for case, record in run["cases"].items():
            parts += [f"{case}: {record['description']}, {record['new_tokens']} new tokens a row.", "",
                      "| contender | first calls, ms | steady ms | speed-up over transformers | "
                      "against CTranslate2 at its precision | tokens equal to transformers fp32 |",
                      "|---|---:|---:|---:|---:|---:|"]
            for name, figures in record["contenders"].items():
                if "steady_ms" not in figures:
                    if "failed" in figures:
                        parts.append(f"| {name} | failed: {figures['failed'].splitlines()[0]} | | | | |")
                    continue
                first = ", ".join(f"{ms:.0f}" for ms in figures["first_calls_ms"])
                tokens = "-" if figures["tokens_equal"] is None else f"{100 * figures['tokens_equal']:.1f}%"
                parts.append(f"| {name} | {first} | {figures['steady_ms']:.0f} | {ratio(figures['speedup'])} | "
                             f"{ratio(figures['vs_ctranslate2'])} | {tokens} |")
            parts.append("")
    return "\n".join(parts)


# ---- training --------------------------------------------------------------------------------------------------------

def training_block(kept: list) -> str:
    parts = []
    for _, run in kept:
        *title, line = heading(run)
        parts += [*title, line + f"; torch {run['torch']}, transformers "
                  f"{run['transformers']}, {run['threads']} threads. Median time per step, and the median of the "
                  "per-round ratios t_transformers / t_ours (interquartile range):", "",
                  "| case | precision | transformers padded | grouped | hf_vanilla | vs padded | vs grouped |",
                  "|---|---|---:|---:|---:|---|---|"]
        for case in run["cases"]:
            if "hf_vanilla" not in case:
                continue
            times = [f"{1e3 * case[k]['median_s']:.0f} ms" for k in ("padded", "grouped", "hf_vanilla")]
            versus = [f"{case[k]['median']:.2f}x ({case[k]['iqr'][0]:.2f}-{case[k]['iqr'][1]:.2f})"
                      for k in ("speedup_vs_padded", "speedup_vs_grouped")]
            parts.append(f"| {case['description']} | {case.get('precision', 'float32')} | " + " | ".join(times) +
                         " | " + " | ".join(versus) + " |")
        parts.append("")
    return "\n".join(parts)


# ---- which path ------------------------------------------------------------------------------------------------------

# What to pick for each kind of work, and the figure that backs it: (work, pick, where the figure comes from).
WHICH_PATH = [
    ("any encoder work, without reading further", '`from_pretrained(path, runtime="auto")`', ("auto", None)),
    ("short queries, one at a time (an embedding service)", '`runtime="openvino"`',
     ("float32", 'runtime="openvino"', "bert-base 1x16")),
    ("padded batches of mixed lengths", '`runtime="openvino"`, or eager hf_vanilla (padding-free)',
     ("float32", 'runtime="openvino"', "long-tailed", "lognormal")),
    ("long dense inputs (8x128, 1x512)", '`runtime="openvino"`', ("float32", 'runtime="openvino"', "1x512")),
    ("the fastest answer at a small cost in accuracy", '`runtime="auto", runtime_options={"precision": "fastest"}`',
     ("precision", 'runtime="auto" fastest', "bert-base")),
    ("translation (Marian, BART, bert2bert)", "eager hf_vanilla `generate`; `quantize_int8(model)` for int8",
     ("generation", None)),
    ("fine-tuning on padded batches", "eager hf_vanilla (no runtime): it trains on the real tokens",
     ("training", None)),
]


def short_cpu(run: dict) -> str:
    """The CPU's microarchitecture where the run names it ("Zen 4"), else its name."""
    return run["cpu"].split(",")[0].split(" (")[0].replace("AMD EPYC ", "").replace("Intel ", "")


def backing(kind: str, engine, cases, kept: dict) -> str:
    """The figure behind one row of the which-path table, from the newest kept run that has it."""
    if kind == "auto":
        for _, run in kept["engines"]:
            shares = [best(f, ['runtime="auto"'], t)[0] / best(f, [e for e in f if e != 'runtime="auto"'], t)[0]
                      for f in run["float32"].values() if 'runtime="auto"' in f for t in (0, 1)]
            if shares:
                return f"{short_cpu(run)}: {min(shares):.2f}-{max(shares):.2f} of the fastest other float32 path"
    if kind in ("float32", "precision"):
        for _, run in kept["engines"]:
            if kind == "float32":
                found = [(case, figures[engine]) for case, figures in run["float32"].items()
                         if engine in figures and any(word in case for word in cases)]
                if found:
                    case, (idle, busy) = found[0]
                    return f"{short_cpu(run)}, {case}: {idle:.2f}x / {busy:.2f}x"
            for point in (run.get("precision") or {}).get("points", []):
                if kind == "precision" and point["engine"] == engine and cases[0] in point["case"]:
                    return (f"{short_cpu(run)}, {point['case']}: {point['speedup']:.2f}x, lowest token cosine "
                            f"{point['cosine']:.5f}")
    if kind == "generation" and kept["generation"]:
        run = kept["generation"][0][1]
        shares = [record["contenders"][name].get("vs_ctranslate2") for record in run["cases"].values()
                  for name in ("hf_vanilla", "hf_vanilla int8") if name in record["contenders"]]
        shares = [share for share in shares if share is not None]
        return f"{short_cpu(run)}: {min(shares):.2f}-{max(shares):.2f} of CTranslate2 at the same precision"
    if kind == "training" and kept["training"]:
        run = kept["training"][0][1]
        gains = [case["speedup_vs_padded"]["median"] for case in run["cases"] if "speedup_vs_padded" in case]
        return f"{short_cpu(run)}: {min(gains):.2f}-{max(gains):.2f}x transformers' padded step"
    return "not measured yet"


def which_path_block(kept: dict) -> str:
    lines = ["| what you run | pick | measured (speed-up over transformers fp32, idle / back to back) |",
             "|---|---|---|"]
    for work, pick, (kind, engine, *cases) in WHICH_PATH:
        lines.append(f"| {work} | {pick} | {backing(kind, engine, cases, kept)} |")
    return "\n".join(lines) + "\n"


# ---- the page --------------------------------------------------------------------------------------------------------

def blocks(folder: Path = RESULTS) -> dict:
    kept = runs(folder)
    return {"which-path": which_path_block(kept), "engines": engines_block(kept["engines"]),
            "generation": generation_block(kept["generation"]), "training": training_block(kept["training"])}


def render(page: str, rendered: dict) -> str:
    """The page with each block's body replaced by its rendering; a block the page names but nothing renders fails."""
    def body(match):
        name = match["name"]
        if name not in rendered:
            raise SystemExit(f"{PAGE.name} has a block '{name}' that benchmarks/report.py does not render: one of "
                             f"{', '.join(rendered)}")
        return match[1] + rendered[name] + match[4]

    return BLOCK.sub(body, page)


def differences(page: str, rendered: dict) -> list[str]:
    """The blocks whose text on the page is not their rendering."""
    return [match["name"] for match in BLOCK.finditer(page) if match["body"] != rendered.get(match["name"])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where the page differs")
    parser.add_argument("--charts", action="store_true", help="also draw the encoder runs' charts (matplotlib)")
    args = parser.parse_args(argv)
    page, rendered = PAGE.read_text(), blocks()
    if args.check:
        stale = differences(page, rendered)
        print(f"{PAGE}: " + (f"out of date in {', '.join(stale)}: run python benchmarks/report.py" if stale else
                            "every rendered block matches benchmarks/results/"))
        return 1 if stale else 0
    new = PAGE.with_name(PAGE.name + ".new")
    new.write_text(render(page, rendered))
    new.replace(PAGE)  # whole or not at all
    if args.charts:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import charts

        charts.main([])
    print(f"Wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
