"""Engines that run a loaded vanilla model, each behind `from_pretrained(path, runtime=NAME)`.

An engine wraps the model from beside it: it receives the model, finds what it runs through the model's public API
(`config`, `base_model`, `get_encoder()`, `forward`, `parameters()`), and puts its own callable in front of a
module's forward, falling back to that forward wherever it cannot give the same answer. It imports no model class
(only the machinery below them: `export` for its graphs, `kernels.is_tracing`, `measure` for its choice), and the
model never imports it: hf_vanilla/runtime_registry.py names each engine and imports it when asked.

The engines: onnxruntime/ (`runtime="onnxruntime"`, fed the model's own weights or, with `owned=True`, holding
them), openvino/ (`runtime="openvino"`, holding them) and auto.py (`runtime="auto"`: whichever measured fastest
here). What they share is a module per job beside them (both need the onnx extra: they run the graph
`hf_vanilla.export` traces). Every module and its job: README.md's Layout, the one map.

Adding an engine. An engine fed the model's weights on every call subclasses `attached.Engine` (as
onnxruntime/engine.py does): nothing is copied, so no write can go stale and any encoder runs, but the engine lays
the weights out for its kernels on every call. It provides `give_back()`, and a `__call__` that hands the call to
`batches.serve` with its own call (what it runs for a request, and where PyTorch must answer instead). An engine
that lays the weights out once, when it compiles (int8 products, a compiled plan), must own them: it subclasses `owned.OwnedEncoder` (as openvino/engine.py and onnxruntime/held.py
do), which takes and guards the weights, checks the request, decides the path and follows or refuses each change;
the subclass names itself (`RUNTIME`, `REMOVE`, `PRECISIONS`, `FOLLOWS`) and provides `build` (compile the graph
with given weights at a precision), `run` (the graph's outputs for some feeds) and `outputs_of`, and may provide
`run_dense` and `for_shape` for its fastest path. Either registers its name in hf_vanilla/runtime_registry.py.
"""
