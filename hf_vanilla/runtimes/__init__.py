"""Engines that run a loaded vanilla model, each behind `from_pretrained(path, runtime=NAME)`.

An engine wraps the model from beside it: it receives the model, finds what it runs through the model's public API
(`config`, `base_model`, `get_encoder()`, `forward`, `parameters()`), and puts its own callable in front of a
module's forward, falling back to that forward wherever it cannot give the same answer. It imports no model class
(only the machinery below them: `export` for its graphs, `kernels.is_tracing`, `measure` for its choice), and the
model never imports it: hf_vanilla/runtime_registry.py names each engine and imports it when asked.

    onnxruntime/      ONNX Runtime for the encoders (`runtime="onnxruntime"`; needs the onnx extra)
"""
