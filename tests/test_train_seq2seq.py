"""examples/train_seq2seq.py: the paper's training recipe teaches a randomly initialised model to reverse digit
strings, measured by greedy `generate()` on held-out strings (chance is ~0: every digit of every string must be
right)."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from numerics import assert_close

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_seq2seq.py"


@pytest.fixture(scope="module")
def train_seq2seq():
    spec = importlib.util.spec_from_file_location("train_seq2seq", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_batches_pair_each_string_with_its_reversal(train_seq2seq):
    t = train_seq2seq
    digits = [torch.tensor([3, 1, 4]), torch.tensor([1, 5])]
    input_ids, attention_mask, labels = t.make_batch(digits)
    d = t.DIGIT_OFFSET
    assert input_ids.tolist() == [[3 + d, 1 + d, 4 + d, t.EOS], [1 + d, 5 + d, t.EOS, t.PAD]]
    assert attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert labels.tolist() == [[4 + d, 1 + d, 3 + d, t.EOS], [5 + d, 1 + d, t.EOS, -100]]


def test_noam_schedule_warms_up_linearly_then_decays_as_inverse_square_root(train_seq2seq):
    noam_lr = train_seq2seq.noam_lr
    E, warmup = 128, 400
    peak = noam_lr(warmup, E, warmup)
    assert_close(peak, E**-0.5 * warmup**-0.5, dtype=torch.float64)  # Python floats: float64 arithmetic
    assert_close(noam_lr(warmup // 4, E, warmup), peak / 4, dtype=torch.float64)  # linear warm-up
    assert_close(noam_lr(4 * warmup, E, warmup), peak / 2, dtype=torch.float64)  # step^-0.5 decay
    assert max(noam_lr(step, E, warmup) for step in range(1, 10 * warmup)) == peak  # the peak is one of the steps


def test_a_scaled_down_run_learns_to_reverse_held_out_strings(train_seq2seq, capsys):
    args = ["--steps", "300", "--hidden-size", "64", "--ffn-size", "128", "--max-len", "5", "--batch-size", "32",
            "--warmup", "100", "--lr-factor", "0.5", "--eval-size", "200"]
    threads = torch.get_num_threads()
    try:
        accuracy = train_seq2seq.main(args)
    finally:
        torch.set_num_threads(threads)  # main() sets it for the whole process
    printed = re.search(r"^exact-match accuracy: (\d\.\d{3})$", capsys.readouterr().out, re.MULTILINE)
    # Printed with three decimals: within half a unit of the last digit (a printing bound, not a rounding rule).
    assert printed is not None and abs(float(printed.group(1)) - accuracy) <= 5e-4
    assert accuracy >= 0.8  # 0.985 when written; a model that had not learned the task scores ~0
