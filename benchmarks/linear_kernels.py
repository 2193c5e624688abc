#!/usr/bin/env python
"""One float32 product, two kernels: MKL's sgemm (what `F.linear` calls on x86 builds of torch) against oneDNN's
matmul (what `VanillaLinear` calls for CPU inference on large weights), on the same dense weight.

    python benchmarks/linear_kernels.py              # about 20 s
    python benchmarks/linear_kernels.py --threads 1

The shapes are the model's: bert-base's projections and feed-forward, the 30522-word output layer at two widths,
MiniLM's 384 x 384, and a 32-wide toy. Each time is the median of repeated calls on one weight (so it stays in cache
where it fits: the small weights look better here than inside a model, whose other weights evict them).
"""

import argparse
import statistics
import time
from functools import partial

import torch
from torch.nn import functional as F

SHAPES = [  # (out_features, in_features, rows)
    (3072, 768, 8), (768, 3072, 16), (30522, 768, 8), (30522, 256, 8), (3072, 768, 1024), (384, 384, 16), (32, 32, 8),
]


def median_seconds(run, calls):
    for _ in range(5):
        run()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| weight (out x in) | rows | MKL `F.linear` | oneDNN | ratio | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for out_features, in_features, rows in SHAPES:
            weight = torch.randn(out_features, in_features) * 0.02
            bias, x = torch.randn(out_features) * 0.02, torch.randn(rows, in_features)
            calls = 20 if out_features * in_features * rows > 1e8 else 200
            run_mkl = partial(F.linear, x, weight, bias)
            run_onednn = partial(torch.ops.mkldnn._linear_pointwise, x, weight, bias, "none", [], "")
            mkl, onednn = median_seconds(run_mkl, calls), median_seconds(run_onednn, calls)
            diff = (run_mkl() - run_onednn()).abs().max().item()
            print(f"| {out_features} x {in_features} | {rows} | {mkl * 1e3:.3f} ms | {onednn * 1e3:.3f} ms | "
                  f"{mkl / onednn:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
