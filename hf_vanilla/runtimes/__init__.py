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
                      decision kept beside the graphs (`runtime="auto"`)

What they share, a room per job (both need the onnx extra: they run the graph `hf_vanilla.export` traces):

    attached.py       what every engine is (in front of a module's forward, able to give it back), and taking
                      engines off: one engine at a time
    options.py        the engines' options (precision, threads, cache_dir, ...), checked in one place
    owned.py          how an engine holds the weights it compiled: taken at attach, saved and loaded through its
                      doors, each change followed or refused
    choice.py         which answers a request size, the engine or PyTorch, measured in the process
    watch.py          what the graph was traced from, and the check on every call that the model is still that
    cache.py          graphs on disk: keys, checks, atomic writes, what may be removed
    batches.py        the request read in numpy, padded rows grouped by length
"""
