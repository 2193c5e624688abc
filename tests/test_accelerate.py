"""Accelerate: big-model placement with CPU + disk offload, layer-boundary device maps, and real two-process
(gloo) data-parallel training with save/resume. All on CPU; the GPU checks live in test_gpu.py."""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch
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


def launch(script, *args, processes=1, env=None):
    """examples/`script` in `processes` processes of one thread each (torchrun: real MULTI_CPU over gloo)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                "--master_port", str(free_port())] if processes > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([*launcher, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def run_training(*args, processes=1):
    """examples/train_accelerate.py on CPU; fails the test unless it succeeds."""
    result = launch("train_accelerate.py", "--cpu", *args, processes=processes)
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


def test_every_dropout_follows_the_flag():
    build_model = load_example("train_accelerate.py").build_model
    for task in ("classification", "seq2seq"):
        model = build_model(argparse.Namespace(task=task, model=None, width=32, dropout=0.25))
        rates = {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)}
        rates |= {module.dropout for module in model.modules() if type(module).__name__ == "VanillaAttention"}
        assert rates == {0.25}, (task, rates)
