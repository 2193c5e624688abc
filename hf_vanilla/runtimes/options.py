"""The engines' options, checked in one place before an engine touches the model.

`use_onnx_runtime(model, ...)`, `use_openvino(model, ...)` and `from_pretrained(path, runtime=..., runtime_options=
{...})` (which calls them) take the same options, and a wrong value gets the same one-line error from each, naming
the option, the value and what is accepted, before anything is taken off, traced or compiled. Without this check a
wrong value surfaced wherever it was first used: `precision=['f32']` as `unhashable type: 'list'`, `threads=-1` as
an exception from OpenVINO's core.cpp, `cache_dir=5` as a TypeError from pathlib, and `threads=2.5` not at all.
Option names a runtime does not take are refused by hf_vanilla/runtime_registry.py, which knows every runtime's.
"""

import os


def checked(call: str, precision, precisions, threads, cache_dir, owned=False, static_shapes=0) -> None:
    """Refuse, naming the option, the value and what is accepted: a `precision` not among `precisions` (its names),
    `threads` that is not a whole number of threads from 1 up (None: torch's `get_num_threads()`), a `cache_dir` that
    is not a path (a str or an os.PathLike; None: the default), an `owned` that is not a bool, a `static_shapes` that
    is not a whole number from 0 up. `call` names the function in messages."""
    if not isinstance(precision, str) or precision not in precisions:
        _refuse(call, "precision", precision, f"one of {sorted(precisions)}")
    if threads is not None and not _whole(threads, 1):
        _refuse(call, "threads", threads, "a whole number of threads, 1 or more (None: torch.get_num_threads())")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        _refuse(call, "cache_dir", cache_dir, "a folder's path, a str or a pathlib.Path (None: the default cache)")
    if not isinstance(owned, bool):
        _refuse(call, "owned", owned, "True or False")
    if not _whole(static_shapes, 0):
        _refuse(call, "static_shapes", static_shapes, "a whole number of request shapes, 0 or more (0: every "
                "request runs on the compilation for any shape)")


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _refuse(call: str, name: str, value, accepted: str):
    raise ValueError(f"{call}: {name}={value!r} is not accepted; it takes {accepted}.")
