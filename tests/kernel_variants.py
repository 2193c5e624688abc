"""Run the tests marked `numerics` again under other kernel choices: one pytest process per variant.

Two computations that should agree (our model and transformers', a prefix and the full target, the packed and the
padded path) round differently, and how much depends on the kernels: their vector width, cache blocking, thread
count and library. A tolerance that holds only for the summation order of one CPU passes here and fails on another
machine (an Intel Xeon once gave 1.1e-6 against a 1e-6 bound that held on AMD). So this script changes the order on
the machine at hand, through the variables torch, MKL and oneDNN read when they load, and checks every comparison
again at the one rule of tests/numerics.py:

    python tests/kernel_variants.py                   # every variant below; exit status 1 if any fails
    python tests/kernel_variants.py avx2 one-thread   # some of them
    python tests/kernel_variants.py MKL_ENABLE_INSTRUCTIONS=AVX512,ATEN_CPU_CAPABILITY=avx2   # an ad hoc one
    python tests/kernel_variants.py unchanged -- -k seq2seq    # the environment as it is; pytest arguments after --

A variant that selects no test fails, as one with a failing test does. Each prints the smallest margin it saw:
the largest |diff| / tolerance of any `assert_close` (HF_VANILLA_MARGIN_LOG in tests/numerics.py), and the tests
closest to their limit.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (what it emulates, environment). Each variable is read once, when its library loads: hence one process each.
VARIANTS = {
    "avx2": ("256-bit kernels, as on an AVX2-only CPU (AMD Zen 3): ATen's own (softmax, LayerNorm, attention), "
             "oneDNN's matmul, and MKL's (which honours the cap on Intel CPUs only)",
             {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    "mkl": ("no oneDNN (tests/conftest.py): every float32 product through MKL, on its conditional-reproducibility "
            "'compatible' path, which sums in another order than MKL's default kernels on any CPU",
            {"HF_VANILLA_ONEDNN": "0", "MKL_CBWR": "COMPATIBLE"}),
    "onednn": ("every eligible float32 product on oneDNN's matmul, without measuring (HF_VANILLA_LINEAR_KERNEL, "
               "hf_vanilla/kernels.py): the other kernel the default policy may pick, on every shape it may pick it for",
               {"HF_VANILLA_LINEAR_KERNEL": "onednn"}),
    "one-thread": ("one thread: no product or reduction split between cores",
                   {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}),
}
UNCHANGED = "unchanged"  # not run by default: the main test run already is this one; named to compare margins


def parse_variant(spec: str) -> tuple[str, dict]:
    if spec == UNCHANGED:
        return "the environment as it is", {}
    if spec in VARIANTS:
        return VARIANTS[spec]
    if "=" not in spec:
        raise SystemExit(f"unknown variant {spec!r}: name one of {', '.join(VARIANTS)}, {UNCHANGED}, "
                         "or give variables as NAME=VALUE[,NAME=VALUE]")
    return "ad hoc", dict(item.split("=", 1) for item in spec.split(","))


def run(name: str, env_changes: dict, pytest_args: list[str]) -> dict:
    """One pytest process over the `numerics` tests; returns its counts, wall time and margins."""
    with tempfile.TemporaryDirectory() as directory:
        report, margins = Path(directory) / "report.xml", Path(directory) / "margins.jsonl"
        # Each variant compiles into a cache of its own: torch keys a cached CPU graph without the capability its
        # kernels were generated for (tests/test_compile_cache.py).
        env = {**os.environ, **env_changes, "HF_VANILLA_MARGIN_LOG": str(margins), "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "TORCHINDUCTOR_CACHE_DIR": str(Path(directory) / "compiled")}
        # `follows`: the conformance battery's engine and change rows, on kernels these variables do not choose: run once.
        command = [sys.executable, "-m", "pytest", "-m", "numerics and not follows", "-q", f"--junit-xml={report}",
                   *pytest_args]
        start = time.perf_counter()
        status = subprocess.run(command, cwd=ROOT, env=env).returncode
        seconds = time.perf_counter() - start
        counts = junit_counts(report)
        worst = defaultdict(float)  # test -> largest |diff| / tolerance it saw
        if margins.exists():
            for line in margins.read_text().splitlines():
                entry = json.loads(line)
                worst[entry["test"]] = max(worst[entry["test"]], entry["ratio"])
    return {"name": name, "status": status, **counts, "seconds": seconds, "worst": dict(worst)}


def junit_counts(report: Path) -> dict:
    """{"passed", "failed", "skipped"} from a pytest --junit-xml report; all 0 when pytest wrote none."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if report.exists():
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in counts}
    failed = counts["failures"] + counts["errors"]
    return {"passed": counts["tests"] - failed - counts["skipped"], "failed": failed, "skipped": counts["skipped"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", default=list(VARIANTS),
                        help=f"variant names ({', '.join(VARIANTS)}, {UNCHANGED}) or NAME=VALUE[,NAME=VALUE]")
    parser.add_argument("--closest", type=int, default=3, metavar="N",
                        help="list the N tests closest to their tolerance in each variant (default 3)")
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    results = []
    for spec in args.variants:
        what, env_changes = parse_variant(spec)
        settings = " ".join(f"{key}={value}" for key, value in env_changes.items()) or "(no change)"
        print(f"\n==== kernel variant {spec}: {what}\n     {settings}", flush=True)
        results.append(run(spec, env_changes, pytest_args))

    print("\nvariant          passed  failed  skipped  wall s  largest |diff| / tolerance")
    ok = True
    for result in results:
        worst = max(result["worst"].values(), default=float("nan"))
        problem = ""
        if result["status"] == 5 or result["passed"] == 0:
            problem = "  RAN NO TEST"  # a variant that checks nothing must not pass silently
        elif result["status"] != 0 or result["failed"]:
            problem = f"  FAILED (pytest exit status {result['status']})"
        ok = ok and not problem
        print(f"{result['name']:<16} {result['passed']:>6}  {result['failed']:>6}  {result['skipped']:>7}  "
              f"{result['seconds']:>6.0f}  {worst:.3f}{problem}")
        for test, ratio in sorted(result["worst"].items(), key=lambda item: -item[1])[:args.closest]:
            print(f"{'':<18}{ratio:.3f}  {test}")
    total = {key: sum(result[key] for result in results) for key in ("passed", "failed", "skipped")}
    print(f"variants: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
