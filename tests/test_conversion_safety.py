"""The converter never destroys what it did not write, and every failure is a clear error.

A hostile or careless user's findings, one test each: what `--force` may replace, an output that appears during a
run (two real conversion processes to one output), SIGTERM/SIGHUP/SIGKILL during writing (real subprocesses,
paused deterministically inside the write), damaged checkpoints, disk errors, the umask, shard paths that leave the
checkpoint, and parent folders left behind. Policy: conversion/io/output.py and docs/errors_and_safety.md.
"""

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_vanilla.conversion import flow
from hf_vanilla.conversion.cli import main
from hf_vanilla.conversion.formats.encoder import EncoderFormat
from hf_vanilla.conversion.io.output import MANIFEST, OWNER, not_ours
from test_conversion_errors import tiny_bert_dir  # noqa: F401  (the tiny BERT fixture, shared)

REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture
def workspace(tiny_bert_dir, tmp_path, monkeypatch):
    """What a user who reported losing files had: models/bert (the source), a sibling model, and a thesis, with the current
    directory inside the workspace."""
    models = tmp_path / "models"
    shutil.copytree(tiny_bert_dir, models / "bert")
    (models / "sibling").mkdir()
    (models / "sibling" / "model.safetensors").write_bytes(b"another model")
    (tmp_path / "thesis.txt").write_text("three years of work")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def tree(folder: Path) -> dict:
    """Every file under `folder` with its bytes: the same tree before and after means nothing was touched."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, argv, message) -> str:
    status = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and err.count("error: ") == 1 and message in err, err
    assert "Traceback" not in err
    return err


def convert(source, output, *extra) -> int:
    return main(["bert", "--source", str(source), "--output", str(output), "--no-verify", *map(str, extra)])


def partial_folders(output: Path) -> list[str]:
    return sorted(p.name for p in output.parent.glob(f".{output.name}.*"))


# ---- 1. what --force may replace --------------------------------------------------------------------------------


@pytest.mark.parametrize(("cwd", "output", "message"), [
    (".", "models", "is a folder holding the source"),
    (".", "models/bert", "is the source"),
    ("desk/drafts", ".", "is the current directory"),
    ("desk/drafts", "..", "is a parent of the current directory"),
    (".", "models/sibling", "has no conversion_manifest.json, so this converter did not write it"),
    (".", "thesis.txt", "it is a file, not a folder"),
])
def test_force_never_replaces_what_the_converter_did_not_write(workspace, capsys, monkeypatch, cwd, output, message):
    (workspace / "desk" / "drafts").mkdir(parents=True)
    (workspace / "desk" / "drafts" / "chapter1.txt").write_text("a draft")
    monkeypatch.chdir(workspace / cwd)
    before = tree(workspace)
    refused(capsys, ["bert", "--source", workspace / "models" / "bert", "--output", output, "--force"], message)
    assert tree(workspace) == before
    assert partial_folders(Path(output).resolve()) == []


def test_force_refuses_an_earlier_output_someone_changed(workspace, capsys):
    output = workspace / "converted"
    assert convert("models/bert", output) == 0
    (output / "notes.txt").write_text("my notes")
    before = tree(output)
    refused(capsys, ["bert", "--source", "models/bert", "--output", output, "--force"],
            "holds what this converter did not write: notes.txt")
    (output / "notes.txt").unlink()
    time.sleep(0.01)
    (output / "config.json").write_text((output / "config.json").read_text())  # re-saved: a new modification time
    refused(capsys, ["bert", "--source", "models/bert", "--output", output, "--force"],
            "config.json (changed since the converter wrote it)")
    before.pop("notes.txt")
    assert tree(output) == before


@pytest.mark.parametrize(("listed", "message"), [
    ("{workspace}/thesis.txt", "names '{workspace}/thesis.txt', which is not a plain relative path inside the folder"),
    ("../../thesis.txt", "names '../../thesis.txt', which is not a plain relative path inside the folder"),
    ("desk/thesis.txt", "holds what this converter did not write: desk"),  # desk: a link to the workspace
])
def test_force_deletes_nothing_a_manifest_names_outside_the_output(workspace, capsys, listed, message):
    """A manifest is data anyone can write: `--force` deleted every file it named, the user's thesis included, when
    the name was absolute or climbed out (or, refused already, led out through a link inside the folder)."""
    output = workspace / "runs" / "out"
    output.mkdir(parents=True)
    if listed.startswith("desk/"):
        (output / "desk").symlink_to(workspace)
    listed = listed.format(workspace=workspace)
    record = {"written_by": "hf_vanilla conversion", "files": {listed: {"size": 19, "mtime_ns": 0}}}
    (output / MANIFEST).write_text(json.dumps(record))
    before = tree(workspace)
    refused(capsys, ["bert", "--source", "models/bert", "--output", output, "--force", "--no-verify"],
            message.format(workspace=workspace))
    assert tree(workspace) == before


def test_force_refuses_a_link(workspace, capsys):
    (workspace / "link").symlink_to(workspace / "models" / "sibling")
    refused(capsys, ["bert", "--source", "models/bert", "--output", "link", "--force"], "it is a symbolic link")
    assert (workspace / "models" / "sibling" / "model.safetensors").read_bytes() == b"another model"


def test_force_replaces_an_earlier_output(workspace, capsys):
    output = workspace / "converted"
    assert convert("models/bert", output) == 0
    manifest = json.loads((output / MANIFEST).read_text())
    assert {"config.json", "model.safetensors", "README.md"} <= set(manifest["files"])
    assert not_ours(output) is None
    assert convert("models/bert", output, "--force") == 0
    assert not_ours(output) is None and partial_folders(output) == []


# ---- 2. an output that appears during the run -------------------------------------------------------------------


def test_an_output_that_appears_meanwhile_is_not_replaced(workspace, capsys, monkeypatch):
    """Even an empty folder (which `os.rename` would silently replace) that the user creates while the converter
    writes is left as it is, and the conversion fails."""
    output = workspace / "converted"
    save = flow.save_checkpoint

    def save_then_user_creates_output(model, directory, *args):
        save(model, directory, *args)
        output.mkdir()

    monkeypatch.setattr(flow, "save_checkpoint", save_then_user_creates_output)
    refused(capsys, ["bert", "--source", "models/bert", "--output", output, "--no-verify"],
            "appeared while this conversion ran")
    assert output.is_dir() and list(output.iterdir()) == []
    assert partial_folders(output) == []


# A conversion paused inside its write, by default after the weights and before the move into place (`at` another
# step, `when` before it): the test decides when it goes on (by creating the file `go`) or kills it. No sleep decides
# anything; the waits only bound a hang. It waits inside an object's finalizer, where a signal may well find a
# process (a garbage collection) and where Python swallows any exception a signal handler raises.
PAUSED_CONVERSION = """
import importlib, sys, time
from pathlib import Path
from hf_vanilla.conversion.cli import main

ready, go, at, when = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
module_name, name = at.rsplit(".", 1)
module = importlib.import_module(module_name)
step = getattr(module, name)

class Finalized:
    def __del__(self):
        time.sleep(0.02)

def paused(*args):
    result = step(*args) if when == "after" else None
    ready.write_text("")
    while not go.exists():
        Finalized()
    return step(*args) if when == "before" else result

setattr(module, name, paused)
sys.exit(main(sys.argv[5:]))
"""


def start_paused(source, output, ready, go, *extra, at="hf_vanilla.conversion.flow.save_checkpoint",
                 when="after"):
    argv = [sys.executable, "-c", PAUSED_CONVERSION, str(ready), str(go), at, when, "bert", "--source", str(source),
            "--output", str(output), "--no-verify", *extra]
    env = os.environ | {"PYTHONPATH": str(REPOSITORY), "HF_HUB_OFFLINE": "1"}
    # SIGHUP at its default in the child, whatever this process inherited: under `nohup` (as CI may run) it is
    # ignored, and the converter rightly leaves an ignored SIGHUP ignored.
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


def wait_for(path: Path, process, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_two_conversions_to_one_output(tiny_bert_dir, tmp_path):
    """Both pass the start-up check (the output does not exist yet), both write; exactly one moves its output into
    place, the other says why it wrote nothing."""
    output, go = tmp_path / "out", tmp_path / "go"
    readies = [tmp_path / "ready-1", tmp_path / "ready-2"]
    processes = [start_paused(tiny_bert_dir, output, ready, go) for ready in readies]
    for ready, process in zip(readies, processes):
        wait_for(ready, process)
    go.touch()
    results = [(p.wait(timeout=300), *p.communicate()) for p in processes]
    assert sorted(status for status, _, _ in results) == [0, 2], results
    loser = next(err for status, _, err in results if status == 2)
    assert "appeared while this conversion ran" in loser and "Traceback" not in loser
    assert not_ours(output) is None and (output / "model.safetensors").is_file()
    assert partial_folders(output) == []


# ---- 3. signals ---------------------------------------------------------------------------------------------------


def test_terminated_conversions_leave_nothing(tiny_bert_dir, tmp_path):
    """SIGTERM and SIGHUP (one conversion each, run side by side) while the weights are written."""
    runs = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        folder = tmp_path / signum.name
        folder.mkdir()
        output = folder / "new" / "out"  # the parent folder is created by the run, and removed with it
        runs[signum] = (folder, output, start_paused(tiny_bert_dir, output, folder / "ready", folder / "go"))
    for signum, (folder, output, process) in runs.items():
        wait_for(folder / "ready", process)
        assert partial_folders(output)  # the partial output is there, weights written
        process.send_signal(signum)
    for signum, (folder, output, process) in runs.items():
        assert process.wait(timeout=300) == -signum  # the process still ends by the signal, as without the converter
        assert sorted(p.name for p in folder.iterdir()) == ["ready"]  # no output, no partial folder, no parent


def test_a_signal_while_force_swaps_outputs_puts_the_earlier_one_back(tiny_bert_dir, tmp_path):
    """`--force` moves the earlier output aside just before the new one takes its place: a SIGTERM at that moment
    must leave the earlier output where it was, intact, and nothing else."""
    output = tmp_path / "out"
    assert convert(tiny_bert_dir, output) == 0
    before = {p.name: p.read_bytes() for p in output.iterdir()}
    process = start_paused(tiny_bert_dir, output, tmp_path / "ready", tmp_path / "go", "--force",
                           at="hf_vanilla.conversion.io.output._place", when="before")
    wait_for(tmp_path / "ready", process)
    assert not output.exists()  # moved aside: the moment it could be lost
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == -signal.SIGTERM
    assert {p.name: p.read_bytes() for p in output.iterdir()} == before
    assert partial_folders(output) == []


def test_a_kill_during_the_swap_is_undone_by_the_next_run_which_then_tells_the_truth(tiny_bert_dir, tmp_path, capsys):
    """SIGKILL while `--force` had the earlier output moved aside: the next conversion puts it back first, and so,
    without --force, refuses because the output exists, rather than converting and then reporting that it "appeared
    while this conversion ran" (it had put it there itself)."""
    output = tmp_path / "out"
    assert convert(tiny_bert_dir, output) == 0
    before = tree(output)
    process = start_paused(tiny_bert_dir, output, tmp_path / "ready", tmp_path / "go", "--force",
                           at="hf_vanilla.conversion.io.output._place", when="before")
    wait_for(tmp_path / "ready", process)
    process.kill()
    process.wait(timeout=300)
    assert not output.exists()
    capsys.readouterr()
    status = convert(tiny_bert_dir, output)
    printed = capsys.readouterr()
    assert status == 2 and f"Note: restored {output}, which an interrupted conversion had moved aside" in printed.out
    assert printed.err == (f"error: {output} already exists; pass --force to replace an earlier output of this "
                           f"converter, or choose another --output.\n")
    assert tree(output) == before and partial_folders(output) == []


def test_killed_conversion_is_cleaned_up_by_the_next(tiny_bert_dir, tmp_path, capsys):
    output = tmp_path / "out"
    process = start_paused(tiny_bert_dir, output, tmp_path / "ready", tmp_path / "go")
    wait_for(tmp_path / "ready", process)
    process.kill()
    process.wait(timeout=300)
    (leftover,) = partial_folders(output)
    assert (output.parent / leftover / OWNER).is_file()
    # Not ours, or ours but alive: a folder without an owner record, and one whose owner is this test's process.
    mine = output.parent / f".{output.name}.partial-mine"
    mine.mkdir()
    (mine / "data.txt").write_text("a user's file")
    alive = output.parent / f".{output.name}.partial-alive"
    alive.mkdir()
    (alive / OWNER).write_text(json.dumps(json.loads((output.parent / leftover / OWNER).read_text())
                                          | {"pid": os.getpid(), "started": None}))
    assert convert(tiny_bert_dir, output) == 0
    assert f"removed {output.parent / leftover}, left by a conversion that was killed" in capsys.readouterr().out
    assert partial_folders(output) == sorted([mine.name, alive.name])
    assert (mine / "data.txt").read_text() == "a user's file"


# ---- 4, 5. damaged checkpoints: one clear error each ------------------------------------------------------------


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def shard(source: Path, index: dict) -> None:
    """Split the checkpoint's tensors over two shard files with an index, as large checkpoints are saved."""
    tensors = load_file(source / "model.safetensors")
    (source / "model.safetensors").unlink()
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, source / f"model-0000{i + 1}-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, n in enumerate(names)}
    (source / "model.safetensors.index.json").write_text(json.dumps(index or {"weight_map": weight_map}))


def damage_int64(source: Path) -> None:
    tensors = load_file(source / "model.safetensors")
    tensors["bert.encoder.layer.0.output.dense.weight"] = tensors["bert.encoder.layer.0.output.dense.weight"].long()
    save_file(tensors, source / "model.safetensors")


def pickled(source: Path, damage) -> None:
    torch.save(load_file(source / "model.safetensors"), source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    damage(source / "pytorch_model.bin")


DAMAGES = {
    "truncated safetensors": (lambda s: truncate(s / "model.safetensors"),
                              "model.safetensors is not a readable safetensors file"),
    "config not JSON": (lambda s: (s / "config.json").write_text("{'model_type': 'bert',"), "is not valid JSON"),
    "config empty": (lambda s: (s / "config.json").write_text(""), "config.json is not valid JSON"),
    "config a list": (lambda s: (s / "config.json").write_text("[1, 2]"),
                      "config.json holds list, not the JSON object a model config is"),
    "index not JSON": (lambda s: (shard(s, None), (s / "model.safetensors.index.json").write_text("{")),
                       "model.safetensors.index.json is not valid JSON"),
    "index without weight_map": (lambda s: shard(s, {"metadata": {}}), "has no weight_map"),
    "missing shard": (lambda s: (shard(s, None), (s / "model-00002-of-00002.safetensors").unlink()),
                      "names the shard model-00002-of-00002.safetensors, which is missing"),
    "shard outside the folder": (lambda s: shard(s, {"weight_map": {"x": "../outside.safetensors"}}),
                                 "names the shard '../outside.safetensors', outside the checkpoint folder"),
    "absolute shard path": (lambda s: shard(s, {"weight_map": {"x": "/etc/hostname"}}),
                            "names the shard '/etc/hostname', outside the checkpoint folder"),
    "int64 weight": (damage_int64, "weights of an integer or bool dtype"),
    "truncated pickle": (lambda s: pickled(s, truncate), "pytorch_model.bin could not be read"),
    "empty pickle": (lambda s: pickled(s, lambda p: p.write_bytes(b"")), "truncated or damaged, not unsafe"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_checkpoint_is_a_clear_error(tiny_bert_dir, tmp_path, capsys, damage):
    source = shutil.copytree(tiny_bert_dir, tmp_path / "source")
    do, message = DAMAGES[damage]
    do(source)
    output = tmp_path / "out"
    err = refused(capsys, ["bert", "--source", source, "--output", output], message)
    assert "could run code" not in err  # damaged is not unsafe
    assert not output.exists() and partial_folders(output) == []


def test_shard_outside_the_folder_is_never_read(tiny_bert_dir, tmp_path, capsys):
    """The finding: a weight_map entry "../outside.safetensors" converted, reading a file beside the checkpoint."""
    source = shutil.copytree(tiny_bert_dir, tmp_path / "source")
    shutil.copy(source / "model.safetensors", tmp_path / "outside.safetensors")
    (source / "model.safetensors").unlink()
    names = load_file(tmp_path / "outside.safetensors")
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "../outside.safetensors" for n in names}}))
    refused(capsys, ["bert", "--source", source, "--output", tmp_path / "out"], "outside the checkpoint folder")


@pytest.mark.parametrize("damage", ["truncated safetensors", "config a list"])
def test_damaged_vanilla_checkpoint_through_to_bert_and_onnx(tiny_bert_dir, tmp_path, capsys, damage):
    vanilla = tmp_path / "vanilla"
    assert convert(tiny_bert_dir, vanilla) == 0
    do, message = DAMAGES[damage]
    do(vanilla)
    for command in (["to-bert"], ["onnx", "--task", "fill-mask"]):
        output = tmp_path / f"out-{command[0]}"
        refused(capsys, [*command, "--source", vanilla, "--output", output], message.split(" is ")[0])
        assert not output.exists() and partial_folders(output) == []


# ---- disk errors --------------------------------------------------------------------------------------------------


def full_disk(*args, **kwargs):
    """What safetensors' writer raises on a full disk (a SafetensorError, not an OSError): see
    docs/errors_and_safety.md for the same error on a real 200 kB tmpfs."""
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def read_only(model, directory, *args):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(directory / "model.safetensors"))


@pytest.mark.parametrize(("fail", "message"), [
    (full_disk, "the disk is full: free some space, or choose an --output on another disk. Nothing was written."),
    (read_only, "out/model.safetensors: the file system is read-only: choose an --output on a writable disk"),
])
def test_write_errors_are_clear(tiny_bert_dir, tmp_path, capsys, monkeypatch, fail, message):
    monkeypatch.setattr(flow, "save_checkpoint", fail)
    output = tmp_path / "new" / "out"
    err = refused(capsys, ["bert", "--source", tiny_bert_dir, "--output", output, "--no-verify"], message)
    assert ".partial-" not in err  # the message names the output the user chose, not the hidden staging folder
    assert not (tmp_path / "new").exists()  # 8: no empty parent folders left


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_folder_without_write_permission(tiny_bert_dir, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    refused(capsys, ["bert", "--source", tiny_bert_dir, "--output", locked / "a" / "out", "--no-verify"],
            "permission denied")
    assert list(locked.iterdir()) == []


def test_failure_leaves_no_parent_folders(tiny_bert_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = shutil.copytree(tiny_bert_dir, tmp_path / "source")
    edit = json.loads((source / "config.json").read_text()) | {"hidden_size": 30}
    (source / "config.json").write_text(json.dumps(edit))
    refused(capsys, ["bert", "--source", source, "--output", "np/a/b/out"], "describes no valid encoder")
    assert not (tmp_path / "np").exists()


# ---- 6. permissions follow the umask ------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_output_follows_the_umask(tiny_bert_dir, tmp_path, umask):
    source = shutil.copytree(tiny_bert_dir, tmp_path / "source")
    (source / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) + "\n")
    (source / "vocab.txt").chmod(0o600)  # a copied file takes the umask too, not its source's mode
    previous = os.umask(umask)
    try:
        assert convert(source, tmp_path / "new" / "out") == 0
    finally:
        os.umask(previous)
    for path in [tmp_path / "new", tmp_path / "new" / "out", *(tmp_path / "new" / "out").iterdir()]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


# ---- the error path itself ----------------------------------------------------------------------------------------


def test_debug_shows_the_traceback(tiny_bert_dir, tmp_path, capsys):
    source = shutil.copytree(tiny_bert_dir, tmp_path / "source")
    (source / "config.json").write_text("")
    assert main(["bert", "--source", str(source), "--output", str(tmp_path / "out"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: ")


def test_a_bug_is_named_as_one(tiny_bert_dir, tmp_path, capsys, monkeypatch):
    def bug(*args):
        raise TypeError("something the converter got wrong")

    monkeypatch.setattr(EncoderFormat, "to_vanilla", bug)
    assert main(["bert", "--source", str(tiny_bert_dir), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == ("error: unexpected TypeError: something the converter got wrong. This is a bug in the converter: "
                   "rerun with --debug for the traceback and report it.\n")


def test_no_progress_bars(tiny_bert_dir, tmp_path, capsys):
    assert main(["bert", "--source", str(tiny_bert_dir), "--output", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr()
    assert "Loading weights" not in printed.err + printed.out
    assert "Writing model shards" not in printed.err + printed.out


def test_onnx_without_its_packages(tiny_bert_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # what `import onnxscript` sees when it is not installed
    refused(capsys, ["onnx", "--source", tiny_bert_dir, "--output", tmp_path / "out"],
            'The ONNX export needs onnxscript, which is not installed: pip install "hf_vanilla[onnx]"')
