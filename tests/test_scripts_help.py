"""Every script in benchmarks/ and examples/ answers `--help` without doing its work: exit status 0, a usage line,
and nothing written to its working directory. Some scripts run for minutes (benchmarks/parity.py, engines.py) or
write a conversion (examples/quickstart.py); one that ignored `--help` would start that here, and fail (a script
still running after 2 minutes is stopped).
Scripts are found by globbing, so a new one is covered; `_common.py` is a module the examples import.

Bad input is refused with an error, not a traceback, that names the option and the fix: argparse's `script.py: error:
argument --steps: ...` (exit status 2), before any model is built where the value alone shows it; and where a
benchmark's child process fails, the case that failed and the child's own error (exit status 1).

Each script runs in a process of its own, forked from one launcher that has already imported torch and
transformers' model code: started one by one as `python script.py --help`, the scripts spend about 7 s of CPU each
on those same imports, most of the time this test would take. The child runs the file as `python script.py` does:
as `__main__`, with its folder first on `sys.path` and its path as `argv[0]`.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path for folder in ("benchmarks", "examples") for path in (REPOSITORY / folder).glob("*.py")
                 if not path.name.startswith("_"))

# argv: a scratch folder, then the runs as JSON, each a script's path and its arguments. Run i goes in folder/i/cwd,
# its output to folder/i/stdout and folder/i/stderr; the launcher prints the runs' exit statuses as a JSON list.
LAUNCHER = """
import json, os, runpy, signal, sys, traceback
import torch, transformers.modeling_utils  # what every script imports, imported once before forking

folder, statuses = sys.argv[1], []
for index, (script, *arguments) in enumerate(json.loads(sys.argv[2])):
    run = os.path.join(folder, str(index))
    os.makedirs(os.path.join(run, "cwd"))
    pid = os.fork()
    if pid == 0:
        status = 1
        signal.alarm(120)  # SIGALRM ends a script that does its work instead of answering
        try:
            for fd, name in ((1, "stdout"), (2, "stderr")):
                with open(os.path.join(run, name), "w") as file:
                    os.dup2(file.fileno(), fd)
            os.chdir(os.path.join(run, "cwd"))
            sys.argv, sys.path[0] = [script, *arguments], os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as exit:
            status = exit.code or 0
            if not isinstance(status, int):  # sys.exit("message"): the interpreter prints it and ends with status 1
                print(status, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(statuses))
"""


def launch(runs: list, folder: Path) -> list:
    """Each run (a script's path, then its arguments) as `python script.py ...` from a fresh working directory:
    [(exit status, stdout, stderr, what is left in its working directory)], in order."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    launched = subprocess.run([sys.executable, "-c", LAUNCHER, str(folder), json.dumps(runs)], env=env,
                              capture_output=True, text=True, timeout=600)
    assert launched.returncode == 0, launched.stderr[-3000:]
    return [(status, (folder / str(index) / "stdout").read_text(), (folder / str(index) / "stderr").read_text(),
             list((folder / str(index) / "cwd").iterdir()))
            for index, status in enumerate(json.loads(launched.stdout.splitlines()[-1]))]


@pytest.fixture(scope="module")
def helped(tmp_path_factory):
    """{script: (exit status, stdout, stderr, what is left in its working directory)}"""
    return dict(zip(SCRIPTS, launch([[str(script), "--help"] for script in SCRIPTS],
                                    tmp_path_factory.mktemp("help")), strict=True))


@pytest.mark.parametrize("script", SCRIPTS, ids=[f"{path.parent.name}/{path.name}" for path in SCRIPTS])
def test_help_answers_without_running(helped, script):
    status, stdout, stderr, left = helped[script]
    stopped = " (stopped: still running after 2 minutes)" if status == -signal.SIGALRM else ""
    assert status == 0, f"exit status {status}{stopped}\n{stderr[-3000:]}"
    assert stdout.startswith(f"usage: {script.name} "), stdout[:3000]
    assert left == []  # nothing converted, downloaded or plotted into the working directory



# name -> (the command: a script and its arguments, its exit status, words its stderr must hold). INPUTS stands for
# the folder the `refused` fixture fills: empty/, a checkpoint whose progress.json is cut off (damaged/), one with no
# weights (weightless/), a file, and tiny/ (an encoder with 32 positions).
TRAIN = ["examples/train_accelerate.py", "--cpu", "--output", "INPUTS/out"]
ERRORS = {
    "resume from an empty folder": ([*TRAIN, "--resume-from", "INPUTS/empty"], 2,
                                    ["argument --resume-from:", "no progress.json", "pass a checkpoint-N folder"]),
    "resume with a damaged progress.json": ([*TRAIN, "--resume-from", "INPUTS/damaged"], 2,
                                            ["argument --resume-from:", "its progress.json is damaged"]),
    "resume without weights": ([*TRAIN, "--resume-from", "INPUTS/weightless", "--steps", "1"], 2,
                               ["argument --resume-from:", "is incomplete", "is missing"]),
    "output is a file": (["examples/train_accelerate.py", "--output", "INPUTS/file", "--resume-from", "latest"], 2,
                         ["argument --output:", "is a file; pass a folder"]),
    "no steps": ([*TRAIN, "--steps", "0"], 2, ["argument --steps:", "at least 1, got '0'"]),
    "negative threads": ([*TRAIN, "--threads", "-1"], 2, ["argument --threads:", "at least 0"]),
    "negative checkpoint interval": ([*TRAIN, "--checkpoint-every", "-2"], 2,
                                     ["argument --checkpoint-every:", "at least 0 (0: never)"]),
    "shape without tokens": (["benchmarks/memory.py", "--shapes", "8x"], 2, ["argument --shapes:", "e.g. 8x128"]),
    "shape with a star": (["benchmarks/memory.py", "--shapes", "8*128"], 2, ["argument --shapes:", "e.g. 8x128"]),
    "shape of no rows": (["benchmarks/memory.py", "--shapes", "0x16"], 2, ["argument --shapes:", "'0x16'"]),
    "missing model folder": (["benchmarks/memory.py", "--model", "INPUTS/missing"], 2,
                             ["argument --model:", "pass a converted checkpoint's folder"]),
    "shape beyond the positions": (["benchmarks/memory.py", "--model", "INPUTS/tiny", "--runtimes", "eager",
                                    "--shapes", "1x600", "--calls", "1"], 1,
                                   ["runtime 'eager'", "1x600 failed", "600 tokens", "max_position_embeddings=32"]),
    "too few rounds": (["benchmarks/short_request_costs.py", "--rounds", "1"], 2, ["argument --rounds:", "at least 2"]),
    "missing results": (["benchmarks/charts.py", "--results", "INPUTS/missing.json"], 2,
                        ["argument --results:", "nothing is there"]),
    "no top-k": (["examples/fill_mask.py", "--top-k", "0"], 2, ["argument --top-k:", "at least 1"]),
    "lengths crossed": (["examples/train_seq2seq.py", "--min-len", "5", "--max-len", "3"], 2,
                        ["argument --min-len:", "above --max-len 3"]),
    "corpus is a folder": (["examples/sentence_similarity.py", "--corpus-file", "INPUTS/empty"], 2,
                           ["argument --corpus-file:", "a folder is there"]),
    "negative threads of an example": (["examples/embed_corpus.py", "--model", "INPUTS/tiny", "--input", "INPUTS/file",
                                        "--output", "INPUTS/out", "--threads", "-1"], 2, ["argument --threads:"]),
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """{name in ERRORS: (exit status, stdout, stderr, what is left in its working directory)}"""
    from hf_vanilla import VanillaEncoderConfig, VanillaEncoderModel

    inputs = tmp_path_factory.mktemp("inputs")
    for folder in ("empty", "damaged", "weightless"):
        (inputs / folder).mkdir()
    (inputs / "damaged" / "progress.json").write_text('{"step": 2, "losses": [0.69')
    (inputs / "weightless" / "progress.json").write_text(json.dumps(
        {"step": 1, "losses": [0.69], "untrained": {"loss": 0.69, "accuracy": 0.5}}))
    (inputs / "file").write_text("not a folder\n")
    VanillaEncoderModel(VanillaEncoderConfig(
        vocab_size=2000, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32)).save_pretrained(inputs / "tiny")
    runs = [[str(REPOSITORY / script), *(argument.replace("INPUTS", str(inputs)) for argument in arguments)]
            for (script, *arguments), _, _ in ERRORS.values()]
    return dict(zip(ERRORS, launch(runs, tmp_path_factory.mktemp("errors")), strict=True))


@pytest.mark.parametrize("name", ERRORS)
def test_bad_input_is_refused_naming_the_option_without_a_traceback(refused, name):
    _, expected_status, words = ERRORS[name]
    status, _, stderr, _ = refused[name]
    assert status == expected_status, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert all(word in stderr for word in words), (words, stderr[-3000:])
