"""The checkpoint's memory under an engine that holds the weights (hf_vanilla/runtimes/owned.py): a checkpoint loaded
memory-mapped shares its pages with the file it was read from. `MappedFiles` watches the files under the engine's copy
(written in place, they change the weights under it), `release_mapped_pages` unmaps the pages only compiling read,
and `return_freed_memory` gives the C heap's free pages back once an engine is built.
"""

import bisect
import ctypes
import mmap
import os
import weakref

import numpy as np


class MappedFiles:
    """The files whose pages back the shadow's tensors (a checkpoint loaded memory-mapped: transformers maps a
    safetensors file rather than reading it), each held open, with their size and modification time when the engine
    compiled. Such a file written in place (`cp` over it, a writer opening it for update) changes the tensors' memory
    under the engine: PyTorch's path would answer the new weights and the engine's copy the old, or a mix where it
    reads some weights in place. `written()` names a file changed since; the engine then refuses every call. A file
    replaced by a rename (as `save_pretrained` writes) leaves the mapped one as it was. Read from /proc/self/maps: off
    Linux nothing is watched."""

    def __init__(self, shadow):
        self.files = []  # (path, open file descriptor, (size, modification time))
        pointers = sorted({tensor.untyped_storage().data_ptr() for tensor in [*shadow.parameters(), *shadow.buffers()]
                           if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes()})
        try:
            with open("/proc/self/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:
            return
        found = {}
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == "0" or not fields[5].startswith("/"):
                continue  # anonymous memory, the heap, the stack
            start, end = (int(edge, 16) for edge in fields[0].split("-"))
            first = bisect.bisect_left(pointers, start)
            if first < len(pointers) and pointers[first] < end:
                found.setdefault(int(fields[4]), fields[5])
        for inode, path in found.items():
            try:
                descriptor = os.open(path, os.O_RDONLY)
            except OSError:  # removed or renamed since it was mapped: nothing can write the mapped file by its name
                continue
            status = os.fstat(descriptor)
            if status.st_ino != inode:  # the name holds another file now
                os.close(descriptor)
                continue
            self.files.append((path, descriptor, (status.st_size, status.st_mtime_ns)))
        weakref.finalize(self, _close, [descriptor for _, descriptor, _ in self.files])

    def written(self) -> str | None:
        """The path of a file written since the engine compiled, or None."""
        for path, descriptor, stamp in self.files:
            status = os.fstat(descriptor)
            if (status.st_size, status.st_mtime_ns) != stamp:
                return path
        return None


def written_under(path: str, runtime: str) -> str:
    """The refusal of every call once `MappedFiles.written()` named `path`."""
    return (f"The checkpoint file {path} was written while this model was loaded from it memory-mapped "
            f"(from_pretrained maps the file rather than reading it): the weights runtime={runtime!r} compiled and the "
            f"file's no longer agree, so every call is refused. Load the model again; to replace a checkpoint a model "
            f"runs from, write the new one beside it and rename it into place (as save_pretrained does).")


def _close(descriptors: list) -> None:
    for descriptor in descriptors:
        os.close(descriptor)


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing), once an engine is
    built: the graphs, protobufs and copies made on the way are freed, and glibc keeps most of such memory
    resident (many blocks below its mmap threshold): ONNX Runtime's int8 session of bert-base kept twice the
    checkpoint so (docs/performance.md, Memory)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def release_mapped_pages(shadow) -> None:
    """Unmap from this process the pages under `shadow`'s tensors (their storages) that a file backs and nobody
    wrote: a checkpoint loaded memory-mapped, read whole by compiling and by the check against PyTorch at attach. They
    stay in the page cache, and a read (PyTorch's path, or an engine computing from the shadow's memory) maps them
    again, so the shadow's copy costs resident memory only as far as it is used (docs/performance.md, Memory). A page
    written since it was mapped is the process's own (no file backs it) and is kept, as is everything off Linux,
    where nothing is done."""
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, seen = mmap.PAGESIZE, set()
    try:
        for storage in [tensor.untyped_storage() for tensor in [*shadow.parameters(), *shadow.buffers()]
                        if tensor.device.type == "cpu"]:
            start, end = -(-storage.data_ptr() // page), (storage.data_ptr() + storage.nbytes()) // page
            if start >= end or start in seen:  # no whole page, or a storage met already
                continue
            seen.add(start)
            flags = np.frombuffer(os.pread(pagemap, (end - start) * 8, start * 8), np.uint64)
            mapped = ((flags >> np.uint64(63)) & (flags >> np.uint64(61)) & np.uint64(1)).astype(np.int8)
            edges = np.flatnonzero(np.diff(mapped, prepend=0, append=0))  # runs of present file pages
            for first, last in zip(edges[::2].tolist(), edges[1::2].tolist()):
                madvise((start + first) * page, (last - first) * page, mmap.MADV_DONTNEED)
    except OSError:  # the page map unreadable (some sandboxes): the pages stay mapped
        pass
    finally:
        os.close(pagemap)
