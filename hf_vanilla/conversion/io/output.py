"""Where a conversion writes: its `--output` folder appears whole or not at all, and nothing the converter did not
write is ever replaced or deleted.

The policy (docs/errors_and_safety.md tells it to users):
- Refused whatever the options: an output that is the source or holds it, and one that is the current directory or
  one of its parents. `--force` never widens these.
- An existing output is refused without `--force`. With it, only an earlier output of this converter is replaced: a
  folder holding its `conversion_manifest.json` and nothing but the files listed there, unchanged (size and
  modification time), each named by a plain relative path inside the folder (a manifest is data: one naming
  `/home/me/thesis.txt` or `../../thesis.txt` makes the folder not ours). Anything else, a user's folder, a file, a
  link, a converted folder someone added to or re-saved into, is refused with the reason.
- The output is written into `.OUT.partial-XXXX/new` beside it and moved into place by a rename that cannot replace
  anything (`renameat2(RENAME_NOREPLACE)` on Linux): an output that appears meanwhile, another conversion's or a
  user's, makes this conversion fail instead. Of two conversions to one output, exactly one succeeds. A lock file
  would only exclude other converters; the kernel's check excludes everyone, and leaves nothing to go stale.
- A failure, Ctrl-C, SIGTERM or SIGHUP removes the partial folder and any parent folders the run created. After a
  SIGKILL or a power loss the partial folder stays; it records its owner (host, PID, process start time), and the
  next conversion to that output removes it once the owner is gone. A folder without that record is never touched.
- Folders and files follow the umask (the weights too, which safetensors alone writes 0600).
"""

import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from ...processes import process_alive, start_time
from ..errors import ConversionError, describe_io_error, os_errno

MANIFEST = "conversion_manifest.json"
OWNER = "owner.json"  # in a partial folder: the process writing it


# ---- what may be replaced ---------------------------------------------------------------------------------------


def write_manifest(directory: Path) -> None:
    """List every file the converter wrote into `directory` (size and modification time), last, so that a later
    `--force` can tell an untouched earlier output from a folder that holds anything else."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        stat = path.stat()
        files[path.relative_to(directory).as_posix()] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    record = {"written_by": "hf_vanilla conversion", "files": files}
    (directory / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")


def current_umask() -> int:
    """The process's umask, read where the system shows it (Linux), else by setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o077)  # briefly the strictest usual value, never 0 (datasets#2157)
    os.umask(umask)
    return umask


def apply_umask(directory: Path) -> None:
    """Give every folder and file under `directory` the mode the umask gives a new one (0o777 / 0o666 & ~umask).
    Needed for the weights: safetensors writes through a temporary file created 0600 whatever the umask
    (safetensors#782), so a model saved by `save_pretrained` is unreadable to the group its folder is shared with."""
    umask = current_umask()
    for path in [directory, *directory.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def manifest_files(directory: Path) -> dict:
    """The files `directory`'s manifest lists: {name: {"size": ..., "mtime_ns": ...}}, each name a plain relative path
    inside `directory` ("1_Pooling/config.json"). FileNotFoundError without a manifest; ValueError, naming the
    problem, for anything else: not JSON, another layout, or a name that is absolute, climbs out with `..`, or is not
    written plainly ("./a", "a//b"). A manifest is data in a folder anyone may write to, and `--force` deletes the
    files it lists: "/home/me/thesis.txt" or "../../thesis.txt" there must make the folder not ours, not reach
    `unlink`. (A name that passes can still lead outside through a symbolic link inside the folder: `not_ours` finds
    the links, which this converter never writes.)"""
    try:
        record = json.loads((directory / MANIFEST).read_text())
    except RecursionError:
        raise ValueError("it nests deeper than JSON's parser goes") from None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict):
        raise ValueError("it has no files table")
    for name, entry in files.items():
        path = Path(name)
        if path.anchor or not path.parts or ".." in path.parts or path.as_posix() != name:
            raise ValueError(f"it names {name!r}, which is not a plain relative path inside the folder")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("mtime_ns"), int)):
            raise ValueError(f"its entry for {name} has no size and modification time")
    return files


def not_ours(output: Path) -> str | None:
    """Why `output` is not an untouched earlier output of this converter, or None when it is one (an empty folder
    holds nothing to lose, and counts as one)."""
    if output.is_symlink():
        return "it is a symbolic link"
    if not output.is_dir():
        return "it is a file, not a folder"
    entries = sorted(p.relative_to(output).as_posix() for p in output.rglob("*"))
    if not entries:
        return None
    try:
        files = manifest_files(output)
    except FileNotFoundError:
        return f"it has no {MANIFEST}, so this converter did not write it"
    except ValueError as error:
        return f"its {MANIFEST} is not one this converter wrote ({error})"
    folders = {parent.as_posix() for name in files for parent in Path(name).parents}
    foreign = []
    for name in entries:
        path = output / name
        if name in files and path.is_file() and not path.is_symlink():
            stat = path.stat()
            if (stat.st_size, stat.st_mtime_ns) != (files[name]["size"], files[name]["mtime_ns"]):
                foreign.append(f"{name} (changed since the converter wrote it)")
        elif not (name == MANIFEST or (name in folders and path.is_dir() and not path.is_symlink())):
            foreign.append(name)
    if foreign:
        return f"it holds what this converter did not write: {', '.join(foreign[:5])}" + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return None


def check_output(output: Path, force: bool, sources: tuple[Path, ...]) -> None:
    """Refuse an output that would cost the user anything (see the module's docstring), naming the reason."""
    real = output.resolve()
    for source in sources:
        source = Path(source).resolve()
        if real == source or real in source.parents:
            what = "the source" if real == source else f"a folder holding the source {source}"
            raise ConversionError(f"--output {output} is {what}: the converter never writes over what it reads. "
                                  f"Choose another --output.")
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        what = "the current directory" if real == cwd else "a parent of the current directory"
        raise ConversionError(f"--output {output} is {what}. Choose a new folder, e.g. "
                              f"--output {output / 'converted'}.")
    if not os.path.lexists(output):
        return
    if not force:
        raise ConversionError(f"{output} already exists; pass --force to replace an earlier output of this converter, "
                              f"or choose another --output.")
    reason = not_ours(output)
    if reason is not None:
        raise ConversionError(
            f"--force refuses to replace {output}: {reason}. --force replaces only a folder this converter wrote (one "
            f"holding its {MANIFEST} and nothing else); move or delete it yourself, or choose another --output."
        )


# ---- moving into place ------------------------------------------------------------------------------------------


def rename_noreplace(source: Path, target: Path) -> None:
    """Rename `source` to `target`, failing with FileExistsError if `target` exists, in one step of the kernel.

    `os.rename` replaces an empty folder (and on Linux any file) at `target`; `renameat2(RENAME_NOREPLACE)` checks and
    moves atomically. Where it is missing (not Linux, an old kernel, a file system without it) the check comes just
    before the rename: Windows refuses an existing target itself; elsewhere a window of microseconds remains."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if hasattr(libc, "renameat2"):
            at_fdcwd, rename_noreplace_flag = -100, 1
            if libc.renameat2(at_fdcwd, os.fsencode(source), at_fdcwd, os.fsencode(target), rename_noreplace_flag) == 0:
                return
            code = ctypes.get_errno()
            if code not in (errno.EINVAL, errno.ENOSYS):  # EINVAL: the file system cannot do it
                raise OSError(code, os.strerror(code), str(target))
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)


def remove_written(directory: Path) -> None:
    """Delete a folder `not_ours` accepted: only the files its manifest lists, then the folders left empty."""
    try:
        listed = manifest_files(directory)
    except FileNotFoundError:
        listed = {}
    for name in [*listed, MANIFEST]:
        (directory / name).unlink(missing_ok=True)
    for folder in sorted((p for p in directory.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        folder.rmdir()
    directory.rmdir()  # OSError if something appeared meanwhile: then it stays


def place(staging: Path, output: Path, work: Path, force: bool) -> None:
    """Move the finished `staging` folder to `output`; with `force`, an earlier output there is moved aside first
    (into `work`, checked again right before) and deleted only once the new one is in place."""
    if force and os.path.lexists(output):
        check_output(output, force, ())
        old = work / "old"
        try:
            os.rename(output, old)
        except FileNotFoundError:
            old = None  # gone meanwhile: another conversion is replacing it too, and the rename below decides
        try:
            _place(staging, output)
        except BaseException:
            if old is not None:
                put_back(old, output)
            raise
        if old is not None:
            _remove_old(old, output)
    else:
        _place(staging, output)


def put_back(old: Path, output: Path) -> None:
    """An earlier output that `place` moved aside, back in its place when the new one did not get there."""
    try:
        rename_noreplace(old, output)
    except OSError:  # another conversion's output is there now: this one is obsolete
        _remove_old(old, output)


def _remove_old(old: Path, output: Path) -> None:
    """Delete the replaced output; what was added to it after the last check (a window of microseconds) is not
    deleted but set aside beside the output, and said so."""
    try:
        remove_written(old)
    except (OSError, ValueError):  # ValueError: its manifest was rewritten after the check
        kept = output.with_name(f".{output.name}.replaced-{os.getpid()}")
        os.rename(old, kept)
        print(f"Note: {output} was replaced; what was added to the old one meanwhile is kept in {kept}.")


def _place(staging: Path, output: Path) -> None:
    try:
        rename_noreplace(staging, output)
    except FileExistsError:
        raise ConversionError(
            f"{output} appeared while this conversion ran (another conversion to the same --output?); it was left as "
            f"it is and nothing was written. Choose another --output, or wait and pass --force to replace it."
        ) from None
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise ConversionError(f"{output} appeared while this conversion ran; nothing was written.") from None
        raise


# ---- the partial folder, its owner, and leftovers -----------------------------------------------------------------


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": start_time(os.getpid())}


def _owner_gone(record: dict) -> bool:
    """Whether the process that wrote `record` has ended. Another host's process cannot be checked: never gone."""
    if record.get("host") != socket.gethostname():
        return False
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    return not process_alive(pid, record.get("started"))


def remove_leftovers(output: Path) -> None:
    """Remove the partial folders an earlier conversion to `output` left when it was killed (SIGKILL, power loss):
    only folders named `.OUT.partial-*` whose owner record names a process of this host that has ended. If that
    process had moved an earlier output aside and not yet put the new one in place, the earlier one goes back."""
    if not output.parent.is_dir():
        return
    for work in output.parent.glob(f".{output.name}.partial-*"):
        try:
            record = json.loads((work / OWNER).read_text())
        except (OSError, ValueError, RecursionError):
            continue  # not ours, or still being created
        if work.is_symlink() or not isinstance(record, dict) or not _owner_gone(record):
            continue
        if (work / "old").is_dir() and not os.path.lexists(output):
            rename_noreplace(work / "old", output)
            print(f"Note: restored {output}, which an interrupted conversion had moved aside.")
        shutil.rmtree(work)
        print(f"Note: removed {work}, left by a conversion that was killed (PID {record['pid']}).")


@contextmanager
def _signals_clean_up(cleanup):
    """While the output is written, SIGTERM and SIGHUP run `cleanup` (remove the partial output) and then end the
    process by the same signal, from the handler itself. Only signals left at their default are taken: an ignored
    SIGHUP (nohup) stays ignored, and a program's own handlers stay in charge.

    The handler does not raise an exception for the code below to clean up on its way out: Python runs handlers
    between any two bytecodes, inside `__del__` methods and garbage-collector callbacks too, where an exception is only
    printed and swallowed. Raising left a process that had already set the signals to ignored running on (a test
    whose paused conversion waits in a finalizer hung every time on that design)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        for taken in previous:
            signal.signal(taken, signal.SIG_IGN)  # a second signal must not interrupt the cleanup
        try:
            cleanup()
        finally:
            for taken in previous:
                signal.signal(taken, signal.SIG_DFL)
            signal.raise_signal(signum)  # ends the process as the signal would have

    previous = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None))
                if s is not None and signal.getsignal(s) is signal.SIG_DFL]
    for taken in previous:
        signal.signal(taken, handler)
    try:
        yield
    finally:
        for taken in previous:
            signal.signal(taken, signal.SIG_DFL)


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; return those this call created, deepest first."""
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    created = []
    for path in reversed(missing):
        try:
            path.mkdir()
            created.insert(0, path)
        except FileExistsError:
            pass  # made meanwhile by someone else: not ours to remove
    return created


def _remove_created(created: list[Path]) -> None:
    for path in created:
        try:
            path.rmdir()
        except OSError:
            return  # not empty (someone else wrote into it): it stays, and so do its parents


@contextmanager
def atomic_output(output: str | Path, force: bool, sources: tuple[Path, ...] = ()):
    """Yield a new folder to write the conversion into; it becomes `output` only if the block succeeds.

    `sources`: the folders the conversion reads, which `output` may neither be nor hold. See the module's docstring
    for what is refused, what `force` replaces, and what is left behind after a failure or a signal (nothing)."""
    output = Path(os.path.abspath(output))
    try:
        # First: an earlier output that a killed `--force` had moved aside is back before the checks judge `output`.
        remove_leftovers(output)
    except OSError as error:
        raise ConversionError(f"Cannot write {output}: {describe_io_error(error)}.") from None
    check_output(output, force, tuple(sources))
    created, work = [], None

    def clean_up():
        if work is not None:
            if os.path.lexists(work / "old"):  # a signal while `place` had an earlier output moved aside
                put_back(work / "old", output)
            shutil.rmtree(work, ignore_errors=True)
        _remove_created(created)

    with _signals_clean_up(clean_up):
        try:
            try:
                created = _make_parents(output.parent)
                work = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
                (work / OWNER).write_text(json.dumps(_owner()))
                staging = work / "new"
                staging.mkdir()  # not mkdtemp's 0700: the output folder's mode follows the umask
            except OSError as error:
                if f".{output.name}.partial-" in str(error.filename):
                    error.filename = None  # the hidden partial folder: the user knows the output's name only
                raise ConversionError(f"Cannot write {output}: {describe_io_error(error)}.") from None
            yield staging
            apply_umask(staging)
            write_manifest(staging)
            place(staging, output, work, force)
        except BaseException as error:
            clean_up()
            if os_errno(error) is not None and not isinstance(error, ConversionError):
                raise ConversionError(f"Could not write {output}: {describe_io_error(error, {work / 'new': output})}. "
                                      f"Nothing was written.") from error
            raise
    shutil.rmtree(work)
