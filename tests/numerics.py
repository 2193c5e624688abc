"""The one tolerance rule for every numeric comparison in tests/.

Two computations of the same float32 function that sum in different orders (another kernel, another shape,
another CPU's vector width, another thread count) differ by rounding, and rounding scales with the magnitude of
what is computed. So every comparison is made as

    |actual - expected| <= TOLERANCE[dtype] * max(1, max |expected|)        (rtol 0)

over the elements that carry meaning (real tokens, not padding), where `dtype` is the precision the *compared*
computation ran in:

- float32: 1e-5, about 170 units of float32 roundoff (u = 2^-24 = 6e-8). A transformer layer sums thousands of
  products (K up to 3072 in bert-base) through a dozen layers; kernel-to-kernel differences measured on AMD Zen 3/4
  and Intel Xeon are 0.5e-6 to 5e-6 of the magnitude, so 1e-5 holds on any x86 CPU yet is some 1000x below what a
  wrong mask, a swapped weight or a missing scale produces (1e-2 and up).
- float16 / bfloat16 against a float32 reference: 8 units of their roundoff per compared value (2^-11 and 2^-8),
  1e-2 and 5e-2 relative to the magnitude: the output is rounded to that precision after every op.
- float64: 1e-12, for claims of exactness (causality, prefix or padding invariance) made where they are exact
  up to rounding that float64 makes negligible.

Bit-for-bit claims (`atol=0`) are made only where the kernels guarantee them: the same op on the same shapes
(a conversion round trip, a cache that stores what it was given, a deterministic kernel run twice).
"""

import torch

TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}


def tolerance(expected: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """The absolute tolerance for comparing against `expected`, computed in `dtype` (default: expected's)."""
    dtype = dtype or expected.dtype
    magnitude = expected.detach().abs().max().item() if expected.numel() else 0.0
    return TOLERANCE[dtype] * max(1.0, magnitude)


def assert_close(actual, expected, dtype: torch.dtype | None = None, msg: str | None = None) -> None:
    """Assert the rule above. `dtype` names the precision of the compared computation when it differs from
    `expected`'s (a bfloat16 run checked against a float32 reference). Tensors are compared in float64, so the
    comparison itself adds no rounding."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    dtype = dtype or (actual.dtype if actual.dtype in TOLERANCE else torch.float32)
    torch.testing.assert_close(
        actual.detach().double(), expected.detach().double(), rtol=0, atol=tolerance(expected, dtype), msg=msg,
        check_device=False,
    )
