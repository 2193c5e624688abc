"""Whether the process that wrote something is still running: what lets a writer remove what a dead writer left.

Two writers leave work behind when killed mid-write (SIGKILL, power loss): the converters' `.OUT.partial-*` folders
(conversion/io/output.py) and the ONNX Runtime graph cache's `.export-*` staging files (runtimes/cache.py).
Each names its writer by host and PID; only this host's processes can be checked, and a PID alone may have been
reused, so a writer that also recorded its start time (`start_time`) is told apart from a later process with its
PID.
"""

import os
from pathlib import Path


def start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, Linux): with the PID, it names a process; a PID alone may
    have been reused. None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22, counted after the command name (which may hold spaces)


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` of this host is running (another user's counts), and, where `started` is given, is
    still the process that started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return started is None or start_time(pid) in (None, started)


__all__ = ["process_alive", "start_time"]
