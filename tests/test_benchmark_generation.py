"""benchmarks/generation.py on a tiny Marian-shaped model, in a process of its own as a user runs it: its JSON names
every contender, and each one either generated exactly 64 tokens a row (a float32 contender exactly transformers'
tokens) or says why it did not run."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "generation.py"


def benchmark_module(monkeypatch):
    """benchmarks/generation.py as a module (it imports only numpy and benchmarks/_cli.py at the top)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("generation_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a process per contender, each importing torch and transformers: 40-60 s on 2 cores
def test_every_contender_generates_the_reference_tokens_or_says_why(tmp_path, monkeypatch):
    benchmark = benchmark_module(monkeypatch)
    output = tmp_path / "run.json"
    command = [sys.executable, str(SCRIPT), "--layers", "2", "--width", "32", "--vocab", "200", "--rounds", "1",
               "--cases", "beam-8", "--no-compile", "--output", str(output)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(output.read_text())
    assert list(record["contenders"]) == list(benchmark.CONTENDERS)
    results = record["cases"]["beam-8"]["contenders"]
    assert list(results) == list(benchmark.CONTENDERS)
    assert record["contenders"]["transformers compiled"] == {"precision": "fp32", "status": "left out",
                                                             "reason": "--no-compile", "ready_s": None}
    for name, contender in record["contenders"].items():
        figures = results[name]
        if contender["status"] != "ran":  # not "failed": that is an error of the benchmark or the engine
            assert contender["status"] in ("unavailable", "left out") and contender["reason"], (name, contender)
            assert figures == {contender["status"]: contender["reason"]}, name
            continue
        assert figures["tokens_per_row"] == [benchmark.NEW_TOKENS], name
        assert len(figures["first_calls_ms"]) == 2 and len(figures["rounds_ms"]) == 1, name
        if figures["precision"] == "fp32":
            assert figures["tokens_equal"] == 1.0, name
        else:
            assert 0.0 <= figures["tokens_equal"] <= 1.0, name
    assert record["contenders"]["transformers"]["status"] == "ran"
    assert results["transformers"]["speedup"] == 1.0
