"""ONNX Runtime holding the encoder's weights: `use_onnx_runtime(model, owned=True, precision="f32" | "int8")`, an
`OwnedOnnxEncoder` in front of each BERT-style body (hf_vanilla/runtimes/owned.py: how the weights are held, and
which changes it follows or refuses).

Why, beside the engine fed its weights (engine.py). A session whose weights are its own initializers packs them for
its kernels once, at session creation; fed them on every call it packs them on every call, which is most of a short
request (docs/performance.md). And only weights it holds can be quantized once.

int8. Every projection (each MatMul of a constant weight, the pooler's included) becomes ONNX Runtime's dynamic
int8 product (`quantize_dynamic`: the weight int8 per output column, the activation quantized to uint8 at each
call), which its MLAS kernels compute in int8 with AVX-512 VNNI, AVX-VNNI or AMX where the CPU has them. That
activation quantization is one scale per tensor, and one token with large activations then flattens every other
token's: on MiniLM and real sentences the lowest per-token cosine against float32 was 0.968, below CTranslate2's
int8 (0.986). So each token is first divided by its own largest |x| and the product multiplied back by it
(`token_ranges`), as `hf_vanilla.precision.Int8Linear` does for the same reason: per-token quantization from
per-tensor kernels, lowest cosine 0.992, for a small part of the int8 time (benchmarks/int8_ranges.py measures
it, docs/performance.md gives it).
Embeddings, norms and attention's own products stay float32; the shadow keeps and saves the float32 weights, and
PyTorch's path runs them in float32.

Not ONNX Runtime's transformer optimizer. `onnxruntime.transformers.optimizer.optimize_model(model_type="bert")`
fuses in this graph only what ONNX Runtime's own graph optimizations fuse when it makes the session
(SkipLayerNormalization, BiasGelu): its attention and embedding patterns do not match the graph torch.onnx exports
of scaled_dot_product_attention and of our padding mask. Its graph and the plain one run as the same kernels, op for
op, so the engine makes its session of the plain graph.
"""

import contextlib
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from onnx import helper, numpy_helper

from ...precision import INT8_PRODUCTS, cpu_flags
from ..owned import OwnedEncoder
from .engine import session_for


class OwnedOnnxEncoder(OwnedEncoder):
    """A body's `forward` while ONNX Runtime runs it, holding its weights."""

    RUNTIME = "onnxruntime"
    REMOVE = "hf_vanilla.runtimes.onnxruntime.remove_onnx_runtime(model)"
    PRECISIONS = {"f32": torch.float32, "int8": torch.float32}  # the shadow's dtype
    FOLLOWS = {torch.float32: "f32"}

    def build(self, tensors: dict, precision: str):
        return (session_over if precision == "f32" else quantized_session)(self.graph, tensors, self.threads)

    def outputs_of(self, session) -> tuple[list, bool]:
        return ([o.name for o in session.get_outputs()],
                any(i.name == "token_type_ids" for i in session.get_inputs()))

    def run(self, session, feeds: dict) -> list:
        return session.run(None, feeds)


def session_over(graph: bytes, tensors: dict, threads: int):
    """ONNX Runtime's session of `graph` (reading its weights as inputs) with `tensors` as its initializers, each
    declared external and supplied as an OrtValue over the array's memory, kept alive with the session
    (`session.weights`, as ONNX Runtime asks). ONNX Runtime 1.32 copies each into memory of its own, folds the
    transpose of each projection's weight into a constant, packs that for its kernels and frees it (changing an
    array afterwards changes no answer: measured). Serialized with its weights instead, the graph's bytes stayed in
    the Python session (which keeps them to rebuild itself) beside that copy, and the protobuf's copy raised the
    load's peak (docs/performance.md, Memory)."""
    model = onnx.load_from_string(graph)
    names, values = [], []
    for value in list(model.graph.input):
        if value.name not in tensors:
            continue  # a request input
        array = np.ascontiguousarray(tensors[value.name])
        initializer = onnx.TensorProto(name=value.name, dims=array.shape, data_type=onnx.TensorProto.FLOAT,
                                       data_location=onnx.TensorProto.EXTERNAL)
        for key, text in (("location", "supplied-at-session-creation"), ("length", str(array.nbytes))):
            entry = initializer.external_data.add()
            entry.key, entry.value = key, text
        model.graph.initializer.append(initializer)
        model.graph.input.remove(value)
        names.append(value.name)
        values.append(onnxruntime.OrtValue.ortvalue_from_numpy(array))
    options = onnxruntime.SessionOptions()
    options.add_external_initializers(names, values)
    session = session_for(model.SerializeToString(), threads, options)
    session.weights = values  # the OrtValues (and the arrays they view) live as long as the session
    return session


def quantized_session(graph: bytes, tensors: dict, threads: int):
    """ONNX Runtime's session of `graph` with `tensors` as its initializers, the projections int8 (`quantized`),
    loaded from a file: the Python session keeps its path, not the graph's bytes beside ONNX Runtime's copy."""
    model = quantized(with_weights(onnx.load_from_string(graph), tensors))
    with tempfile.TemporaryDirectory(prefix="hf_vanilla-int8-") as folder:
        path = Path(folder) / "int8.onnx"
        onnx.save(model, path)
        return session_for(str(path), threads)


def with_weights(graph: onnx.ModelProto, tensors: dict) -> onnx.ModelProto:
    """`graph` (reading its weights as inputs) with `tensors` as its initializers. A weight read only through a
    2-D transpose (every nn.Linear's, as torch.onnx exports it) is stored transposed in its place, so that each
    projection is a MatMul of a constant, which is what ONNX Runtime's int8 quantizer looks for."""
    nodes = graph.graph.node
    readers = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    folded = set()
    for value in list(graph.graph.input):
        name = value.name
        if name not in tensors:
            continue  # a request input
        array, uses = tensors[name], readers.get(name, [])
        if array.ndim == 2 and uses and all(node.op_type == "Transpose" and _swaps(node) for node in uses):
            for node in uses:
                graph.graph.initializer.append(numpy_helper.from_array(array.T.copy(), node.output[0]))
                folded.add(id(node))
        else:
            graph.graph.initializer.append(numpy_helper.from_array(array, name))
        graph.graph.input.remove(value)
    kept = [node for node in nodes if id(node) not in folded]
    del graph.graph.node[:]
    graph.graph.node.extend(kept)
    return graph


def _swaps(node) -> bool:
    perm = next((list(attribute.ints) for attribute in node.attribute if attribute.name == "perm"), None)
    return perm in (None, [1, 0])


def quantized(graph: onnx.ModelProto, per_token: bool = True) -> onnx.ModelProto:
    """`graph` with every MatMul of a constant weight as ONNX Runtime's dynamic int8 product (weights int8, per
    output column), each token's activations quantized on their own range (`token_ranges`), through ONNX Runtime's
    own quantizer (which writes a file: a private temporary folder). `per_token=False`: one activation scale per
    tensor, as the quantizer comes (what the ranges cost and buy: benchmarks/int8_ranges.py).

    Weights get all 8 bits where the CPU has VNNI or AMX (`INT8_PRODUCTS`), and 7 elsewhere: without them MLAS
    multiplies with `vpmaddubsw`, which adds two u8 x s8 products into a saturating int16 (255 x 127 x 2 > 32767;
    255 x 64 x 2 < 32767 cannot overflow), as `hf_vanilla.precision.Int8Linear` found with fbgemm. On MiniLM's 256
    Lee sentences 7-bit weights gave a lowest token cosine of 0.9865 against 0.9917 with 8 (on a CPU with VNNI)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="hf_vanilla-int8-") as folder, _quiet_quantizer():
        output = Path(folder) / "int8.onnx"
        quantize_dynamic(token_ranges(graph) if per_token else graph, output, op_types_to_quantize=["MatMul"],
                         per_channel=True, reduce_range=not cpu_flags() & INT8_PRODUCTS, weight_type=QuantType.QInt8,
                         extra_options={"MatMulConstBOnly": True})
        return onnx.load(output)


def token_ranges(graph: onnx.ModelProto) -> onnx.ModelProto:
    """`graph` with each MatMul of a constant 2-D weight computed as s * ((x / s) W), s = max |x| per token (its
    last axis, at least 1e-30, as `Int8Linear` clamps it: a token of zeros would divide 0 by 0, and its NaN would
    set the one scale of the whole tensor): the rows the product sees all span [-1, 1], so a scale per tensor is a
    scale per token. Projections reading the same x (q, k and v) share its s and x / s."""
    body = graph.graph
    weights = {tensor.name for tensor in body.initializer if len(tensor.dims) == 2}
    opset = next(entry.version for entry in graph.opset_import if entry.domain in ("", "ai.onnx"))
    axis, tiny = "hf_vanilla.last_axis", "hf_vanilla.tiny"
    body.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), axis),
                             numpy_helper.from_array(np.array(1e-30, np.float32), tiny)])
    nodes, ranged = [], {}
    for node in body.node:
        if node.op_type == "MatMul" and node.input[1] in weights:
            x = node.input[0]
            if x not in ranged:
                ranged[x] = scaled, top = f"{x}.per_token", f"{x}.token_max"
                largest = (helper.make_node("ReduceMax", [f"{x}.abs", axis], [f"{x}.abs_max"], keepdims=1)
                           if opset >= 18 else
                           helper.make_node("ReduceMax", [f"{x}.abs"], [f"{x}.abs_max"], keepdims=1, axes=[-1]))
                nodes += [helper.make_node("Abs", [x], [f"{x}.abs"]), largest,  # (..., 1)
                          helper.make_node("Max", [f"{x}.abs_max", tiny], [top]),
                          helper.make_node("Div", [x, top], [scaled])]  # (..., K), each row within [-1, 1]
            scaled, top = ranged[x]
            y = node.output[0]
            node.input[0], node.output[0] = scaled, f"{y}.per_token"
            nodes += [node, helper.make_node("Mul", [f"{y}.per_token", top], [y])]  # (..., N)
        else:
            nodes.append(node)
    del body.node[:]
    body.node.extend(nodes)
    return graph


@contextlib.contextmanager
def _quiet_quantizer():
    """Hold back the quantizer's advice to pre-process the graph for static quantization (a root-logger warning on
    every call), which says nothing of a dynamic quantization of our own graph."""
    advice = lambda record: "pre-processing before quantization" not in record.getMessage()  # noqa: E731
    root = logging.getLogger()
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)
