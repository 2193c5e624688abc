"""OpenVINO's engine: an `OpenVinoEncoder` in front of a BERT-style body's forward, holding the body's weights
(hf_vanilla/runtimes/owned.py: how they are held, and which changes it follows or refuses).

What OpenVINO adds. It compiles the graph with the weights as constants, laid out for its kernels once, and on a
CPU measured it won every size of benchmarks/engines.py at float32, padded batches included (docs/performance.md).
The dense request of a size decided for it is written straight into the output's memory (`run_dense`).

Shapes of their own, on request. OpenVINO runs a graph whose input shapes are fixed at compile time faster than one
that takes any shape: with the shapes fixed it infers them and plans its memory once, not at each call (short
requests answered sooner, with identical outputs). With `static_shapes=N`, a dense request of at most STATIC_TOKENS
tokens gets a compilation of its own (B, T) the second time that shape comes, for up to N shapes. Off by default: that compilation stalls the request that pays it (many
times that request's own time), each costs its kernels' layout of the projections' weights again (MiniLM +53 MB,
bert-base +341 MB at float32: the constants read the shadow's memory rather than copies), and it repays the stall
only after hundreds of requests of that very (batch, length), which requests of varied lengths never reach.
Compiled on a thread beside the requests instead, it slowed every request made meanwhile, on few cores several
times over. Worth it for a service whose requests all have one short shape. The compilations are
derived state like the engine's own, dropped with it at every recompilation (`_compile`), never pickled.

Precisions. "f32"; "bf16" (OpenVINO computes in bfloat16, as it does by default on a CPU with bf16 products, from
the weights as the model holds them: a float32 model's stay float32 in the shadow, which saves them and runs
PyTorch's path in float32, and OpenVINO computes what its own default does on the same graph; a bfloat16 model's, or
one moved by `model.to(torch.bfloat16)`, stay bfloat16 throughout; refused, naming "f32", on a CPU without bf16
products, where OpenVINO would quietly compute float32: `refuse_another_precision`); "int8" (each projection's weight as int8 per
output row with a float32 scale, OpenVINO's compressed-weight products; embeddings, norms and biases float32; the
shadow keeps and saves the float32 weights, and PyTorch's path runs them in float32).

How OpenVINO multiplies those int8 weights (measured with AVX-512 VNNI): it quantizes the activations at each
call, one scale per group of `INT8_GROUP` input channels of each token (`DYNAMIC_QUANTIZATION_GROUP_SIZE`), and
multiplies in int8. Its default group is 32 channels; 128 was faster at every size of benchmarks/engines.py and as
accurate as the engines' int8 must be (tests/test_precision.py: MiniLM on 256 Lee sentences, lowest token cosine 0.9942 against
0.9933 at 32 and CTranslate2's 0.984; mean 0.9987 against 0.9992); 384 fell to 0.9912, and 0 (no activation
quantization: the weights widened) was 0.9957 and slower (docs/performance.md).
"""

import os

import numpy as np
import openvino
import torch
from openvino import opset13 as ops

from ...export import example_inputs
from ..holding import tensors_of
from ..owned import OwnedEncoder


# Input channels per activation scale in OpenVINO's int8 products (the module docstring: measured, not OpenVINO's 32).
INT8_GROUP = 128
# With `static_shapes=N` (use_openvino's option; STATIC_SHAPES, none, by default), dense requests of at most
# STATIC_TOKENS tokens (batch x length) get a compilation of their own shape from the second request of that shape
# on, for up to N shapes: the module docstring says what it gains and costs.
STATIC_TOKENS, STATIC_SHAPES = 128, 0


class OpenVinoEncoder(OwnedEncoder):
    """A body's `forward` while OpenVINO runs it, holding its weights."""

    RUNTIME = "openvino"
    REMOVE = "hf_vanilla.runtimes.openvino.remove_openvino(model)"
    PRECISIONS = {"f32": torch.float32, "bf16": None, "int8": torch.float32}  # the shadow's dtype (None: the model's)
    FOLLOWS = {torch.float32: "f32", torch.bfloat16: "bf16"}
    STATIC_AFTER = 2  # the request of a short dense shape that compiles it (the first may be a one-off)

    def __init__(self, unit, precision: str, threads: int, cache, static_shapes: int = STATIC_SHAPES):
        self.static_shapes = static_shapes
        super().__init__(unit, precision, threads, cache)

    def build(self, tensors: dict, precision: str):
        """OpenVINO compiled at `precision` and, below float32, run once on a short request: a precision its CPU
        plugin has no kernel for on this machine fails here, before the body gives anything up."""
        if precision == "f32":
            return compile_graph(self.graph, tensors, precision, self.threads)
        try:
            compiled = compile_graph(self.graph, tensors, precision, self.threads)
            inputs = example_inputs(self.shadow.config, [i.get_any_name() for i in compiled.inputs])
            compiled.create_infer_request().infer({name: value.numpy() for name, value in inputs.items()},
                                                  share_inputs=True)  # as every request here (`run`)
        except RuntimeError as error:
            said, capped = str(error).strip().splitlines()[-1], os.environ.get("ONEDNN_MAX_CPU_ISA")
            why = (f"; ONEDNN_MAX_CPU_ISA={capped} caps the oneDNN inside OpenVINO's CPU plugin, which picks "
                   f"its kernels by the CPU it finds") if capped else ""
            raise ValueError(f"OpenVINO cannot run precision {precision!r} on this machine ({said}): use "
                             f"precision='f32'{why}.") from error
        refuse_another_precision(compiled, precision)
        return compiled

    def _compile(self, checked=None, built=None) -> None:
        super()._compile(checked, built)
        self.static, self.seen = {}, {}  # (B, T) -> its compilation; -> how many requests of it came before

    def for_shape(self, B: int, T: int):
        """The (B, T) shape's own compilation where it has one, or is due one (the second request of a shape of at
        most STATIC_TOKENS tokens, while fewer than `static_shapes` are kept), compiled here, under the lock."""
        static = self.static.get((B, T))
        if static is None and B * T <= STATIC_TOKENS and len(self.static) < self.static_shapes:
            seen = self.seen[B, T] = self.seen.get((B, T), 0) + 1
            if seen >= self.STATIC_AFTER:
                static = self.static[B, T] = compile_graph(self.graph, tensors_of(self.shadow), self.precision,
                                                           threads=self.threads, shape=(B, T))
        return static or self.compiled

    def outputs_of(self, compiled) -> tuple[list, bool]:
        return ([output.get_any_name() for output in compiled.outputs],
                any(i.get_any_name() == "token_type_ids" for i in compiled.inputs))

    def run(self, compiled, feeds: dict) -> list:
        """Every request here shares its inputs' memory (`share_inputs=True`), never copies them: in OpenVINO 2026.4 a
        request that copies its inputs writes them into the input memory of the compiled model's last request that
        shared its own, whether that memory is still alive or not (measured: the second request's ids appeared in the
        first's array; freed, glibc aborted on the corrupted heap)."""
        request = self._request(compiled)
        request.start_async(feeds, share_inputs=True)
        request.wait()
        return [request.get_output_tensor(index).data.copy() for index in range(len(compiled.outputs))]

    def run_dense(self, compiled, feeds: dict) -> list:
        """OpenVINO writes straight into the output's memory, and is called as start + wait, which answers sooner
        than `infer()` after an idle moment (docs/performance.md)."""
        request = self._request(compiled, hot=True)
        B, T = feeds["input_ids"].shape
        width = self.shadow.config.hidden_size
        outputs = [np.empty((B, T, width), np.float32)] + [np.empty((B, width), np.float32)] * (len(self.names) - 1)
        for index, array in enumerate(outputs):
            request.set_output_tensor(index, openvino.Tensor(array, shared_memory=True))
        request.start_async(feeds, share_inputs=True)
        request.wait()
        return outputs

    def _request(self, compiled, hot: bool = False):
        """This thread's infer request of `compiled` (one per thread: a request is not thread-safe), a second one for
        the dense path, whose outputs it points at its own arrays. `self.local` is new with each `_compile`."""
        requests = vars(self.local).setdefault("requests", {})
        key = (id(compiled), hot)  # the entry holds `compiled`: its id is not another's while the entry is there
        if key not in requests:
            requests[key] = (compiled, compiled.create_infer_request())
        return requests[key][1]

    def __getstate__(self):
        return dict(super().__getstate__(), static={}, seen={})


def runs_bf16() -> bool:
    """Whether OpenVINO's CPU plugin computes bf16 on this CPU (BF16 among its OPTIMIZATION_CAPABILITIES): what
    use_openvino(precision="bf16") needs."""
    return "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def refuse_another_precision(compiled, precision: str) -> None:
    """Refuse a compilation that computes in another precision than `precision`, as OpenVINO reports it. Asked for
    bf16, OpenVINO's CPU plugin computes bf16 only where the CPU multiplies it (AVX-512 BF16, AMX, AVX2-VNNI-2), and
    elsewhere (an AVX2-only CPU) quietly keeps float32: the user would get neither bf16's numbers nor its speed, and
    no word. What it runs is the compiled model's INFERENCE_PRECISION_HINT, which the plugin sets to what it computes;
    OPTIMIZATION_CAPABILITIES (BF16 among them or not, `runs_bf16`) says why."""
    ran = compiled.get_property("INFERENCE_PRECISION_HINT")
    if precision == "bf16" and ran != openvino.Type.bf16:
        capabilities = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        raise ValueError(f"OpenVINO would run precision 'bf16' in {ran.to_string()} on this CPU: its CPU plugin "
                         f"computes bf16 only where the CPU multiplies bf16, and lists {capabilities}: hold a "
                         f"float32 model (model.float()) at precision='f32', what it would compute, or 'int8' "
                         f"(hf_vanilla.runtimes.openvino.runs_bf16() tells beforehand).")


def compile_graph(graph: bytes, tensors: dict, precision: str, threads: int, shape: tuple | None = None):
    """OpenVINO's compiled model of `graph` with `tensors` as its constants: each weight input replaced by a
    Constant (int8 per output row for the projections' weights at precision "int8"), laid out for its kernels once.
    The constants read the arrays' memory (the shadow's, which is never written: owned.py), so what a compilation
    adds is its kernels' own layouts. `shape`: the requests' (B, T), fixed at compile time; None, any."""
    core = openvino.Core()
    model = core.read_model(model=graph, weights=openvino.Tensor(np.zeros(0, np.uint8)))
    if shape is not None:
        model.reshape({parameter.get_friendly_name(): list(shape) for parameter in model.get_parameters()
                       if parameter.get_friendly_name() not in tensors})
    projections = {name for name, array in tensors.items() if array.ndim == 2 and "embeddings" not in name}
    for parameter in list(model.get_parameters()):
        name = parameter.get_friendly_name()
        if name not in tensors:
            continue  # a request input
        array = tensors[name]
        if precision == "int8" and name in projections:
            scale = np.maximum(np.abs(array).max(axis=1, keepdims=True), np.finfo(np.float32).tiny) / 127.0
            quantized = np.clip(np.rint(array / scale), -127, 127).astype(np.int8)
            node = ops.multiply(ops.convert(ops.constant(quantized), openvino.Type.f32),
                                ops.constant(scale.astype(np.float32)))
        else:
            node = ops.constant(np.ascontiguousarray(array), shared_memory=True)
        for target in list(parameter.output(0).get_target_inputs()):
            target.replace_source_output(node.output(0))
        model.remove_parameter(parameter)
    model.validate_nodes_and_infer_types()
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads,
              "INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32"}
    if precision == "int8":
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = INT8_GROUP
    return core.compile_model(model, "CPU", config)
