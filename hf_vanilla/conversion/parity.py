"""The one parity rule: how close a converted model's outputs must be to the model it was converted from.

Two computations of the same function that sum in different orders (another kernel, another shape, another CPU's
vector width, another thread count) differ by rounding, and rounding scales with the magnitude of what is computed.
So every comparison, in the converters and in tests/ alike (tests/numerics.py imports this rule), is

    |actual - expected| <= TOLERANCE[dtype] * max(1, max |expected|)        (rtol 0)

over the elements that carry meaning (real tokens, not padding), where `dtype` is the precision the *compared*
computation ran in (a model saved with --dtype float16 is compared, in float16, with its float32 source):

- float32: 1e-5, about 170 units of float32 roundoff (u = 2^-24 = 6e-8). A transformer layer sums thousands of
  products through a dozen layers; kernel-to-kernel differences measured on AMD and Intel CPUs are 0.5e-6 to 5e-6
  of the magnitude, so 1e-5 holds on any x86 CPU yet is three orders of magnitude below what a wrong mask, a swapped
  weight or a missing scale produces (1e-2 and up). A whole encoder-decoder's logits are held to it too: they are one more
  projection of the decoder's last state, and the rule scales with their magnitude (BERT's logits over a 30k
  vocabulary reach tens). Measured on the test checkpoints (tests/test_convert_seq2seq.py, test_convert_marian.py,
  test_convert_bart.py; the largest |diff| / tolerance, fp32): bert2bert and
  warm-start logits 0.10, their hidden states 0.035; Marian 0.043; BART 0.013. The whole model sums more rounding
  than one stack, but not enough to need the looser 5e-5 absolute bound the seq2seq converters used before.
- float16 / bfloat16 against a float32 reference: 1e-2 and 5e-2 of the magnitude. Every op's output is rounded to
  11 (float16) or 8 (bfloat16) significant bits, u = 4.9e-4 and 3.9e-3, and a dozen layers of residual sums,
  LayerNorms and softmaxes compound it (a random bert-base-shaped encoder reaches 0.26 and 0.34 of these limits by
  its 12th layer, the real MiniLM 0.09 and 0.14). A model run in half precision with a wrong mask, a lost scale, or an
  output beyond its range (Inf, then NaN) is off by the magnitude itself.
- float64: 1e-12, for claims of exactness up to rounding that float64 makes negligible (u = 1.1e-16).

Generated text is compared as tokens, equal or not (`compare_generation`), and only in float32: rounding in half
precision may rightly swap two nearly tied tokens.

Imports torch alone (transformers only inside `reference_model`), so that anything (tests, the ONNX export) can hold
its comparisons to the same rule.
"""

import math
from contextlib import contextmanager
from pathlib import Path

import torch

from .errors import ConversionError
from .io.reading import read_generation_config

TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
PRECISION_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def as_float64(x) -> torch.Tensor:
    """A tensor, numpy array or number, in float64: the comparison itself adds no rounding."""
    return x.detach().double() if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)


def precision(x) -> torch.dtype:
    """The dtype a tensor or numpy array was computed in (float32 for any dtype the table lacks). A Python number
    does not say (a pipeline's score is a float32 result, a learning rate a float64 one), so it needs `dtype=`."""
    if not hasattr(x, "dtype"):
        raise TypeError(f"{type(x).__name__} has no dtype: pass dtype= (the precision that computed it)")
    dtype = x.dtype if isinstance(x, torch.Tensor) else torch.as_tensor(x).dtype
    return dtype if dtype in TOLERANCE else torch.float32


def tolerance(expected, dtype: torch.dtype | None = None) -> float:
    """The absolute tolerance for comparing against `expected`, computed in `dtype` (default: expected's)."""
    dtype = dtype or precision(expected)
    expected = as_float64(expected)
    magnitude = expected.abs().max().item() if expected.numel() else 0.0
    return TOLERANCE[dtype] * max(1.0, magnitude)


def rule(dtype: torch.dtype) -> str:
    """The rule for `dtype`, as the converters' reports and model cards state it."""
    return f"tolerance {TOLERANCE[dtype]:g} x max(1, |output|)"


def reference_model(model_class, tensors: dict, source_dir: Path | None = None, config=None):
    """`model_class` as `model_class.from_pretrained(source_dir)` loads it (its config and generation config; eager
    attention, float32, eval mode), but holding `tensors`, the weights the converter has already read.

    transformers' own loader still places them (its key renames such as gamma -> weight, prefixes, tied weights), so
    the reference owes nothing to our key tables; it only avoids a second copy of the weights (from_pretrained would
    map the file again, and the process's memory would count both). The reference and our model therefore share the
    tensors' storage: verification relies on conversion never writing into them. `config`, when given, is used
    instead of the source's config.json (a reference built, not loaded)."""
    options = {}
    generation = read_generation_config(source_dir) if source_dir is not None else None
    if generation is not None:
        options["generation_config"] = generation
    config = config if config is not None else model_class.config_class.from_pretrained(source_dir)
    # A shallow copy: the loader may rename keys in the dict it is given, and the converter reads this one again.
    reference = model_class.from_pretrained(None, config=config, state_dict=dict(tensors),
                                            attn_implementation="eager", dtype=torch.float32, **options)
    return reference.eval()


def verification_batch(config, batch_size: int = 3, length: int = 24, seed: int = 0) -> dict:
    """Random ids, right-padded rows of different lengths, two segments when the model has token types."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (batch_size, length), generator=generator)
    lengths = torch.tensor([length, length * 2 // 3, length // 3])[:batch_size]
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id or 0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if getattr(config, "type_vocab_size", 0) > 1:  # DistilBERT's config has no token types at all
        second = (torch.arange(length)[None, :] >= lengths[:, None] // 2) & (attention_mask == 1)
        batch["token_type_ids"] = second.long()
    return batch


def check(name: str, expected, actual, mask: torch.Tensor | None, dtype: torch.dtype) -> tuple[bool, float]:
    """`actual` against `expected` by the rule, at the positions where `mask` is 1 for outputs shaped like it, (B, T,
    ...), everywhere for the others (a pooled or per-sequence output). Either may be a tuple, one tensor per layer:
    then one line per layer. Prints each max |diff|, marking those beyond the rule; returns (all within it, the
    largest max |diff|)."""
    layered = isinstance(expected, tuple)
    pairs = zip(expected, actual, strict=True) if layered else [(expected, actual)]
    ok, worst = True, 0.0
    for i, (ref, out) in enumerate(pairs):
        real = mask.bool() if mask is not None and ref.shape[:2] == mask.shape else ...
        ref, out = as_float64(ref[real]), as_float64(out[real])
        diff = (ref - out).abs().max().item()
        within = diff <= tolerance(ref, dtype)
        label = f"{name} {'embeddings' if i == 0 else f'layer {i}':>10}" if layered else name
        print(f"  {label}: max |diff| = {diff:.3e}{'' if within else '  > tolerance'}")
        ok, worst = ok and within, worse(worst, diff)
    return ok, worst


def worse(a: float, b: float) -> float:
    """The larger of two max |diff|, NaN where either is (Python's max(0.0, nan) is 0.0: an overflow to Inf on
    both sides, whose difference is NaN, was reported as a max |diff| of 0)."""
    return a if math.isnan(a) or a >= b else b


@contextmanager
def reference_side(reference):
    """An error raised inside transformers' `reference` model while verifying, refused as the reference's (the source
    checkpoint as transformers itself runs it, before ours is compared), with the cause where it is known, rather
    than reported as a bug in the converter."""
    try:
        yield
    except Exception as error:
        config, cause = reference.config, ""
        decoder_layers = getattr(config, "decoder_layers", None)
        if not config.is_encoder_decoder and decoder_layers not in (None, config.num_hidden_layers):
            # BartForCausalLM: a decoder alone, whose cache transformers sizes from num_hidden_layers, which BartConfig
            # reads from encoder_layers (of an encoder it does not have).
            cause = (f" Its key/value cache has num_hidden_layers={config.num_hidden_layers} layers (encoder_layers, "
                     f"of an encoder this model does not have) and its decoder decoder_layers={decoder_layers}: set "
                     f"encoder_layers to {decoder_layers} in the source's config.json (it changes nothing else), or "
                     f"convert with --no-verify.")
        raise ConversionError(f"transformers' own {type(reference).__name__}, the reference the conversion is verified "
                              f"against, failed on the source checkpoint ({type(error).__name__}: {error}), before "
                              f"ours was compared; nothing was written.{cause}") from error


def compare_generation(reference, model, inputs: dict, max_new_tokens: int = 10, num_beams: int = 4):
    """Greedy and beam-search `generate()` of both models from `inputs`, each with its own generation config: (both
    gave identical token sequences, a summary)."""
    ok, summary = True, []
    for name, options in (("greedy", {"num_beams": 1}), (f"beam search ({num_beams} beams)", {"num_beams": num_beams})):
        kwargs = dict(inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
        with torch.no_grad():
            with reference_side(reference):
                expected = reference.generate(**kwargs)
            ours = model.generate(**kwargs)
        same = expected.shape == ours.shape and torch.equal(expected, ours)
        print(f"  generate, {name}: {'identical' if same else 'DIFFERENT'} token sequences "
              f"({expected.shape[0]} sources, {expected.shape[1]} tokens)")
        ok &= same
        summary.append(f"{name} generate(): {'identical' if same else 'different'} tokens")
    return ok, "; ".join(summary)


def require_parity(ok: bool, parity: str) -> None:
    """End a conversion whose verification failed, before anything is written; otherwise say it passed."""
    if not ok:
        raise ConversionError(f"Parity check failed: {parity.rstrip('.')}. Nothing was written.")
    print(f"  OK: {parity}")
