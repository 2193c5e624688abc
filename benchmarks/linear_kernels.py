#!/usr/bin/env python
"""One float32 product, two kernels: MKL's sgemm (what `F.linear` calls on x86 builds of torch) against oneDNN's
matmul (what `VanillaLinear` calls for CPU inference on large weights), on the same dense weight.

    python benchmarks/linear_kernels.py              # the table of docs/performance.md, about 20 s
    python benchmarks/linear_kernels.py --sweep      # every model weight shape x rows 1..1024, hot and cold (~2 min)
    python benchmarks/linear_kernels.py --threads 1

The shapes are the model's: bert-base's projections and feed-forward, the 30522-word output layer at two widths,
MiniLM's 384 x 384, and a 32-wide toy. The default table times each kernel alone, median of repeated calls on one
weight (so it stays in cache where it fits: the small weights look better there than inside a model, whose other
weights evict them).

`--sweep` is what a kernel rule must be judged on: the two kernels alternate call by call (paired: the ratio of
each pair, then the median, so a busy moment on a shared machine hits both), once on one weight ("hot") and once
rotating through enough distinct weights of the shape to exceed the last-level cache ("cold", as in a model, where
the other layers' weights pass through the cache between two calls of the same layer).
"""

import argparse
import statistics
import time
from functools import partial

import torch
from torch.nn import functional as F

from _cli import at_least

SHAPES = [  # (out_features, in_features, rows)
    (3072, 768, 8), (768, 3072, 16), (30522, 768, 8), (30522, 256, 8), (3072, 768, 1024), (384, 384, 16), (32, 32, 8),
]
SWEEP_WEIGHTS = [  # (out_features, in_features): every projection shape of MiniLM, bert-base, the small seq2seq, Marian
    (32, 32), (256, 256), (384, 384), (1536, 384), (384, 1536), (512, 512), (2048, 512), (768, 768), (3072, 768),
    (768, 3072), (30522, 768), (58101, 512),
]
SWEEP_ROWS = [1, 8, 16, 64, 256, 1024]
COLD_BYTES = 256 * 2**20  # distinct weights per shape in the cold sweep: far above any server's last-level cache


def median_seconds(run, calls):
    for _ in range(5):
        run()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernels(x, weight, bias):
    return (partial(F.linear, x, weight, bias),
            partial(torch.ops.mkldnn._linear_pointwise, x, weight, bias, "none", [], ""))


def table():
    print("| weight (out x in) | rows | MKL `F.linear` | oneDNN | ratio | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for out_features, in_features, rows in SHAPES:
        weight = torch.randn(out_features, in_features) * 0.02
        bias, x = torch.randn(out_features) * 0.02, torch.randn(rows, in_features)
        calls = 20 if out_features * in_features * rows > 1e8 else 200
        run_mkl, run_onednn = kernels(x, weight, bias)
        mkl, onednn = median_seconds(run_mkl, calls), median_seconds(run_onednn, calls)
        diff = (run_mkl() - run_onednn()).abs().max().item()
        print(f"| {out_features} x {in_features} | {rows} | {mkl * 1e3:.3f} ms | {onednn * 1e3:.3f} ms | "
              f"{mkl / onednn:.2f}x | {diff:.1e} |")


def paired_ratio(out_features, in_features, rows, copies, budget_s=0.4, max_pairs=400):
    """Median over alternating calls of t_MKL / t_oneDNN, and MKL's median time; `copies` distinct weights are
    used in turn."""
    weights = [torch.randn(out_features, in_features) * 0.02 for _ in range(copies)]
    bias, x = torch.randn(out_features) * 0.02, torch.randn(rows, in_features)
    pairs = [kernels(x, w, bias) for w in weights]
    for mkl, onednn in pairs[:2]:
        mkl(), onednn()
    ratios, mkl_times, start, i = [], [], time.perf_counter(), 0
    while i < 6 or (time.perf_counter() - start < budget_s and i < max_pairs):
        mkl, onednn = pairs[i % copies]
        order = (mkl, onednn) if i % 2 == 0 else (onednn, mkl)
        times = {}
        for run in order:
            t0 = time.perf_counter()
            run()
            times[run] = time.perf_counter() - t0
        ratios.append(times[mkl] / times[onednn])
        mkl_times.append(times[mkl])
        i += 1
    return statistics.median(ratios), statistics.median(mkl_times)


def sweep():
    print("t_MKL / t_oneDNN, median of paired calls (above 1: oneDNN faster); MKL's time in brackets.\n")
    print("| weight (out x in) | weights | " + " | ".join(f"{r} rows hot / cold" for r in SWEEP_ROWS) + " |")
    print("|---|---:|" + "---:|" * len(SWEEP_ROWS))
    for out_features, in_features in SWEEP_WEIGHTS:
        copies = max(1, min(64, COLD_BYTES // (4 * out_features * in_features)))
        cells = []
        for rows in SWEEP_ROWS:
            hot, hot_ms = paired_ratio(out_features, in_features, rows, 1)
            cold, _ = paired_ratio(out_features, in_features, rows, copies)
            cells.append(f"{hot:.2f} / {cold:.2f} ({hot_ms * 1e3:.2f} ms)")
        print(f"| {out_features} x {in_features} | {out_features * in_features:,} | {' | '.join(cells)} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=at_least(1), default=None,
                        help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--sweep", action="store_true", help="every model shape x rows, paired, hot and cold")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}\n")
    torch.manual_seed(0)
    with torch.inference_mode():
        sweep() if args.sweep else table()


if __name__ == "__main__":
    main()
