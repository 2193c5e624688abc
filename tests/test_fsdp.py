"""FSDP2, run for real: examples/train_accelerate.py --fsdp on two CPU processes over gloo (torchrun), for the
encoder (classification) and the encoder-decoder.

The claims: FSDP on two processes with batch B each follows the loss curve of one process with batch 2B (the same
global batches); every process ends with the same full weights; the encoder-decoder's three tied matrices (source
and target embeddings, output projection) are still one matrix after training; and both checkpoint forms, the full
state dict gathered on the main process and the per-process shards merged with Accelerate's `merge_fsdp_weights`
(`accelerate merge-weights`), load with `from_pretrained` and equal the trained weights."""

import json

import pytest
import torch
from accelerate.utils import merge_fsdp_weights
from numerics import assert_close
from safetensors.torch import load_file
from test_accelerate import run_training
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

from hf_vanilla import VanillaEncoderForSequenceClassification, VanillaSeq2SeqForConditionalGeneration

AUTO_CLASSES = {"classification": AutoModelForSequenceClassification, "seq2seq": AutoModelForSeq2SeqLM}
MODEL_CLASSES = {"classification": VanillaEncoderForSequenceClassification,
                 "seq2seq": VanillaSeq2SeqForConditionalGeneration}
TIED = ["model.encoder.embeddings.word_embeddings.weight", "model.decoder.embeddings.word_embeddings.weight",
        "lm_head.decoder.weight"]


def reload_checkpoint(task, checkpoint, form):
    """The model in a save_state checkpoint, loaded the way a user would: a full state dict (one file written by
    the main process) goes to `from_pretrained` as `state_dict`; shards are first merged into model.safetensors."""
    if form == "full":
        state_dict = torch.load(checkpoint / "pytorch_model_fsdp.bin", weights_only=True)
        return MODEL_CLASSES[task].from_pretrained(None, config=AutoConfig.from_pretrained(checkpoint),
                                                   state_dict=state_dict)
    merge_fsdp_weights(str(checkpoint / "pytorch_model_fsdp_0"), str(checkpoint))
    return AUTO_CLASSES[task].from_pretrained(checkpoint)


def assert_equals_weights(model, weights, what):
    state = model.state_dict()
    assert state.keys() == weights.keys(), what
    for key, tensor in state.items():
        assert torch.equal(tensor, weights[key]), f"{what} differs from the trained weights on {key}"


@pytest.mark.parametrize("task, form", [("classification", "full"), ("seq2seq", "sharded")])
def test_fsdp_on_two_processes_trains_like_one_and_saves_loadable_checkpoints(task, form, tmp_path):
    # Dropout off: the two runs draw their masks in different processes, so only the deterministic part compares.
    common = ["--task", task, "--steps", "4", "--grad-accum", "2", "--width", "32", "--dropout", "0"]
    run_training(*common, "--batch-size", "8", "--output", str(tmp_path / "one"))
    result = run_training(*common, "--batch-size", "4", "--fsdp", form, "--checkpoint-every", "4",
                          "--save-rank-weights", "--output", str(tmp_path / "fsdp"), processes=2)
    assert "DistributedType.FSDP, 2 processes" in result.stderr  # the progress bar names what ran

    one, fsdp = (json.loads((tmp_path / run / "losses.json").read_text()) for run in ("one", "fsdp"))
    assert len(one) == len(fsdp) == 4
    assert_close(torch.tensor(fsdp), torch.tensor(one), dtype=torch.float32)  # float32 sums in another order

    rank0, rank1 = (load_file(tmp_path / "fsdp" / f"rank{rank}.safetensors") for rank in (0, 1))
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), f"processes disagree on {key}"
    if task == "seq2seq":
        for key in TIED[1:]:
            assert torch.equal(rank0[key], rank0[TIED[0]]), f"{key} came untied from {TIED[0]}"

    final = AUTO_CLASSES[task].from_pretrained(tmp_path / "fsdp" / "final")
    assert type(final).__name__.startswith("Vanilla")
    config = json.loads((tmp_path / "fsdp" / "final" / "config.json").read_text())
    assert all(name.startswith(("modeling_encoder.Vanilla", "modeling_seq2seq.Vanilla"))
               for key, name in config["auto_map"].items()
               if key != "AutoConfig"), config["auto_map"]  # not the FSDP-generated subclass
    assert_equals_weights(final, rank0, "final/")
    assert_equals_weights(reload_checkpoint(task, tmp_path / "fsdp" / "checkpoint-4", form), rank0,
                          f"the {form} checkpoint")


@pytest.mark.slow
def test_fsdp_resume_from_sharded_state_is_exact_with_dropout_on(tmp_path):
    """load_state puts each process's shard of weights and optimizer state back, with its random generators."""
    common = ["--task", "seq2seq", "--steps", "6", "--batch-size", "4", "--width", "32", "--dropout", "0.1",
              "--fsdp", "sharded", "--save-rank-weights"]
    run_training(*common, "--output", str(tmp_path / "straight"), "--checkpoint-every", "3", processes=2)
    run_training(*common, "--output", str(tmp_path / "resumed"),
                 "--resume-from", str(tmp_path / "straight" / "checkpoint-3"), processes=2)
    straight, resumed = (load_file(tmp_path / run / "rank0.safetensors") for run in ("straight", "resumed"))
    differing = [key for key in straight if not torch.equal(straight[key], resumed[key])]
    assert straight.keys() == resumed.keys() and not differing, differing
    assert (json.loads((tmp_path / "straight" / "losses.json").read_text()) ==
            json.loads((tmp_path / "resumed" / "losses.json").read_text()))
