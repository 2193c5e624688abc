"""The charts of docs/performance.md and README.md, drawn from a run of benchmarks/engines.py kept as JSON.

    python benchmarks/charts.py                                   # benchmarks/results/*.json -> docs/images/
    python benchmarks/charts.py --results RUN.json --output DIR

A run's file (benchmarks/results/<cpu>-<date>.json) holds what engines.py printed for it: the CPU, date, commit
and command; `float32`, case -> engine -> [speed-up over transformers fp32 with 50 ms idle before each call, back
to back], on steady calls; `ours`, which of those engines are hf_vanilla's; `precision.points`, each a reduced
precision's speed-up and its lowest per-token cosine against float32; and, in runs that timed them,
`first_requests` (a case's first calls after two: their speed-up and their cost over steady calls, per engine),
which the charts do not draw. Two charts per run:

    <stem>-speedup.png     float32 speed-up over transformers per case and engine (idle gap; ours in colour)
    <stem>-precision.png   speed-up against accuracy (1 - lowest cosine, log scale) of the reduced precisions

Needs matplotlib (the examples extra). Reads the JSON, writes the PNGs, nothing else.
"""

import argparse
import json
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # finds _cli.py also when a test loads this file by path
from _cli import existing  # noqa: E402


def speedup_chart(run: dict, path: Path) -> None:
    """Horizontal bars: one group per case, one bar per engine, the idle-gap figure, transformers fp32 at 1."""
    import matplotlib.pyplot as plt

    cases = list(run["float32"])
    engines = list(dict.fromkeys(engine for case in cases for engine in run["float32"][case]))
    ours = [e for e in engines if e in run["ours"]]
    others = [e for e in engines if e not in ours]
    colours = dict(zip(ours, plt.cm.Blues(np.linspace(0.4, 0.95, len(ours)))))
    colours |= dict(zip(others, plt.cm.Greys(np.linspace(0.3, 0.8, len(others)))))
    height = 0.8 / len(engines)
    figure, axes = plt.subplots(figsize=(9, 0.13 * len(cases) * len(engines) + 1.5))
    for row, case in enumerate(cases):
        for column, engine in enumerate(engines):
            value = run["float32"][case].get(engine, [None])[0]
            if value is None:
                continue
            y = row + (column - (len(engines) - 1) / 2) * height
            axes.barh(y, value, height, color=colours[engine], label=engine)
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_yticks(range(len(cases)), cases)
    axes.invert_yaxis()
    axes.set_xlabel("speed-up over transformers fp32 (median of paired ratios, 50 ms idle before each call)")
    axes.set_title(f"float32, {run['cpu']}\n" + textwrap.fill(f"{run['date']} at {run['commit']}: {run['command']}", 75),
                   fontsize=9)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def precision_chart(run: dict, path: Path) -> None:
    """One point per reduced precision and case: speed-up against 1 - lowest cosine (lower is more accurate)."""
    import matplotlib.pyplot as plt

    points = run["precision"]["points"]
    cases = list(dict.fromkeys(point["case"] for point in points))
    markers = dict(zip(cases, "osD^v"))
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for point in points:
        ours = point["engine"].startswith(tuple(run["ours"]))
        axes.scatter(1 - point["cosine"], point["speedup"], marker=markers[point["case"]], s=60,
                     color="tab:blue" if ours else "grey", label=point["case"])
        axes.annotate(point["engine"], (1 - point["cosine"], point["speedup"]), textcoords="offset points",
                      xytext=(6, 4), fontsize=7)
    axes.set_xscale("log")
    axes.set_xlabel("1 - lowest per-token cosine against float32 (log; left is more accurate)")
    axes.set_ylabel("speed-up over transformers fp32")
    axes.set_title(f"reduced precisions (blue: ours), {run['cpu']}\n{run['date']} at {run['precision']['commit']}",
                   fontsize=9)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="*", type=existing("file"),
                        default=sorted((ROOT / "benchmarks" / "results").glob("*.json")),
                        help="runs kept as JSON (default: benchmarks/results/*.json)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "images", help="folder for the PNGs")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    args.output.mkdir(parents=True, exist_ok=True)
    for results in args.results:
        run = json.loads(results.read_text())
        speedup_chart(run, args.output / f"{results.stem}-speedup.png")
        if run.get("precision"):
            precision_chart(run, args.output / f"{results.stem}-precision.png")
        print(f"Wrote {args.output / results.stem}-*.png")


if __name__ == "__main__":
    main()
