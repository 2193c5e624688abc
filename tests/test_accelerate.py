"""Accelerate: big-model placement with CPU + disk offload, layer-boundary device maps, and real two-process
(gloo) data-parallel training with save/resume, and a run whose process is SIGKILLed resuming where it stopped.
All on CPU; the GPU checks live in test_gpu.py."""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch
from accelerate.state import AcceleratorState
from numerics import assert_close
from safetensors.torch import load_file
from test_examples import load_example
from transformers import AutoModelForSequenceClassification

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForMaskedLM,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

ROOT = Path(__file__).resolve().parents[1]
INSIDE_A_LAYER = re.compile(r"layers\.\d+\.")  # a device-map key below a layer means the layer was cut


def encoder_config():
    return VanillaEncoderConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=64)


def seq2seq_config():
    return VanillaSeq2SeqConfig(vocab_size=500, hidden_size=64, num_hidden_layers=3, decoder_layers=3,
                                num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)


def model_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("accelerate")
    encoder = VanillaEncoderForMaskedLM(encoder_config()).eval()
    seq2seq = VanillaSeq2SeqForConditionalGeneration(seq2seq_config()).eval()
    encoder.save_pretrained(root / "encoder")
    seq2seq.save_pretrained(root / "seq2seq")
    return root, encoder, seq2seq


def padded_batch(vocab_size):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab_size, (3, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0
    attention_mask[2, 4:] = 0
    return input_ids, attention_mask


def assert_offloaded_at_layer_boundaries(device_map):
    assert {"cpu", "disk"} <= set(device_map.values()), f"expected a CPU + disk split, got {device_map}"
    cut = [key for key in device_map if INSIDE_A_LAYER.search(key)]
    assert not cut, f"the device map cuts layers in two: {cut}"


@pytest.mark.parametrize("kind", ["encoder", "seq2seq"])
def test_cpu_and_disk_offload_matches_plain_load(kind, saved, tmp_path):
    """Half the model on the CPU, the rest on disk, split between layers: the same logits as the plain load, and for
    the encoder-decoder the same greedy and beam-search `generate()`."""
    root, *models = saved
    model = dict(zip(("encoder", "seq2seq"), models))[kind]
    offloaded = type(model).from_pretrained(root / kind, device_map="auto",
                                            max_memory={"cpu": model_bytes(model) // 2},
                                            offload_folder=tmp_path / "offload")
    assert_offloaded_at_layer_boundaries(offloaded.hf_device_map)
    input_ids, attention_mask = padded_batch(model.config.vocab_size)
    if kind == "seq2seq":
        for options in ({"do_sample": False}, {"num_beams": 3, "do_sample": False}):
            with torch.no_grad():
                expected = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, **options)
                actual = offloaded.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, **options)
            assert torch.equal(actual, expected), options
    labels = {"labels": input_ids[:, :6]} if kind == "seq2seq" else {}  # the decoder reads the shifted labels
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask, **labels).logits
        actual = offloaded(input_ids=input_ids, attention_mask=attention_mask, **labels).logits
    assert_close(actual, expected)


@pytest.mark.parametrize("make_config, model_class", [
    (encoder_config, VanillaEncoderForMaskedLM),
    (seq2seq_config, VanillaSeq2SeqForConditionalGeneration),
])
@pytest.mark.parametrize("fraction", [0.2, 0.45, 0.7])
def test_inferred_maps_split_only_between_layers_and_keep_tied_weights_together(make_config, model_class, fraction):
    with init_empty_weights():
        model = model_class(make_config())
    model.tie_weights()  # init_empty_weights leaves ties undone in transformers 5.23
    budget = int(model_bytes(model) * fraction)
    device_map = infer_auto_device_map(model, max_memory={"cpu": budget, "disk": 10**12},
                                       no_split_module_classes=model._no_split_modules)
    assert not [key for key in device_map if INSIDE_A_LAYER.search(key)], device_map

    def device_of(name):  # the entry covering a parameter: its longest matching prefix in the map
        return device_map[max((k for k in device_map if k == "" or name.startswith(k + ".")), key=len)]

    for target, source in model.get_expanded_tied_weights_keys(all_submodels=True).items():
        assert device_of(target) == device_of(source), (target, source, device_map)


def test_load_checkpoint_and_dispatch_with_offload(saved, tmp_path):
    root, encoder, _ = saved
    with init_empty_weights():
        empty = VanillaEncoderForMaskedLM(encoder.config)
    empty.tie_weights()
    dispatched = load_checkpoint_and_dispatch(
        empty, str(root / "encoder" / "model.safetensors"), device_map="auto",
        max_memory={"cpu": model_bytes(encoder) // 2},  # what does not fit goes to disk
        no_split_module_classes=empty._no_split_modules, offload_folder=str(tmp_path / "offload"),
    )
    assert_offloaded_at_layer_boundaries(dispatched.hf_device_map)
    dispatched.eval()  # unlike from_pretrained, dispatch leaves the model in training mode (dropout on)
    input_ids, attention_mask = padded_batch(encoder.config.vocab_size)
    with torch.no_grad():
        expected = encoder(input_ids=input_ids, attention_mask=attention_mask).logits
        actual = dispatched(input_ids=input_ids, attention_mask=attention_mask).logits
    assert_close(actual, expected)


def free_port() -> int:
    """A port no other process holds now: the machine may run other test sessions that launch processes too."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(script, *args, processes=1, restarts=0, env=None):
    """examples/`script` in `processes` processes of one thread each (torchrun: real MULTI_CPU over gloo); with
    `restarts`, torchrun restarts the whole group that many times when a process dies, each attempt on a store of
    its own (the launch train_accelerate.py asks for)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    if restarts:
        launcher += ["--standalone", "--max-restarts", str(restarts)]
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    elif processes > 1:
        launcher += ["--master_port", str(free_port())]
    else:
        launcher = [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([*launcher, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def run_training(*args, processes=1, restarts=0, env=None):
    """examples/train_accelerate.py on CPU; fails the test unless it succeeds."""
    result = launch("train_accelerate.py", "--cpu", *args, processes=processes, restarts=restarts, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_two_process_training_keeps_ranks_identical_and_saves_a_loadable_model(tmp_path):
    result = run_training("--task", "classification", "--output", str(tmp_path), "--steps", "4", "--batch-size", "4",
                          "--save-rank-weights", processes=2)
    assert re.search(r"held-out \(256 examples\): loss \d\.\d+ \(untrained \d\.\d+; .*accuracy", result.stdout)
    rank0 = load_file(tmp_path / "rank0.safetensors")
    rank1 = load_file(tmp_path / "rank1.safetensors")
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), f"ranks disagree on {key}"
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    assert type(loaded).__name__ == "VanillaEncoderForSequenceClassification"
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, rank0[key]), f"saved model differs from rank 0 on {key}"


@pytest.mark.parametrize("task", ["classification", pytest.param("seq2seq", marks=pytest.mark.slow)])
def test_resume_from_saved_state_is_exact_with_dropout_on(task, tmp_path):
    """Dropout (0.1 on embeddings, sub-layers, attention weights and the classifier) draws new masks every step and
    the sampler shuffles: a resumed run replays both only if every random state comes back with the weights."""
    common = ["--task", task, "--steps", "6", "--batch-size", "4", "--dropout", "0.1", "--save-rank-weights"]
    run_training(*common, "--output", str(tmp_path / "straight"), "--checkpoint-every", "3")
    result = run_training(*common, "--output", str(tmp_path / "resumed"),
                          "--resume-from", str(tmp_path / "straight" / "checkpoint-3"))
    assert "resumed from" in result.stdout and "at step 3" in result.stdout
    straight = load_file(tmp_path / "straight" / "rank0.safetensors")
    resumed = load_file(tmp_path / "resumed" / "rank0.safetensors")
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), key  # bit for bit: the same ops on the same inputs
    losses = [json.loads((tmp_path / run / "losses.json").read_text()) for run in ("straight", "resumed")]
    assert losses[0] == losses[1] and len(losses[0]) == 6


KILL_AT_STEP = "TRAIN_ACCELERATE_KILL_AT_STEP"  # the example's testing hook: its last process SIGKILLs itself


def assert_same_run(actual, expected, processes):
    """Two runs' final weights on every process and per-step losses, bit for bit (the same ops on the same inputs,
    data order and dropout masks)."""
    for rank in range(processes):
        expected_weights = load_file(expected / f"rank{rank}.safetensors")
        actual_weights = load_file(actual / f"rank{rank}.safetensors")
        assert actual_weights.keys() == expected_weights.keys()
        for key in expected_weights:
            assert torch.equal(actual_weights[key], expected_weights[key]), (rank, key)
    losses = [json.loads((run / "losses.json").read_text()) for run in (actual, expected)]
    assert losses[0] == losses[1], losses


class Killed(BaseException):
    """What SIGKILL does to the process, for a run inside the test's process: it stops where it is (BaseException:
    no `except Exception` on the way catches it)."""


def train_in_process(monkeypatch, *args, kill_at_step=None):
    """examples/train_accelerate.py's main() in this process, on one thread (as its own process would be), with
    Accelerate's process-wide state reset after it whatever the outcome; `os.kill(own pid, SIGKILL)` raises Killed,
    and `kill_at_step` sets the example's hook for this run."""
    example = load_example("train_accelerate.py")

    def kill(pid, sig):
        assert (pid, sig) == (os.getpid(), signal.SIGKILL)
        raise Killed

    threads = torch.get_num_threads()
    with monkeypatch.context() as patch:
        patch.setattr(os, "kill", kill)
        patch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
        if kill_at_step is not None:
            patch.setenv(KILL_AT_STEP, str(kill_at_step))
        try:
            return example.main(["--cpu", *args])
        finally:
            torch.set_num_threads(threads)
            AcceleratorState._reset_state(reset_partial_state=True)


def test_a_killed_run_resumes_from_its_last_whole_checkpoint(tmp_path, monkeypatch, capsys):
    """Killed halfway through writing checkpoint-4 (its testing hook, TRAIN_ACCELERATE_KILL_AT_STEP), a run leaves
    checkpoint-4.partial, never a checkpoint-4 that looks whole; the same command again (`--resume-from latest`)
    resumes from checkpoint-2, replays steps 3-6, writes checkpoint-4 in place of the .partial, and ends with the
    weights and per-step losses of an uninterrupted run, bit for bit. In this process, so that it takes seconds: the
    real SIGKILL of a process under torchrun's restart is the slow test below."""
    common = ["--task", "classification", "--steps", "6", "--batch-size", "4", "--dropout", "0.1",
              "--checkpoint-every", "2", "--save-rank-weights"]
    train_in_process(monkeypatch, *common, "--output", str(tmp_path / "straight"))
    killed = tmp_path / "killed"
    command = [*common, "--output", str(killed), "--resume-from", "latest"]
    with pytest.raises(Killed):
        train_in_process(monkeypatch, *command, kill_at_step=4)
    assert sorted(p.name for p in killed.iterdir()) == ["checkpoint-2", "checkpoint-4.partial"]
    assert not (killed / "checkpoint-4.partial" / "progress.json").exists()
    capsys.readouterr()
    train_in_process(monkeypatch, *command)
    assert f"resumed from {killed / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    assert sorted(p.name for p in killed.iterdir()) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6", "final", "losses.json", "rank0.safetensors"]
    assert_same_run(killed, tmp_path / "straight", processes=1)


@pytest.mark.slow
def test_torchrun_restarts_a_group_whose_process_was_killed(tmp_path):
    """Two processes under `torchrun --max-restarts 1`; rank 1 SIGKILLs itself after step 5 on the first attempt,
    torchrun ends rank 0 and starts both again with the same command, which resume from checkpoint-4 and replay
    steps 5-6: every rank's weights and the losses equal an uninterrupted two-process run's, bit for bit. A rerun
    of the finished run changes nothing."""
    common = ["--task", "classification", "--steps", "6", "--batch-size", "4", "--dropout", "0.1",
              "--checkpoint-every", "2", "--save-rank-weights", "--resume-from", "latest"]
    run_training(*common, "--output", str(tmp_path / "straight"), processes=2)
    killed = tmp_path / "killed"
    result = run_training(*common, "--output", str(killed), processes=2, restarts=1, env={KILL_AT_STEP: "5"})
    assert "exitcode: -9" in result.stderr  # the kill was real, and torchrun saw it
    assert f"resumed from {killed / 'checkpoint-4'} at step 4" in result.stdout
    assert sorted(p.name for p in killed.iterdir()) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6", "final", "losses.json", "rank0.safetensors",
        "rank1.safetensors"]
    assert_same_run(killed, tmp_path / "straight", processes=2)
    written = {p: p.stat().st_mtime_ns for p in killed.rglob("*")}
    rerun = run_training(*common, "--output", str(killed), processes=2, restarts=1)
    assert "holds a finished run" in rerun.stdout
    assert {p: p.stat().st_mtime_ns for p in killed.rglob("*")} == written


def test_a_restartable_launch_on_a_shared_store_is_refused(monkeypatch):
    """torchrun --max-restarts on a store kept across attempts: a restarted group would read the dead attempt's
    addresses and hang, so the example refuses it before training."""
    restarts_would_hang = load_example("train_accelerate.py").restarts_would_hang
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's default, static rendezvous
    assert restarts_would_hang()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    assert not restarts_would_hang()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # nothing restarts
    assert not restarts_would_hang()


def test_every_dropout_follows_the_flag():
    build_model = load_example("train_accelerate.py").build_model
    for task in ("classification", "seq2seq"):
        model = build_model(argparse.Namespace(task=task, model=None, width=32, dropout=0.25))
        rates = {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)}
        rates |= {module.dropout for module in model.modules() if type(module).__name__ == "VanillaAttention"}
        assert rates == {0.25}, (task, rates)
