"""The one place that knows how transformers and torch versions differ (pyproject.toml declares the supported
ranges; CI tests their ends), and the one place that names transformers' private attributes. Nothing else in the
package reads a version or a private name of transformers', so that a release that moves one breaks here, visibly.

transformers 5.24 renamed the generation cache from `past_key_values` to `cache`: `generate` passes `cache=` to
`forward`, reads the next step's cache back from `outputs["cache"]`, and the output classes
(`BaseModelOutputWithPast...`, `Seq2SeqLMOutput`, ...) carry a `cache` field; building one with `past_key_values=`
still works there but logs a deprecation warning. Before 5.24 all three were `past_key_values`. A forward that took
only `past_key_values` and swallowed `**kwargs` got no cache from 5.24's `generate` and decoded every step from the
newest token alone: no error, wrong tokens. So every forward takes both names, and every output names the cache
the way the installed transformers reads it. The same name is the keyword transformers' gradient-checkpointing
wrapper (`GradientCheckpointingLayer`) drops from a layer's call, so the decoder layers take the cache under it.
"""

import functools
import inspect

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# The name of the cache field on transformers' output classes, and so the one `generate` reads back.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def one_cache(cache, past_key_values):
    """The key/value cache passed under either name: `cache` (what 5.24+'s `generate` passes) or `past_key_values`
    (what it passed before, and what callers written for those versions pass). A tuple of per-layer tensors, the
    legacy cache of transformers 4, is refused naming the Cache to wrap it in (transformers 5's own models fail on
    it with "'tuple' object has no attribute 'get_seq_length'")."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("Got two key/value caches, cache= and past_key_values=: pass one (cache= on transformers "
                         "5.24 and later, past_key_values= before).")
    name, given = ("past_key_values", past_key_values) if cache is None else ("cache", cache)
    if isinstance(given, (tuple, list)):
        raise ValueError(f"{name} is a {type(given).__name__} of per-layer tensors, the legacy cache format, which "
                         f"transformers 5 models no longer take: pass transformers.DynamicCache({name}) (a decoder's "
                         f"(key, value) per layer) or EncoderDecoderCache({name}) (an encoder-decoder's (key, value, "
                         f"cross-attention key, value) per layer), or let generate() build the cache.")
    return given


def cache_field(cache) -> dict:
    """`{field name: cache}` to build an output class with, under the name the installed transformers reads."""
    return {CACHE_FIELD: cache}


# Above any real batch or sequence length. torch.export before torch 2.8 turns a slice over a dynamic axis
# (`hidden[:, 0]`, `mask[:, None, None, :]`) into the guard `size != 2**63 - 1`, which an axis with no upper bound
# cannot promise: the export fails with "Constraints violated (batch, sequence)". Under this bound the guard holds.
LARGEST_EXPORTED_SIZE = 2**31 - 1


def export_axis(name: str, min: int | None = None):
    """A dynamic axis for torch.export (`torch.export.Dim`), bounded so that every supported torch exports it."""
    return torch.export.Dim(name, min=min, max=LARGEST_EXPORTED_SIZE)


def flex_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' flex_attention, whose compiled CPU kernels are cached under a key that names the CPU capability
    they were generated for, given contiguous query, key and value.

    torch's compile caches (the FX graph cache, in TORCHINDUCTOR_CACHE_DIR, shared by every process of a user) key a
    compiled CPU graph by torch's version, the graph and its settings, but not by the vector instructions its kernels
    were generated for, which ATEN_CPU_CAPABILITY chooses per process. A graph cached by a process capped at AVX2 and
    read back by an AVX-512 one answers wrongly (flex_attention on an AVX-512 CPU, torch 2.11 and 2.15: max |diff| 1.6
    against sdpa, with two cache hits; a fresh cache answers right). So the capability joins torch's cache key tag
    (`torch.compiler.config.cache_key_tag`, which every compile cache hashes) before the first compile, forward and
    backward alike; in a process that keeps one capability, as every process does, this only keeps caches apart.

    The contiguous copy: attention hands (B, H, T, D) views of (B, T, H, D) projections, which torch 2.15's compiled
    CPU kernel read wrongly once a second sequence length had made its shapes dynamic. It is small beside the
    compiled kernel's call, so it is made on every version."""
    if query.device.type == "cpu":
        _key_compile_caches_by_cpu_capability()
        query, key, value = (x.contiguous() for x in (query, key, value))
    return ALL_ATTENTION_FUNCTIONS["flex_attention"](module, query, key, value, attention_mask, **kwargs)


def _key_compile_caches_by_cpu_capability():
    """Add `cpu-capability=<ATen's capability>` to torch's compile cache key tag, keeping any tag already set."""
    tag = f"cpu-capability={torch.backends.cpu.get_cpu_capability()}"
    current = torch.compiler.config.cache_key_tag
    if tag not in current and not torch.compiler.is_compiling():
        torch.compiler.config.cache_key_tag = f"{current},{tag}" if current else tag


def varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q: int, max_k: int, causal: bool, scale: float):
    """torch's `torch.nn.attention.varlen.varlen_attn` (flash attention over sequences laid end to end, CUDA, half
    precision), or None where the installed torch has none."""
    found = _varlen_attn()
    if found is None:
        return None
    varlen_attn, causal_keyword = found
    return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                       **(causal_keyword if causal else {}))


@functools.cache
def _varlen_attn():
    """(varlen_attn, its causal keyword) or None, found at the first call rather than at import (the module
    registers a custom op, which an import of hf_vanilla on a CPU need not pay) and not at every layer's call. The
    causal switch moved: torch 2.10 takes `is_causal=True`, 2.11 and later `window_size=(-1, 0)`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    causal = ({"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters
              else {"is_causal": True})
    return varlen_attn, causal


# ---- transformers' private names, each with why no public one serves ------------------------------------------


def resized_embeddings(model, embeddings, new_num_tokens, pad_to_multiple_of, mean_resizing):
    """`embeddings` (an nn.Embedding of `model`'s) resized as `resize_token_embeddings` resizes the input embeddings:
    the same padding-to-a-multiple and mean-resizing rules. transformers' public `resize_token_embeddings` resizes
    only `get_input_embeddings()` and the output projection; a second table (an encoder-decoder's separate target
    embeddings) has no public way, so its private `PreTrainedModel._get_resized_embeddings` is called, here only."""
    return model._get_resized_embeddings(embeddings, new_num_tokens, pad_to_multiple_of, mean_resizing)


def ordinary_decoding(model, generation_config):
    """transformers' own decoding loop for `generation_config`'s mode, unbound, as `generate` calls it (`_sample` for
    greedy search and sampling, `_beam_search` for beam search), or None for a mode it loads from the Hub. A
    `custom_generate` callable that steps aside (decoding.py) runs it on what `generate` prepared: no public name
    reaches it. Private: `GENERATION_MODES_MAPPING` and the methods it names."""
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    name = GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode())
    return None if name is None or "/" in name else getattr(type(model), name)


# The attributes a config stores behind the public properties that can change between calls without changing what a
# model computes: `output_attentions` (stored as `_output_attentions`), `_attn_implementation` (stored as
# `_attn_implementation_internal`: a choice among kernels of one function), `_experts_implementation`
# (`_experts_implementation_internal`), `name_or_path` (`_name_or_path`: where the weights came from). A watcher that
# compares a config's attribute dict (runtimes/watch.py) reads that dict, not the properties, so it needs
# the stored names; transformers has no public list of them.
CONFIG_STORED_PER_CALL = ("_output_attentions", "_attn_implementation_internal", "_experts_implementation_internal",
                          "_name_or_path")


__all__ = ["CACHE_FIELD", "CONFIG_STORED_PER_CALL", "LARGEST_EXPORTED_SIZE", "cache_field", "export_axis",
           "flex_attention_forward", "one_cache", "ordinary_decoding", "resized_embeddings"]
