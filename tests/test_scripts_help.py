"""Every script in benchmarks/ and examples/ answers `--help` without doing its work: exit status 0, a usage line,
and nothing written to its working directory. Some scripts run for minutes (benchmarks/parity.py, engines.py) or
write a conversion (examples/quickstart.py); one that ignored `--help` would start that here, and fail (a script
still running after 2 minutes is stopped).
Scripts are found by globbing, so a new one is covered; `_common.py` is a module the examples import.

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

# argv: a scratch folder, then the scripts. Script i runs in folder/i/cwd, its output goes to folder/i/stdout and
# folder/i/stderr; the launcher prints {script: exit status}.
LAUNCHER = """
import json, os, runpy, signal, sys, traceback
import torch, transformers.modeling_utils  # what every script imports, imported once before forking

folder, statuses = sys.argv[1], {}
for index, script in enumerate(sys.argv[2:]):
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
            sys.argv, sys.path[0] = [script, "--help"], os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as exit:
            status = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    statuses[script] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(statuses))
"""


@pytest.fixture(scope="module")
def helped(tmp_path_factory):
    """{script: (exit status, stdout, stderr, what is left in its working directory)}"""
    folder = tmp_path_factory.mktemp("help")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    launched = subprocess.run([sys.executable, "-c", LAUNCHER, str(folder), *map(str, SCRIPTS)], env=env,
                              capture_output=True, text=True, timeout=600)
    assert launched.returncode == 0, launched.stderr[-3000:]
    statuses = json.loads(launched.stdout.splitlines()[-1])
    return {Path(script): (status, (folder / str(index) / "stdout").read_text(),
                           (folder / str(index) / "stderr").read_text(), list((folder / str(index) / "cwd").iterdir()))
            for index, (script, status) in enumerate(statuses.items())}


@pytest.mark.parametrize("script", SCRIPTS, ids=[f"{path.parent.name}/{path.name}" for path in SCRIPTS])
def test_help_answers_without_running(helped, script):
    status, stdout, stderr, left = helped[script]
    stopped = " (stopped: still running after 2 minutes)" if status == -signal.SIGALRM else ""
    assert status == 0, f"exit status {status}{stopped}\n{stderr[-3000:]}"
    assert stdout.startswith(f"usage: {script.name} "), stdout[:3000]
    assert left == []  # nothing converted, downloaded or plotted into the working directory
