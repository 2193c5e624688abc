"""The decision `runtime="auto"` keeps (hf_vanilla/runtimes/auto.py measures and chooses): the paths it chooses
among, the record of a choice (`AutoChoice`), the key it is kept under, and the file, written and read back.

Kept. The decision is written to `auto-<key>.json` in the graph cache folder (runtimes/cache.py: `cache_dir`, else
$HF_VANILLA_ONNX_CACHE, else ~/.cache/hf_vanilla/onnx), atomically; the key hashes the model's structure (classes,
shapes, config) and dtype, the CPU (model name, vendor, flags), the thread count, the precision, the candidate
paths, and the versions of torch, transformers, onnxruntime, openvino and hf_vanilla; at `precision="fastest"` also
the weights (sha256 of the encoder's tensors, read at every load) and the sample's tokens, since a
reduced precision's accuracy is theirs: other weights of one architecture (a fine-tune) are checked anew, where the
float32 paths' timing is the architecture's and shared. A second load finds it and attaches the chosen engine
without measuring. A decision measured while the machine was saturated (`saturated`: a load average above the cores
this process may use) serves its process only and is not written. To measure again, remove the file
(`auto_choice(model).file`). A file that is not a regular file (a named pipe, a folder: never opened), is larger than
`MAX_DECISION_BYTES`, cannot be read, is not JSON, or says anything unexpected is ignored with a warning and measured
again (and rewritten); it is never trusted. So is a kept path that refuses the model when put on it.
"""

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import stat
import warnings

import torch
import transformers

from ..precision import cpu_flags, cpu_name, cpu_vendor
from ..version import __version__
from .accuracy import digest
from .holding import sharing_copy

logger = logging.getLogger(__name__)


FORMAT = 7  # of the auto-<key>.json files, in their key: bump when what they hold, or how it is measured, changes
SHORT = (16,)  # one dense row of 16 tokens: an embedding service's query
PADDED = (32, 24, 16, 8)  # four rows right-padded to 32: a small batch of mixed lengths
# Eight rows of 128 tokens, no padding: a batch of a corpus embedded in length order, as sentence-transformers sorts
# it, which every engine path answers with the engine (a dense request: `choice.measures`). Padded, it was answered
# by padding-free PyTorch for every float32 engine on a CPU with AMX, as the padded 4x32 batch was, and the
# engines' order at scale went unseen: ONNX Runtime holding the weights was chosen, level with OpenVINO at 1x16 and
# well behind it on a dense 8x128 batch.
LARGE = (128,) * 8
MAX_DECISION_BYTES = 1 << 20  # a kept decision is a few kilobytes: a larger file is not one this code wrote
PRECISIONS = ("f32", "fastest")


@dataclasses.dataclass(frozen=True)
class Path:
    """One way to run the model: `runtime` and its `options` (None: eager PyTorch), at `precision`."""

    name: str
    runtime: str | None
    options: tuple = ()
    precision: str = "f32"
    packages: tuple = ()


_ONNX = ("onnx", "onnxscript")
# In order of preference at a tie: fewer restrictions first (hf_vanilla/runtimes/auto.py says why).
PATHS = (
    Path("pytorch", None),
    Path("onnxruntime", "onnxruntime", (), "f32", packages=("onnxruntime", *_ONNX)),
    Path("onnxruntime owned", "onnxruntime", (("owned", True),), "f32", packages=("onnxruntime", *_ONNX)),
    Path("openvino", "openvino", (), "f32", packages=("openvino", *_ONNX)),
    Path("pytorch bf16", None, (), "bf16"),
    Path("onnxruntime owned int8", "onnxruntime", (("owned", True), ("precision", "int8")), "int8",
         packages=("onnxruntime", *_ONNX)),
    Path("openvino int8", "openvino", (("precision", "int8"),), "int8", packages=("openvino", *_ONNX)),
    Path("openvino bf16", "openvino", (("precision", "bf16"),), "bf16", packages=("openvino", *_ONNX)),
)
BY_NAME = {path.name: path for path in PATHS}


def partner_of(name: str, threads: int, cache_dir, apply_runtime, shadow):
    """What answers beside an engine from its split (`OwnedEncoder.pair`, as runtime="auto" pairs them): path `name`
    on a copy of the engine's shadow over its tensors, eager PyTorch in the path's dtype or the path's engine (on
    float32 weights, whatever dtype the shadow followed the model to: each path computes at its own precision)."""
    path, copy = BY_NAME[name], sharing_copy(shadow)
    if path.runtime is None:
        return copy.to(torch.bfloat16 if path.precision == "bf16" else torch.float32)
    return apply_runtime(copy.to(torch.float32), path.runtime, threads=threads, cache_dir=cache_dir,
                         **dict(path.options))


@dataclasses.dataclass
class AutoChoice:
    """What `runtime="auto"` chose for a model, and from what (`auto_choice(model)`)."""

    runtime: str  # the path running: a name of PATHS
    precision: str  # what was asked: "f32" or "fastest"
    times_ms: dict  # path -> {"short": ms, "padded": ms}, each as the per-size choice would run it
    engine_ms: dict  # path -> {"short": ms, "padded": ms} of the engine's own path (PyTorch's under "pytorch")
    accuracy: dict  # reduced-precision path -> lowest token cosine against float32 (ACCURACY_FLOOR: the rule)
    sample: str  # the text the reduced paths were checked on ("": float32 paths only)
    left_out: dict  # path -> why it was not a candidate (not installed, refused this model, below the floor)
    measured_s: float  # seconds the measurement took when it was made (attach and timing)
    cpu: dict  # the CPU it was measured on: its name and capabilities (hf_vanilla.precision.cpu_capabilities)
    margin: float | None  # the next fastest path's time over the chosen one's (None: nothing else measured)
    settled: bool  # False: the margin was within NOISE, and the next load measures again once
    cached: bool  # True where this process read the decision from the file instead of measuring
    file: str | None  # the JSON file the decision is kept in (None: no writable cache folder)
    split: dict | None = None  # {"tokens": n, "path": name}: requests of n real tokens or more answered by path
    # `name` beside the chosen engine (hf_vanilla/runtimes/auto.py, `_split`); None: the chosen path alone

    @classmethod
    def pytorch_alone(cls, precision: str, left_out: dict, cpu: dict) -> "AutoChoice":
        """The record where no engine is installed: eager PyTorch, nothing measured, nothing kept."""
        return cls("pytorch", precision, times_ms={}, engine_ms={}, accuracy={}, sample="", left_out=left_out,
                   measured_s=0.0, cpu=cpu, margin=None, settled=True, cached=False, file=None)


def requests(config) -> dict:
    """The requests measured, by name: {"short": inputs, "padded": inputs, "large": inputs} (ids spread over the
    vocabulary, as `hf_vanilla.export.example_inputs` spreads them; rows right-padded)."""
    limit = config.max_position_embeddings - getattr(config, "position_offset", 0)
    made = {}
    for name, lengths in (("short", SHORT), ("padded", PADDED), ("large", LARGE)):
        lengths = [min(length, limit) for length in lengths]
        T = max(lengths)
        ids = (torch.arange(len(lengths) * T).view(len(lengths), T) * 7919 + 5) % config.vocab_size
        mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
        made[name] = {"input_ids": ids.masked_fill(mask == 0, config.pad_token_id or 0), "attention_mask": mask}
    return made


def encoder_of(model):
    """The module an engine is put in front of, which the measurement calls: the encoder of an encoder-decoder, else
    the BERT-style body."""
    return model.get_encoder() if model.config.is_encoder_decoder else model.base_model


def versions() -> dict:
    """The versions the decision depends on (None: not installed)."""
    found = {"torch": torch.__version__, "transformers": transformers.__version__, "hf_vanilla": __version__}
    for package in ("onnxruntime", "openvino"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def decision_key(model, precision: str, threads: int, paths: list, batches: list | None = None) -> str:
    """What the decision depends on, hashed (the module docstring); at precision "fastest" the weights and the sample
    (`batches`) too, on which the reduced paths' accuracy depends."""
    from .watch import structure_of

    encoder = encoder_of(model)
    meta = {"format": FORMAT, "structure": structure_of(encoder), "precision": precision,
            "dtype": sorted({str(tensor.dtype) for tensor in [*encoder.parameters(), *encoder.buffers()]
                             if tensor.is_floating_point()}),
            "threads": threads, "paths": [path.name for path in paths], "versions": versions(),
            "cpu": {"name": cpu_name(), "vendor": cpu_vendor(), "flags": sorted(cpu_flags())},
            "requests": [SHORT, PADDED, LARGE]}
    if precision == "fastest":
        meta |= {"weights": weights_digest(encoder), "sample": None if batches is None else digest(batches)}
    return hashlib.sha256(json.dumps(meta, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def weights_digest(module) -> str:
    """sha256 of `module`'s tensors: names, dtypes, shapes and bytes (about 1 GB/s)."""
    found = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        found.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        found.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return found.hexdigest()[:32]


def decision_file(model, precision, threads, paths, cache_dir, batches=None):
    """Where the decision for this model, machine and setting is kept (None: no cache folder)."""
    from .cache import GraphCache

    directory = GraphCache(cache_dir).directory
    if directory is None:
        return None
    return directory / f"auto-{decision_key(model, precision, threads, paths=paths, batches=batches)}.json"


def read_decision(file, paths: list) -> dict | None:
    """The kept decision's fields, or None (absent, or ignored with a warning where it is not one this code wrote)."""
    if file is None:
        return None
    try:
        data = json.loads(_bytes(file))
        fields = {field.name for field in dataclasses.fields(AutoChoice)} - {"cached", "file"}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != file.stem[5:]:
            raise ValueError("not a decision of this version for this key")
        record = data["choice"]
        if not isinstance(record, dict) or set(record) != fields or not isinstance(record["runtime"], str) \
                or record["runtime"] not in {path.name for path in paths}:
            raise ValueError("fields or path unknown")
        for table in ("times_ms", "engine_ms"):
            if not isinstance(record[table], dict) or not all(
                    isinstance(by, dict) and all(isinstance(ms, (int, float)) and ms > 0 for ms in by.values())
                    for by in record[table].values()):
                raise ValueError(f"{table} is not milliseconds per path and request")
        if not isinstance(record["measured_s"], (int, float)) or not all(
                isinstance(record[table], dict) for table in ("accuracy", "left_out", "cpu")) \
                or record["precision"] not in PRECISIONS or not isinstance(record["sample"], str) \
                or not isinstance(record["settled"], bool) \
                or not (record["margin"] is None or isinstance(record["margin"], (int, float))) \
                or not (record["split"] is None or _split_ok(record["split"])):
            raise ValueError("a field of the wrong type")
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:  # json's: ValueError
        warnings.warn(f"runtime='auto': ignored the kept decision {file} ({type(error).__name__}: "
                      f"{str(error)[:200]}); measuring again.", stacklevel=4)
        return None


def _split_ok(split) -> bool:
    return isinstance(split, dict) and set(split) == {"tokens", "path"} and type(split["tokens"]) is int \
        and split["tokens"] >= 1 and split["path"] in BY_NAME


def _bytes(file) -> bytes:
    """The bytes of `file`, read only where it is a regular file of at most MAX_DECISION_BYTES: a named pipe in its
    place would block the read until something writes into it, a device or a huge file would fill memory. Raises
    FileNotFoundError where there is none, OSError (saying what it is) where it is not one to read."""
    kind = os.stat(file).st_mode
    if not stat.S_ISREG(kind):  # not opened at all
        raise OSError(f"a {_kinds.get(stat.S_IFMT(kind), 'special file')}, not a regular file")
    descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # replaced meanwhile:
    try:  # a pipe opened without blocking, then refused
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode) or found.st_size > MAX_DECISION_BYTES:
            raise OSError(f"not a regular file of at most {MAX_DECISION_BYTES} bytes ({found.st_size} bytes)")
        chunks, size = [], 0
        while size <= MAX_DECISION_BYTES:
            chunk = os.read(descriptor, MAX_DECISION_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_DECISION_BYTES:
            raise OSError(f"more than {MAX_DECISION_BYTES} bytes")
        return b"".join(chunks)
    finally:
        os.close(descriptor)


_kinds = {stat.S_IFIFO: "named pipe", stat.S_IFDIR: "folder", stat.S_IFCHR: "character device",
          stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket"}


def write_decision(file, record: AutoChoice) -> str | None:
    """Keep the decision (atomically; a folder that cannot be written keeps nothing, with a log line)."""
    from .cache import write_atomic

    if file is None:
        return None
    choice = {name: value for name, value in dataclasses.asdict(record).items() if name not in ("cached", "file")}
    try:
        write_atomic(file, json.dumps({"format": FORMAT, "key": file.stem[5:], "choice": choice}, indent=1).encode())
    except OSError as error:
        logger.info("runtime='auto': the decision is not kept (%s): the next load measures again", error)
        return None
    return str(file)


__all__ = ["AutoChoice", "BY_NAME", "FORMAT", "PATHS", "Path", "decision_file", "decision_key", "read_decision",
           "versions", "write_decision"]
