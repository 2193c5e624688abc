"""Engines that run a loaded vanilla model, each behind `from_pretrained(path, runtime=NAME)`.

An engine wraps the model from beside it: it receives the model, finds what it runs through the model's public API
(`config`, `base_model`, `get_encoder()`, `forward`, `parameters()`), and puts its own callable in front of a
module's forward, falling back to that forward wherever it cannot give the same answer. It imports no model class
(only the machinery below them: `export` for its graphs, `kernels.is_tracing`, `measure` for its choice), and the
model never imports it: hf_vanilla/runtime_registry.py names each engine and imports it when asked.

    onnxruntime/      ONNX Runtime for the encoders, fed the model's own weights (`runtime="onnxruntime"`), or
                      holding the encoder bodies' weights, at float32 or int8 (`runtime_options={"owned": True}`)
    openvino/         OpenVINO for the encoder bodies, holding their weights (`runtime="openvino"`)
    auto.py           whichever of those (or eager PyTorch) measured fastest for the model on this machine, the
                      decision kept beside the graphs (`runtime="auto"`; decision.py: the paths, the key, the file)

What they share, a module per job (both need the onnx extra: they run the graph `hf_vanilla.export` traces):

    attached.py       what every engine is (in front of a module's forward, able to give it back), and taking
                      engines off: one engine at a time
    options.py        the engines' options (precision, threads, cache_dir, ...), checked in one place
    owned.py          how an engine holds the weights it compiled: taken at attach, saved and loaded through its
                      doors, each change followed or refused
    holding.py        what it holds them with: the marker, the read-only views, giving the tensors back
    choice.py         which answers a request size, the engine or PyTorch, measured in the process
    watch.py          what the graph was traced from, and the check on every call that the model is still that
    cache.py          graphs on disk: keys, checks, atomic writes, what may be removed
    batches.py        a call served, each step once (`serve`): the request read in numpy (the one request
                      check), the path chosen, padded rows grouped by length, the module's output built

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
