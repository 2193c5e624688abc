"""Graphs for other engines: a vanilla model traced into ONNX with `torch.onnx.export(..., dynamo=True)`.

torch.export in non-strict mode, then translation to ONNX, with dynamic batch and sequence axes
(`torch.export.Dim`). Under export the model takes its padded path with a static additive mask (`is_tracing()` in
kernels.py): the packed fast path and the input value checks branch on data, which a graph cannot.

Two users, two forms of the encoder graph:
- `export_encoder`: the weights inside the graph, a file that runs on its own. `python -m conversion onnx`
  (hf_vanilla/conversion/onnx_export.py) writes it, checked against PyTorch, next to the config and tokenizer.
- `export_encoder_reading_weights`: no weight inside; every parameter and buffer is a graph input named as the
  model names it (`encoder.layers.0.ffn.up_proj.weight`). The ONNX Runtime engine (hf_vanilla/runtimes/) feeds
  these inputs the model's own tensors on every call, so the graph computes with whatever the model holds.

Encoder graphs:
    inputs   input_ids, attention_mask (B, T) [, token_type_ids (B, T)], named as the tokenizer names them
    outputs  the model output's fields named by the caller: last_hidden_state (B, T, E), pooler_output (B, E),
             logits, start_logits, end_logits ...
Positions that are padding hold values without meaning (PyTorch's packed path writes zeros there).

`export_decoder_step`: one decoding step of an encoder-decoder:
    inputs   input_ids (B, 1)                          the newest target token
             encoder_hidden_states (B, S, E), encoder_attention_mask (B, S)
             past_key_values.{i}.key, .value (B, H, P, D)   layer i's self-attention cache; P = 0 at the start
    outputs  logits (B, 1, V)
             present.{i}.key, .value (B, H, P + 1, D)      the cache for the next step

Design of the decoder step: only the self-attention keys and values, which grow by one position per step, travel
in and out of the graph. Cross-attention keys and values are recomputed inside every step from
`encoder_hidden_states`. That costs 2 projections of the S source states per layer and step (small next to the
rest for short outputs), and buys one graph for every step, the first included (P = 0), with no separate
first-step graph and no control flow. `examples/onnx_greedy_decode.py` drives the pair.

Needs onnx and onnxscript (the `onnx` extra); this module imports them only when it exports.
"""

import logging
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .compat import CACHE_FIELD, export_axis

# ---- graph signatures -------------------------------------------------------------------------------------------


class EncoderGraph(nn.Module):
    """Tensors in, a tuple of named outputs out: the signature an ONNX graph has.

    `model` is a `VanillaEncoder*` model, or the encoder stack of an encoder-decoder (which returns
    `last_hidden_state`)."""

    def __init__(self, model, output_names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.output_names = output_names

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return tuple(getattr(out, name) for name in self.output_names)


class DecoderStepGraph(nn.Module):
    """One decoding step of a `VanillaSeq2SeqForConditionalGeneration` with the cache as plain tensors.

    The model reads its cache from an `EncoderDecoderCache`; this builds one from the past tensors (self-attention)
    and an empty cross-attention cache, which the step fills from `encoder_hidden_states` and then drops.

    past_key_values: (key_0, value_0, key_1, value_1, ...), each (B, H, P, D).
    Returns: logits (B, 1, V) and the grown cache (key_0, value_0, ...), each (B, H, P + 1, D).
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.num_layers = model.config.decoder_layers

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask, past_key_values):
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache
        from transformers.modeling_outputs import BaseModelOutput

        pairs = [(past_key_values[2 * i], past_key_values[2 * i + 1]) for i in range(self.num_layers)]
        cache = EncoderDecoderCache(DynamicCache(ddp_cache_data=pairs), DynamicCache())
        out = self.model(
            decoder_input_ids=input_ids, attention_mask=encoder_attention_mask,
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden_states),
            past_key_values=cache, use_cache=True, return_dict=True,
        )
        present = out[CACHE_FIELD].self_attention_cache.layers  # `past_key_values` before transformers 5.24
        return (out.logits, *(t for layer in present for t in (layer.keys, layer.values)))


def past_names(num_layers: int, prefix: str = "past_key_values") -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


# ---- export -----------------------------------------------------------------------------------------------------


def example_inputs(config, input_names: list[str], batch_size: int = 2, length: int = 16) -> dict:
    """What the exporter traces: ids spread over the vocabulary, the last row right-padded, no second segment.
    Sizes distinct and above 1, so that neither axis is specialised to a constant; the values matter to no branch."""
    input_ids = (torch.arange(batch_size * length).view(batch_size, length) * 7919 + 5) % config.vocab_size
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, length // 2:] = 0
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids)}
    return {name: batch[name] for name in input_names}


@contextmanager
def _quiet_exporter():
    """Silence the exporter's notes that say nothing about this model: torchvision ops it skips, and one rename
    warning per input that shares a `Dim` with another (sharing is the point: every input has the same batch)."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used")
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def _export_encoder_program(model, input_names: list[str], output_names: tuple[str, ...], optimize: bool):
    batch, sequence = export_axis("batch"), export_axis("sequence")
    with _quiet_exporter():
        return torch.onnx.export(
            EncoderGraph(model, output_names).eval(), (), kwargs=example_inputs(model.config, input_names),
            dynamo=True, input_names=input_names, output_names=list(output_names),
            dynamic_shapes={name: {0: batch, 1: sequence} for name in input_names}, optimize=optimize,
            verbose=False,
        )


def export_encoder(model, path: Path, input_names: list[str], output_names: tuple[str, ...]) -> None:
    """A `VanillaEncoder*` model (or an encoder stack) -> one ONNX graph with its weights, dynamic in batch and
    sequence."""
    _export_encoder_program(model, input_names, output_names, optimize=True).save(str(path))


def export_encoder_reading_weights(model, input_names: list[str], output_names: tuple[str, ...]):
    """The encoder graph with no weight inside: after `input_names`, one graph input per parameter and buffer,
    named as `model.named_parameters()` / `named_buffers()` name it (a tensor registered twice is one input).
    Returns the `onnx.ModelProto`.

    Exported without onnxscript's optimizer, whose constant folding would bake a transposed copy of each
    projection's weight into the graph; the weights are made inputs first, then the optimizer runs and can fold
    only what does not depend on them."""
    import onnxscript

    program = _export_encoder_program(model, input_names, output_names, optimize=False)
    graph = program.model.graph
    for name in list(graph.initializers):
        if not name.startswith("model."):
            continue  # a constant the trace made, not a tensor of the model
        value = graph.initializers.pop(name)
        value.const_value = None
        value.name = name.removeprefix("model.")  # EncoderGraph holds the model as `model`
        graph.inputs.append(value)
    onnxscript.optimizer.optimize(program.model)
    return program.model_proto


def export_decoder_step(model, path: Path) -> None:
    """The decoder of a `VanillaSeq2SeqForConditionalGeneration` -> one ONNX graph of one decoding step."""
    config = model.config
    heads, width = config.decoder_attention_heads, config.hidden_size
    layers = config.decoder_layers
    batch, source = export_axis("batch"), export_axis("encoder_sequence")
    past = export_axis("past_sequence", min=0)  # 0 on the first step
    B, S, P = 2, 7, 3  # example sizes: distinct, and above 1 so that none is specialised to a constant
    example = (
        torch.full((B, 1), config.decoder_start_token_id),
        torch.randn(B, S, width),
        torch.tensor([[1] * S, [1] * (S - 2) + [0] * 2]),
        tuple(torch.randn(B, heads, P, width // heads) for _ in range(2 * layers)),
    )
    dynamic_shapes = ({0: batch}, {0: batch, 1: source}, {0: batch, 1: source},
                      tuple({0: batch, 2: past} for _ in range(2 * layers)))
    with _quiet_exporter():
        program = torch.onnx.export(
            DecoderStepGraph(model).eval(), example, dynamo=True,
            input_names=["input_ids", "encoder_hidden_states", "encoder_attention_mask", *past_names(layers)],
            output_names=["logits", *past_names(layers, "present")],
            dynamic_shapes=dynamic_shapes, verbose=False,
        )
    program.save(str(path))
