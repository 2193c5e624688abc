"""The one tolerance rule for every numeric comparison in tests/: the converters' parity rule.

The rule and its table live in `hf_vanilla/conversion/parity.py` (with the reasons for each figure), so that a
converter verifying itself and a test checking it hold outputs to the same bound:

    |actual - expected| <= TOLERANCE[dtype] * max(1, max |expected|)        (rtol 0)

over the elements that carry meaning (real tokens, not padding), where `dtype` is the precision the *compared*
computation ran in: float32 1e-5, float16 1e-2, bfloat16 5e-2 (against a float32 reference), float64 1e-12.

float64 serves claims of exactness (causality, prefix or padding invariance, cache against no cache) made where they
are exact up to rounding that float64 makes negligible: run the model with `.double()`. Such a claim is also checked
in float32, at the float32 rule, since float32 is what users run, unless the compared value is a small difference of
large intermediates (a beam's log-probability sum, from logits ten times its size): its rounding scales with the
intermediates, which the rule does not see, so float64 alone checks it.

Bit-for-bit claims (`torch.equal`) are made only where the kernels guarantee them: the same op on the same shapes
and the same memory (a conversion round trip, a cache that stores what it was given, a deterministic kernel run
twice, a copy of a tensor).

A comparison of another kind says why where it is made (a cosine similarity that claims an embedding keeps its
direction is a quality claim, not a rounding bound).

`python tests/kernel_variants.py` runs the tests marked `numerics` again under other kernel choices (256-bit
vectors, no oneDNN, one thread), so that a tolerance that holds only for this CPU's summation order fails here rather
than on the next machine. With HF_VANILLA_MARGIN_LOG=FILE set, every `assert_close` appends the ratio
|diff| / tolerance it saw to FILE (one JSON object a line); the runner prints the largest of each variant.
"""

import json
import os

import torch

from hf_vanilla.conversion.parity import as_float64, precision, tolerance

__all__ = ["assert_close"]


def assert_close(actual, expected, dtype: torch.dtype | None = None, msg: str | None = None) -> None:
    """Assert the rule above. `dtype` names the precision of the compared computation when it differs from
    `actual`'s (a bfloat16 run widened to float32 before the comparison). Tensors, numpy arrays and numbers are
    all compared in float64. `msg` names what is compared; it is put in front of torch's report (the greatest
    difference, where, and the tolerance)."""
    atol = tolerance(expected, dtype or precision(actual))
    actual, expected = as_float64(actual), as_float64(expected)
    log = os.environ.get("HF_VANILLA_MARGIN_LOG")
    if log and actual.shape == expected.shape and actual.numel():
        with open(log, "a") as file:  # the test's node id, without pytest's "(call)" suffix
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            worst = (actual - expected).abs().max().item()
            file.write(json.dumps({"test": test, "ratio": worst / atol}) + "\n")
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, check_device=False,
                               msg=None if msg is None else lambda default: f"{msg}: {default}")
