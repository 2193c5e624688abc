"""What the two engines of examples/embed_corpus.py share, so that they write one folder from one plan: reading the
corpus, the model's pooling settings and one batch's embeddings (`Embedder`), the plan (sentences sorted by token
count, cut into shards), and the output folder (its lock, the manifest that keys a resume, atomic shard files, the
index). An engine only decides who embeds which pending shard and who writes it: every process of a torchrun
launch its own share (embed_corpus.py), or a Ray actor pool with the driver writing (_embed_ray.py). The plan does
not depend on the engine or the number of processes, so `load_embeddings` reads either engine's folder the same way.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from transformers import AutoModel, AutoTokenizer

from _common import ExampleError

# sentence-transformers' pooling flags in 1_Pooling/config.json, by the mode each turns on
POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "max": "pooling_mode_max_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens"}
POOLING_MODES = tuple(POOLING_FLAGS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TABLES = {".parquet": "Parquet", ".jsonl": "JSON lines", ".ndjson": "JSON lines"}  # --input read as a table
KILL_AFTER_SHARDS = "EMBED_CORPUS_KILL_AFTER_SHARDS"  # the testing hook: see embed_corpus.py's docstring


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The sentences to embed and their 0-based line numbers (a table's row numbers) in the input, the number of
    lines, a description of the source, and the sha256 of its content (the file's bytes, or the column's values)."""
    sentences: list[str]
    line_numbers: list[int]
    num_lines: int
    source: str
    sha256: str


def read_corpus(args) -> Corpus:
    """The corpus `args` names: a text file (one sentence per line), a column of a Parquet or JSON lines file, or of a
    `datasets` dataset. Blank lines (empty or null values) are skipped."""
    if args.dataset:
        lines, source, data = read_dataset(args.dataset, args.dataset_config, args.split, args.column or "text")
    else:
        path = Path(args.input)
        if not path.is_file():
            raise ExampleError(f"--input {path}: no such file; pass a UTF-8 text file, one sentence per line (or a "
                               f"Parquet or JSON lines file with --column)")
        if path.suffix.lower() in TABLES:
            lines, data = read_column(path, args.column or "text")
            source = f"{path.resolve()}:{args.column or 'text'}"
        elif args.column:
            raise ExampleError(f"--column names a column of a Parquet or JSON lines file ({', '.join(TABLES)}) or of "
                               f"a --dataset, but --input {path} is read as text, one sentence per line: drop --column")
        else:
            data = path.read_bytes()
            lines, source = decode_lines(data, path), str(path.resolve())
    kept = [i for i, line in enumerate(lines) if line and line.strip()]
    return Corpus([lines[i] for i in kept], kept, len(lines), source, hashlib.sha256(data).hexdigest())


def decode_lines(data: bytes, path: Path) -> list[str]:
    try:
        return split_lines(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ExampleError(
            f"--input {path} is not UTF-8 text: byte {data[error.start]:#04x} on line {line} is not valid UTF-8. "
            f"Convert the file to UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 {path} > corpus-utf8.txt)"
        ) from None


def split_lines(text: str) -> list[str]:
    """The lines of `text`, as editors and `grep -n` number them: ended by "\n" only, a "\r" before it being part of
    a Windows line ending. (`str.splitlines` also ends lines at \f, \v, \x1c-\x1e, \x85, \u2028 and \u2029, which
    text may hold: every line number after the first of them was off.)"""
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    return lines[:-1] if lines[-1] == "" else lines  # the last line's ending starts no line


def read_column(path: Path, column: str) -> tuple[list, bytes]:
    """The values of `column` in a Parquet or JSON lines file (None where null), in row order, and the bytes its
    digest is taken over: the values as JSON, so that another compression or other columns change nothing. Read with
    pyarrow, which Ray Data reads these formats with (installed by the `ray` extra)."""
    import pyarrow
    import pyarrow.json
    import pyarrow.parquet

    kind = TABLES[path.suffix.lower()]
    try:
        if kind == "Parquet":
            names = pyarrow.parquet.read_schema(path).names
            table = pyarrow.parquet.read_table(path, columns=[column]) if column in names else None
        else:
            table = pyarrow.json.read_json(path)
            names = table.column_names
    except pyarrow.ArrowException as error:
        raise ExampleError(f"--input {path} cannot be read as {kind} ({' '.join(str(error).split())}): pass a "
                           f"{kind} file, or a text file with another suffix") from None
    if column not in names:
        raise ExampleError(f"--column {column!r} is not in {path}; it has {names}: pass one of them with --column")
    values = table.column(column)
    if not (pyarrow.types.is_string(values.type) or pyarrow.types.is_large_string(values.type)):
        raise ExampleError(f"--column {column!r} of {path} holds {values.type}, not text: pass a text column with "
                           f"--column")
    values = values.to_pylist()
    return values, json.dumps(values).encode()


def read_dataset(name: str, config: str | None, split: str, column: str) -> tuple[list, str, bytes]:
    try:
        import datasets
    except ImportError:
        raise ExampleError("--dataset needs the `datasets` package: pip install datasets (or pass --input FILE)")
    dataset = datasets.load_dataset(name, config, split=split)
    if column not in dataset.column_names:
        raise ExampleError(f"--column {column!r} is not in the dataset; it has {dataset.column_names}")
    lines = dataset[column]
    return lines, f"{name}:{config or ''}:{split}:{column}", json.dumps(list(lines)).encode()


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a sentence becomes its embedding; all of it is part of the manifest."""
    pooling: str
    normalize: bool
    max_length: int
    dtype: str

    def describe(self) -> str:
        return f"pooling {self.pooling}, normalize {self.normalize}, max_length {self.max_length}"


def resolve_settings(args, folder: Path, tokenizer, config) -> Settings:
    """--pooling, --normalize and --max-length, else what the folder's sentence-transformers files say."""
    pooling, normalize, max_length = sentence_transformers_settings(folder)
    return Settings(args.pooling or pooling, normalize if args.normalize is None else args.normalize,
                    resolve_max_length(args.max_length, max_length, tokenizer, config, folder), args.dtype)


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


class Embedder:
    """A converted encoder and its tokenizer, loaded once: a batch of sentences in, their (B, E) float32 embeddings
    out, pooled and normalised as `settings` say."""

    def __init__(self, folder: Path, settings: Settings, device):
        import hf_vanilla  # noqa: F401  (registers the vanilla models, also in a Ray worker, which gets this by value)

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder, dtype=DTYPES[settings.dtype]).to(device).eval()
        self.settings, self.device = settings, device

    def __call__(self, sentences: list[str]) -> torch.Tensor:
        inputs = self.tokenizer(sentences, padding=True, truncation=True, max_length=self.settings.max_length,
                                return_tensors="pt").to(self.device)
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state  # (B, T, E)
            pooled = pool(hidden, inputs["attention_mask"], self.settings.pooling)
            if self.settings.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu()


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run embeds: the corpus cut into shards (positions into `corpus.sentences`), and the manifest that keys
    it. Computed the same way by every process and either engine."""
    corpus: Corpus
    settings: Settings
    shards: list[list[int]]
    manifest: dict

    def sentences(self, rows: list[int]) -> list[str]:
        return [self.corpus.sentences[i] for i in rows]

    def lines(self, index: int) -> torch.Tensor:
        """The input line of each row of shard `index`."""
        return torch.tensor([self.corpus.line_numbers[i] for i in self.shards[index]], dtype=torch.int64)


def make_plan(corpus: Corpus, folder: Path, tokenizer, settings: Settings, shard_size: int) -> Plan:
    lengths = [len(ids) for ids in tokenizer(corpus.sentences, truncation=True,
                                             max_length=settings.max_length)["input_ids"]]
    shards = plan_shards(lengths, shard_size)
    manifest = {
        "source": corpus.source, "model": str(folder.resolve()),
        "corpus_sha256": corpus.sha256, "lines": corpus.num_lines, "sentences": len(corpus.sentences),
        "model_files": model_files(folder),
        "pooling": settings.pooling, "normalize": settings.normalize, "max_length": settings.max_length,
        "dtype": settings.dtype, "shard_size": shard_size, "shards": len(shards),
    }
    return Plan(corpus, settings, shards, manifest)


def plan_shards(lengths: list[int], shard_size: int) -> list[list[int]]:
    """Positions into the corpus, longest first (ties in input order), cut into shards of `shard_size`: neighbours
    in a shard have nearly equal lengths, so its batches carry little padding."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[start:start + shard_size] for start in range(0, len(order), shard_size)]


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


# ---------------------------------------------------------------------------------------------- the output folder

def shard_path(output: Path, index: int) -> Path:
    return output / f"shard-{index:05d}.safetensors"


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


def start(output: Path, plan: Plan) -> list[int]:
    """The shards of `plan` that `output` still lacks, once its manifest has been checked (and written). The caller
    holds the folder (`hold`)."""
    check_manifest(output, plan.manifest)
    write_atomically(output / "manifest.json", json.dumps(plan.manifest, indent=1).encode())
    return [index for index in range(len(plan.shards)) if not finished(output, index, plan.lines(index))]


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


def write_shard(output: Path, index: int, embeddings: torch.Tensor, lines: torch.Tensor, kill_halfway: bool = False):
    """Shard `index`: its (n, E) float32 embeddings and (n,) input lines, in the plan's row order."""
    write_atomically(shard_path(output, index), save({"embeddings": embeddings, "lines": lines}), kill_halfway)


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


def kill_after_shards() -> int:
    """The testing hook's N (0: off): the writing process SIGKILLs itself halfway through the shard after its N-th."""
    return int(os.environ.get(KILL_AFTER_SHARDS, "0"))


def write_index(output: Path, plan: Plan):
    """index.safetensors: for every input line, its shard and row (-1 where the line was skipped). Checks that every
    sentence was embedded exactly once."""
    num_lines = plan.corpus.num_lines
    shard_of = torch.full((num_lines,), -1, dtype=torch.int64)
    row_of = torch.full((num_lines,), -1, dtype=torch.int64)
    for index in range(len(plan.shards)):
        with safe_open(shard_path(output, index), "pt") as f:
            lines = f.get_tensor("lines")
        if (shard_of[lines] != -1).any():
            raise RuntimeError(f"{shard_path(output, index)} repeats lines already in another shard")
        shard_of[lines], row_of[lines] = index, torch.arange(len(lines))
    expected = torch.zeros(num_lines, dtype=torch.bool)
    expected[plan.corpus.line_numbers] = True
    if not torch.equal(shard_of != -1, expected):
        raise RuntimeError("the shards do not cover the corpus's sentences exactly once")
    write_atomically(output / "index.safetensors", save({"shard": shard_of, "row": row_of}))


def report(output: Path, plan: Plan, pending: list[int], elapsed: float, where: str):
    """The run's last line: what was embedded, how fast (sentences, i.e. rows, per second) and where."""
    embedded = sum(len(plan.shards[i]) for i in pending)
    print(f"embedded {embedded} sentences in {elapsed:.1f} s ({embedded / max(elapsed, 1e-9):.1f} sentences/s) on "
          f"{where}; wrote {output}")


def load_embeddings(output) -> tuple[torch.Tensor, torch.Tensor]:
    """(line numbers (n,), embeddings (n, E)) of a finished run, in input order."""
    output = Path(output)
    index = load_file(output / "index.safetensors")
    count = json.loads((output / "manifest.json").read_text())["shards"]
    shards = [load_file(shard_path(output, i))["embeddings"] for i in range(count)]
    offsets = torch.tensor([0] + [len(shard) for shard in shards]).cumsum(0)  # first row of each shard
    lines = torch.nonzero(index["shard"] != -1).squeeze(1)
    return lines, torch.cat(shards)[offsets[index["shard"][lines]] + index["row"][lines]]
