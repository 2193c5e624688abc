"""The converters' one error path: every failure becomes an `error:` line that names the file, the problem and the fix,
and exit status 2; a traceback only with `--debug`. Imports nothing heavy: the command line catches these errors
before (and whether or not) torch is imported."""

import errno
import re
import sys
import traceback


class ConversionError(Exception):
    """A problem with the source, the options or the output; the CLI prints it and exits with status 2."""


# What to do about an operating-system error, by errno. Anything else is named as the system names it.
_FIXES = {
    errno.ENOSPC: "the disk is full: free some space, or choose an --output on another disk",
    errno.EDQUOT: "the disk quota is used up: free some space, or choose an --output elsewhere",
    errno.EROFS: "the file system is read-only: choose an --output on a writable disk",
    errno.EACCES: "permission denied: choose an --output in a folder you may write to, or fix its permissions",
    errno.EPERM: "operation not permitted: choose an --output in a folder you may write to, or fix its permissions",
    errno.EFBIG: "the file is larger than this file system or process allows (ulimit -f): choose another --output",
    errno.ENOENT: "it does not exist",
}


def os_errno(error: BaseException) -> int | None:
    """The errno behind an I/O failure: an `OSError`'s own, or the `(os error N)` that safetensors' Rust writer puts
    in its message (a full disk during `save_pretrained` is a `SafetensorError`, not an `OSError`)."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    found = re.search(r"\(os error (\d+)\)", str(error))
    return int(found.group(1)) if found else None


def describe_io_error(error: BaseException, rename: dict | None = None) -> str:
    """`path: what happened; what to do`. `rename` maps internal paths (the staging folder) to the ones the user
    chose, so that a message never names a hidden folder that no longer exists."""
    code = os_errno(error)
    filename = getattr(error, "filename", None)
    what = getattr(error, "strerror", None) or (errno.errorcode.get(code) if code else None) or str(error)
    fix = _FIXES.get(code, what)
    text = f"{filename}: {fix}" if filename else fix
    for internal, shown in (rename or {}).items():
        text = text.replace(str(internal), str(shown))
    return text


def report_failure(error: Exception, debug: bool = False) -> int:
    """Print `error: ...` for what a command raised, and return its exit status: 2 for a problem with the input, the
    options or the disk, 1 for anything else, which is a bug (named as such, with the way to see its traceback).
    `--debug` prints the traceback first. The one error path of `python -m conversion` and `hf-vanilla`; a script
    can use it too: `except Exception as error: sys.exit(report_failure(error))`."""
    if debug:
        traceback.print_exception(error)
    if isinstance(error, ConversionError):
        message, status = str(error), 2
    elif os_errno(error) is not None:
        message, status = f"{describe_io_error(error)}. Nothing was written.", 2
    else:
        message, status = (f"unexpected {type(error).__name__}: {error}. This is a bug in the converter: rerun with "
                           f"--debug for the traceback and report it."), 1
    print(f"error: {message}", file=sys.stderr)
    return status
