"""The one tolerance rule for every numeric comparison in tests/.

Two computations of the same float32 function that sum in different orders (another kernel, another shape,
another CPU's vector width or cache blocking, another thread count) differ by rounding, and rounding scales with the
magnitude of what is computed. So every comparison is made as

    |actual - expected| <= TOLERANCE[dtype] * max(1, max |expected|)        (rtol 0)

over the elements that carry meaning (real tokens, not padding), where `dtype` is the precision the *compared*
computation ran in:

- float32: 1e-5, about 170 units of float32 roundoff (u = 2^-24 = 6e-8). A transformer layer sums thousands of
  products (K up to 3072 in bert-base) through a dozen layers; kernel-to-kernel differences measured on AMD Zen 3/4
  and Intel Xeon are 0.5e-6 to 5e-6 of the magnitude, so 1e-5 holds on any x86 CPU yet is some 1000x below what a
  wrong mask, a swapped weight or a missing scale produces (1e-2 and up).
- float16 / bfloat16 against a float32 reference: 1e-2 and 5e-2 of the magnitude. Every op's output is rounded to
  11 (float16) or 8 (bfloat16) significant bits, u = 2^-11 = 4.9e-4 and 2^-8 = 3.9e-3, and a dozen layers of
  residual sums, LayerNorms and softmaxes compound it: on real text the worst hidden-state element of a random
  bert-base-shaped encoder reaches 0.26 (float16) and 0.34 (bfloat16) of these limits by its 12th layer, the real
  MiniLM's 0.09 and 0.14 (tests/test_inputs.py, every layer, both attention paths; AMD EPYC Zen 4, 2026-11-23). A
  model run in half precision with a wrong mask or a lost scale is off by the magnitude itself.
- float64: 1e-12, for claims of exactness (causality, prefix or padding invariance, cache against no cache) made
  where they are exact up to rounding that float64 makes negligible (u = 1.1e-16): run the model with `.double()`.
  Such a claim is also checked in float32, at the float32 rule, since float32 is what users run, unless the
  compared value is a small difference of large intermediates (a beam's log-probability sum, from logits ten times
  its size): its rounding scales with the intermediates, which the rule does not see, so float64 alone checks it.

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

TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}


def _float64(x) -> torch.Tensor:
    """A tensor, numpy array or number, in float64: the comparison itself adds no rounding."""
    return x.detach().double() if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)


def _precision(x) -> torch.dtype:
    """The dtype a tensor or numpy array was computed in. A Python number does not say (a pipeline's score is a
    float32 result, a learning rate a float64 one), so comparing numbers needs `dtype=`."""
    if not hasattr(x, "dtype"):
        raise TypeError(f"{type(x).__name__} has no dtype: pass dtype= (the precision that computed it)")
    dtype = x.dtype if isinstance(x, torch.Tensor) else torch.as_tensor(x).dtype
    return dtype if dtype in TOLERANCE else torch.float32


def tolerance(expected, dtype: torch.dtype | None = None) -> float:
    """The absolute tolerance for comparing against `expected`, computed in `dtype` (default: expected's)."""
    dtype = dtype or _precision(expected)
    expected = _float64(expected)
    magnitude = expected.abs().max().item() if expected.numel() else 0.0
    return TOLERANCE[dtype] * max(1.0, magnitude)


def assert_close(actual, expected, dtype: torch.dtype | None = None, msg: str | None = None) -> None:
    """Assert the rule above. `dtype` names the precision of the compared computation when it differs from
    `actual`'s (a bfloat16 run widened to float32 before the comparison). Tensors, numpy arrays and numbers are
    all compared in float64. `msg` names what is compared; it is put in front of torch's report (the greatest
    difference, where, and the tolerance)."""
    atol = tolerance(expected, dtype or _precision(actual))
    actual, expected = _float64(actual), _float64(expected)
    log = os.environ.get("HF_VANILLA_MARGIN_LOG")
    if log and actual.shape == expected.shape and actual.numel():
        with open(log, "a") as file:  # the test's node id, without pytest's "(call)" suffix
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            worst = (actual - expected).abs().max().item()
            file.write(json.dumps({"test": test, "ratio": worst / atol}) + "\n")
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, check_device=False,
                               msg=None if msg is None else lambda default: f"{msg}: {default}")
