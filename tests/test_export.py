"""torch.export and torch.compile on small configs, static shapes.

What traces, and how:
- The encoder (`VanillaEncoderForSequenceClassification`, padded batch) exports with `torch.export.export` in both
  strict mode (TorchDynamo captures the Python) and non-strict mode (the Python runs, tensors are traced; what
  `torch.onnx.export(dynamo=True)` uses). An export is one graph or an error: there are no graph breaks to allow.
- One decoder step (`hf_vanilla.export.DecoderStepGraph`: one new token, the self-attention cache as tensors,
  an `EncoderDecoderCache` built inside) exports the same two ways.
- `torch.compile(model, fullgraph=True)` (which raises on any graph break) gives the eager outputs, with
  `output_attentions=True` (eager attention) too: no feature of the model forces a break.

Under tracing the encoder takes its padded path with a static mask (`is_tracing()` in hf_vanilla/kernels.py): the
packed fast path (`nonzero`, per-sequence `split` with Python lengths) and the input value checks (`.item()`-like
reads) depend on data. The graphs below are checked to contain no such operation. Eager runs pack padded batches,
which leaves zeros at padding positions, so token-level outputs are compared on real tokens only.

The default-suite compile test uses the `aot_eager` backend: the same capture (Dynamo, then AOTAutograd) without
Inductor's C++ code generation, which takes 60-90 s cold on a 2-core CPU. The Inductor test is marked `slow`.
"""

import pytest
import torch
from numerics import assert_close
from transformers.modeling_outputs import BaseModelOutput

from hf_vanilla.compat import CACHE_FIELD
from hf_vanilla.export import DecoderStepGraph
from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForSequenceClassification,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

DATA_DEPENDENT_OPS = ("nonzero", "_local_scalar_dense", "item", "masked_select", "index_put")


def tiny(model_class, config_class, **fields):
    torch.manual_seed(0)
    config = config_class(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=32, initializer_range=0.3, **fields)
    return model_class(config).eval()


@pytest.fixture(scope="module")
def encoder():
    return tiny(VanillaEncoderForSequenceClassification, VanillaEncoderConfig, num_labels=3)


@pytest.fixture(scope="module")
def batch():
    """Right-padded rows of lengths 10, 6, 3 with two segments."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 100, (3, 10), generator=generator)
    attention_mask = (torch.arange(10)[None] < torch.tensor([[10], [6], [3]])).long()
    token_type_ids = (torch.arange(10)[None] >= 4).long() * attention_mask
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask,
            "token_type_ids": token_type_ids}


@pytest.fixture(scope="module")
def seq2seq():
    return tiny(VanillaSeq2SeqForConditionalGeneration, VanillaSeq2SeqConfig, decoder_layers=2)


def assert_close_on_tokens(actual, expected, mask):
    """Compare (B, T, ...) on real tokens, anything else everywhere (tests/numerics.py's rule)."""
    if actual.dim() >= 2 and actual.shape[:2] == mask.shape:
        actual, expected = actual[mask.bool()], expected[mask.bool()]
    assert_close(actual, expected)


def graph_ops(graph_module) -> set[str]:
    return {str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"}


def assert_static_graph(graph_module):
    ops = graph_ops(graph_module)
    bad = [op for op in ops if any(name in op for name in DATA_DEPENDENT_OPS)]
    assert not bad, f"data-dependent operations in the traced graph: {bad}"
    assert any("softmax" in op or "scaled_dot_product_attention" in op for op in ops)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_encoder_exports_as_one_graph(encoder, batch, strict):
    program = torch.export.export(encoder, (), {**batch, "output_hidden_states": True}, strict=strict)
    assert_static_graph(program.graph_module)
    with torch.no_grad():
        expected = encoder(**batch, output_hidden_states=True)
        exported = program.module()(**batch, output_hidden_states=True)
    assert_close(exported.logits, expected.logits)
    assert_close_on_tokens(exported.hidden_states[-1], expected.hidden_states[-1], batch["attention_mask"])


def decoder_step_inputs(model, prefix_length: int = 3, seed: int = 0):
    """A real cache: the encoder output of a padded source and a decoded prefix, and the next target token."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(5, 100, (2, 7), generator=generator)
    source_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    target = torch.randint(5, 100, (2, prefix_length + 1), generator=generator)
    target[:, 0] = model.config.decoder_start_token_id
    with torch.no_grad():
        states = model.get_encoder()(input_ids=source, attention_mask=source_mask).last_hidden_state
        prefix = model(attention_mask=source_mask, encoder_outputs=BaseModelOutput(last_hidden_state=states),
                       decoder_input_ids=target[:, :-1], use_cache=True)
        full = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target, use_cache=False).logits
    cache = prefix[CACHE_FIELD].self_attention_cache
    past = tuple(t for layer in cache.layers for t in (layer.keys, layer.values))  # each (B, H, prefix, D)
    return (target[:, -1:], states, source_mask, past), full[:, -1:]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_decoder_step_exports_as_one_graph(seq2seq, strict):
    inputs, expected_logits = decoder_step_inputs(seq2seq)
    step = DecoderStepGraph(seq2seq).eval()
    program = torch.export.export(step, inputs, strict=strict)
    assert_static_graph(program.graph_module)
    with torch.no_grad():
        eager = step(*inputs)
        exported = program.module()(*inputs)
    # the step (cache of 3 positions + 1 new token) = the last position of an uncached forward over all 4
    assert_close(eager[0], expected_logits)
    assert len(exported) == 1 + 2 * seq2seq.config.decoder_layers
    for ours, theirs in zip(exported, eager, strict=True):
        assert_close(ours, theirs)
    assert exported[1].shape[2] == inputs[3][0].shape[2] + 1  # the cache grew by one position


@pytest.mark.parametrize("backend", [
    "aot_eager",  # Dynamo + AOTAutograd, no C++ codegen
    pytest.param("inductor", marks=pytest.mark.slow),  # generates and compiles C++ kernels: 60-90 s cold on 2 cores
])
def test_compile_fullgraph_matches_eager(encoder, batch, backend):
    """fullgraph=True turns any graph break into an error."""
    torch._dynamo.reset()
    compiled = torch.compile(encoder, fullgraph=True, backend=backend)
    with torch.no_grad():
        expected = encoder(**batch, output_hidden_states=True)
        actual = compiled(**batch, output_hidden_states=True)
    assert_close(actual.logits, expected.logits)
    for ours, theirs in zip(actual.hidden_states, expected.hidden_states, strict=True):
        assert_close_on_tokens(ours, theirs, batch["attention_mask"])


def test_compile_fullgraph_with_attention_maps(encoder, batch):
    """output_attentions needs eager attention; it still compiles to one graph (the padded path is taken anyway)."""
    torch._dynamo.reset()
    eager_model = VanillaEncoderForSequenceClassification._from_config(encoder.config, attn_implementation="eager")
    eager_model.load_state_dict(encoder.state_dict())
    eager_model.eval()
    compiled = torch.compile(eager_model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = eager_model(**batch, output_attentions=True)
        actual = compiled(**batch, output_attentions=True)
    assert len(actual.attentions) == encoder.config.num_hidden_layers
    for ours, theirs in zip(actual.attentions, expected.attentions, strict=True):
        assert_close(ours, theirs)
    assert_close(actual.logits, expected.logits)


@pytest.mark.slow  # Inductor generates and compiles C++ kernels: 60-90 s cold on a 2-core CPU
def test_compile_inductor_decoder_step_matches_eager(seq2seq):
    torch._dynamo.reset()
    inputs, _ = decoder_step_inputs(seq2seq)
    step = DecoderStepGraph(seq2seq).eval()
    compiled_step = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        for ours, theirs in zip(compiled_step(*inputs), step(*inputs), strict=True):
            assert_close(ours, theirs)
