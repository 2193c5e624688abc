"""The engine's graphs on disk.

Graphs are kept in `cache_dir`, else $HF_VANILLA_ONNX_CACHE, else `$XDG_CACHE_HOME/hf_vanilla/onnx` (by
default `~/.cache/hf_vanilla/onnx`), as `encoder-<key>-<digest>.onnx`. The key hashes what the graph was traced
from (`structure_of`: classes, attributes, shapes, config), the source files of the model's code and the versions of
torch, transformers, onnx and onnxscript; the digest is the file's own sha256, and the key is also written inside
the graph. A file is used only when its bytes match its digest, its key is the one asked for, and it gives
PyTorch's answer on a short padded request; anything else (truncated, emptied, replaced) is removed and exported
again. Writes are atomic (`.export-<host>-<pid>-<8 hex>.onnx`, then a rename); such leftovers of processes that died
are removed. The cache removes nothing else: only regular files named as it names them (`GRAPH_NAME`,
`STAGING_NAME`), never a folder, a link or another file, since the folder it points at may be the user's (a
directory in a graph's place is left, and the graph is then kept in memory, with the warning below). A cache that
cannot be written is used read-only, with a one-line warning: the graph is then exported in memory by every process
that needs it. Exporting is paid once per architecture; attaching a cached graph costs a small fraction of it.
"""

import hashlib
import json
import os
import re
import socket
import sys
import time
import warnings
from pathlib import Path

import onnx
import onnxscript
import torch
import transformers

from ..export import export_encoder_reading_weights
from ..processes import process_alive

CACHE_FORMAT = 2  # bump when the exported graph changes for the same key (2: weights are graph inputs)
CACHE_ENV = "HF_VANILLA_ONNX_CACHE"
KEY_METADATA = "hf_vanilla.cache_key"
# Leftovers of an export whose process cannot be checked (another host) go after a day.
STALE_SECONDS = 24 * 3600


def graph_io(unit) -> tuple[list, tuple]:
    """(inputs, outputs) of `unit`'s graph, as every engine traces it: ids and mask, and segment ids where the model
    has them; the hidden states, and the pooled output where the unit has a pooler."""
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if unit.config.type_vocab_size > 0 else [])
    outputs = ("last_hidden_state",) + (("pooler_output",) if getattr(unit, "pooler", None) is not None else ())
    return inputs, outputs


def cache_key(unit, structure: dict, inputs: list, outputs: tuple) -> str:
    """What the graph depends on: the structure, the source files of every class in it that torch and transformers
    do not ship (their versions stand for theirs), the exporter's versions, and the graph's inputs and outputs."""
    code, files = hashlib.sha256(), set()
    for cls in {type(m) for m in unit.modules()}:
        module = sys.modules[cls.__module__]
        if module.__name__.split(".")[0] in ("torch", "transformers"):
            continue
        source = getattr(module, "__file__", None)
        if source is None:  # defined interactively: its code cannot be read back, so its graph is this process's
            code.update(f"{cls.__qualname__}:{id(cls)}".encode())
        elif module.__package__:  # a package's helpers run too (this one: kernels.py, packing.py, validation.py)
            files.update(Path(source).parent.glob("*.py"))
        else:
            files.add(Path(source))
    for path in sorted(files):
        code.update(f"{path.name}:".encode() + path.read_bytes())
    meta = {"format": CACHE_FORMAT, "inputs": inputs, "outputs": outputs, "structure": structure,
            "code": code.hexdigest(), "versions": [torch.__version__, transformers.__version__, onnx.__version__,
                                                   onnxscript.__version__]}
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]


def export_graph(unit, inputs: list, outputs: tuple, key: str) -> bytes:
    """The unit's graph reading its weights as inputs, with `key` written inside."""
    with torch.no_grad():
        proto = export_encoder_reading_weights(unit, inputs, outputs)
    onnx.helper.set_model_props(proto, {KEY_METADATA: key})
    return proto.SerializeToString()


class GraphCache:
    """Graphs on disk, `encoder-<key>-<sha256 of the file, 16 hex>.onnx`, checked before use and repaired when
    they fail the check (see the module docstring)."""

    def __init__(self, directory=None):
        self.error = None
        if directory is None:
            directory = os.environ.get(CACHE_ENV) or None
        if directory is None:
            try:
                directory = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_vanilla" / "onnx"
            except RuntimeError as error:  # no home directory to be found
                self.error = error
        self.directory = Path(directory) if directory is not None else None
        self.warned = False

    def load(self, key: str) -> bytes | None:
        """The graph of `key` if a cached file passes the checks of bytes and key; files that fail are removed."""
        if self.directory is None or not self.directory.is_dir():
            return None
        self._remove_stale_exports()
        for path in sorted(self.directory.glob(f"encoder-{key}-*.onnx")):
            try:
                data = path.read_bytes() if _ours(path, GRAPH_NAME) else None
            except OSError:  # unreadable: as good as absent
                continue
            if data is not None and path.stem.endswith(hashlib.sha256(data).hexdigest()[:16]) \
                    and written_key(data) == key:
                return data
            self._remove(path)
        return None

    def store(self, key: str, data: bytes) -> None:
        """Write the graph atomically; a cache that cannot be written is left as it is, with a warning."""
        if self.directory is None:
            self._cannot_write(self.error)
            return
        try:
            write_atomic(self.directory / f"encoder-{key}-{hashlib.sha256(data).hexdigest()[:16]}.onnx", data)
        except OSError as error:
            self._cannot_write(error)

    def discard(self, key: str) -> None:
        for path in self.directory.glob(f"encoder-{key}-*.onnx"):
            self._remove(path)

    def _remove(self, path: Path) -> None:
        """Remove `path` if this cache can tell it wrote it (`_ours`): a folder the cache points at may be the
        user's own, and a directory, a link or a file of another name in it is theirs."""
        if not (_ours(path, GRAPH_NAME) or _ours(path, STAGING_NAME)):
            return
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            self._cannot_write(error)

    def _remove_stale_exports(self) -> None:
        """Remove this cache's own `.export-<host>-<pid>-<8 hex>.onnx` files of processes that died mid-write: this
        host's, when their process is gone; another host's, once a day old."""
        host = socket.gethostname()
        for path in self.directory.glob(".export-*"):
            match = STAGING_NAME.fullmatch(path.name)
            if not match or not _ours(path, STAGING_NAME):
                continue
            try:
                if match[1] == host:
                    stale = not process_alive(int(match[2]))
                else:
                    stale = time.time() - path.lstat().st_mtime > STALE_SECONDS
            except OSError:
                continue  # removed meanwhile
            if stale:
                self._remove(path)

    def _cannot_write(self, error) -> None:
        if not self.warned:
            warnings.warn(f"The ONNX graph cache {self.directory} cannot be written ({error}): graphs are exported in "
                          f"memory by every process. Set ${CACHE_ENV} or runtime_options={{'cache_dir': ...}} to a "
                          f"writable folder.", stacklevel=5)
            self.warned = True


# The only names the cache writes, and so the only ones it removes: regular files, never folders or links.
GRAPH_NAME = re.compile(r"encoder-[0-9a-f]{32}-[0-9a-f]{16}\.onnx")
STAGING_NAME = re.compile(r"\.export-(.+)-(\d+)-[0-9a-f]{8}\.(?:onnx|json)")


def write_atomic(final: Path, data: bytes) -> None:
    """Write `data` as `final`, atomically (`.export-<host>-<pid>-<8 hex><suffix>` beside it, then a rename): a
    reader sees the whole file or none, and two writers leave one whole file. Raises OSError where it cannot."""
    staging = final.parent / f".export-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}{final.suffix}"
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.write_bytes(data)
        os.replace(staging, final)
    finally:
        staging.unlink(missing_ok=True)


def _ours(path: Path, name: re.Pattern) -> bool:
    """Whether `path` is a file this cache writes: a regular file (not a folder, not a link) named as it names them."""
    return bool(name.fullmatch(path.name)) and path.is_file() and not path.is_symlink()


def written_key(data: bytes) -> str | None:
    try:
        model = onnx.load_from_string(data)
    except Exception:  # noqa: BLE001  (any damage: protobuf's errors have no common class)
        return None
    return {prop.key: prop.value for prop in model.metadata_props}.get(KEY_METADATA)
