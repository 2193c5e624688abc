#!/usr/bin/env python
"""Padded batches on a GPU: hf_vanilla against transformers' BERT on the same bert-base weights, bf16 and fp32, with
the matrix-product throughput each side achieves.

    python benchmarks/gpu.py                  # every case, bf16 and fp32 (a few minutes on one H100)
    python benchmarks/gpu.py --quick          # fewer rounds: a smoke run (tests/test_gpu.py runs this)
    python benchmarks/gpu.py --dtypes bf16 --batch 128

Method: benchmarks/benchmark.py's (same models, same batches, interleaved paired rounds, median speed-up with its
interquartile range, an A/A row for the noise), on `cuda:0`, with TF32 off so that fp32 means fp32. Cases: a dense
batch (no padding: the limit is 1.0x, so this row shows the cost of the fast path's bookkeeping), lengths uniform in
16..256 (about 55% real tokens) and lognormal lengths (median 28, up to 512: about 15% real, a retrieval corpus).

TFLOP/s counts the matrix products of the forward pass, 2 FLOPs per multiply-add: per layer and token the four
attention projections and the feed-forward, 2 (4 E^2 + 2 E F); per layer and sequence of L tokens the scores and the
weighted sum, 4 L^2 E. "useful" counts real tokens only (the work any model must do); BERT also executes the padded
positions ("executed"), which ours skips. A side that computes padding can show high executed TFLOP/s and still be
slower: compare times, and read useful TFLOP/s against the GPU's dense peak (H100 SXM: 989 bf16, 67 fp32 without
TF32, per NVIDIA's datasheet).

Every timed output is checked against BERT at real tokens by tests/numerics.py's rule (fp32 1e-5, bf16 5e-2, times
max(1, |BERT's output|)); the script exits with status 1 if a check fails, and 0 with a message where no GPU is visible.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import (  # noqa: E402  (the CPU benchmark's timing, models and batches, reused as they are)
    DTYPES,
    bert_base,
    encoder_batch,
    environment,
    long_tailed_lengths,
    quartiles,
    time_pair,
    uniform_lengths,
)

from hf_vanilla.conversion.parity import tolerance  # noqa: E402

from _cli import at_least  # noqa: E402


def cases(batch):
    return {
        "dense": [128] * batch,
        "uniform": uniform_lengths(batch, 16, 256, seed=9),
        "long-tail": long_tailed_lengths(batch, 28, 2.2, 512, seed=29),
    }


def forward_flops(config, lengths) -> int:
    """Matrix-product FLOPs of one encoder forward over sequences of these lengths (see the module docstring)."""
    E, F, N = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    return sum(2 * N * (L * (4 * E * E + 2 * E * F) + 2 * L * L * E) for L in lengths)


def run_case(name, lengths, dtype_name, models, device, settings):
    reference, ours = models
    input_ids, attention_mask = encoder_batch(lengths, reference.config.vocab_size, device)

    def call(model):
        def run():
            with torch.inference_mode():
                return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return run

    timing, outputs = time_pair(call(reference), call(ours), device, settings.warmup, settings.min_rounds,
                                settings.budget_s)
    real = attention_mask.bool()
    expected, actual = outputs["reference"][real].float(), outputs["ours"][real].float()
    diff, allowed = (actual - expected).abs().max().item(), tolerance(expected, DTYPES[dtype_name])
    t_ref, t_ours = statistics.median(timing.reference), statistics.median(timing.ours)
    useful = forward_flops(reference.config, lengths)
    executed = forward_flops(reference.config, [input_ids.shape[1]] * len(lengths))
    low, mid, high = quartiles(timing.ratios())
    aa = "{1:.2f} [{0:.2f}-{2:.2f}]".format(*quartiles(timing.aa_ratios())) if len(timing.reference) > 1 else "n/a"
    real_tokens, padded = int(attention_mask.sum()), attention_mask.numel()
    print(f"| {name} | {dtype_name} | {len(lengths)} x {input_ids.shape[1]}, {100 * real_tokens / padded:.0f}% real "
          f"| {padded / real_tokens:.2f}x | {1e3 * t_ref:.2f} ms | {1e3 * t_ours:.2f} ms | **{mid:.2f}x** "
          f"[{low:.2f}-{high:.2f}] | {useful / t_ref / 1e12:.3g} / {executed / t_ref / 1e12:.3g} | "
          f"{useful / t_ours / 1e12:.3g} | {aa} | {len(timing.ours)} | max diff {diff:.1e} (allowed {allowed:.1e}) |",
          flush=True)
    return diff <= allowed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated, from: bf16, fp32")
    parser.add_argument("--batch", type=at_least(1), default=64, help="rows per batch")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run")
    parser.add_argument("--device", default="cuda:0", help="cuda:0; cpu runs the same code, to check it without a GPU")
    args = parser.parse_args(argv)
    unknown = set(args.dtypes.split(",")) - set(DTYPES)
    if unknown:
        parser.error(f"unknown dtypes {sorted(unknown)}; choose from {sorted(DTYPES)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: skipped: needs a CUDA device, and torch.cuda.is_available() is False here")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    settings = argparse.Namespace(warmup=3, min_rounds=3 if args.quick else 10, budget_s=1.0 if args.quick else 10.0)
    print("\n".join(environment(device)) + "\n")
    print("| case | dtype | batch | padding-free limit | BERT | ours | ours/BERT [IQR] | BERT TFLOP/s useful / "
          "executed | ours TFLOP/s useful | A/A [IQR] | rounds | check |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    ok = True
    for dtype_name in args.dtypes.split(","):
        models = bert_base(DTYPES[dtype_name], device)
        for name, lengths in cases(args.batch).items():
            ok &= run_case(name, lengths, dtype_name, models, device, settings)
        del models
        torch.cuda.empty_cache()
    if not ok:
        print("CHECK FAILED: an output differs from BERT's by more than tests/numerics.py allows")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
