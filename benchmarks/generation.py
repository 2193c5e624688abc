#!/usr/bin/env python
"""Translation speed: hf_vanilla's encoder-decoder `generate()` against transformers, CTranslate2 and optimum's
engines, on one Marian-shaped model, each contender in a process of its own, all timed in the same rounds.

    taskset -c 0,1 python benchmarks/generation.py       # the three cases, every contender (about an hour, 2 cores)
    python benchmarks/generation.py --cases greedy-8 --rounds 3
    python benchmarks/generation.py --layers 2 --width 32 --vocab 200 --rounds 1 --no-compile   # a smoke run

Model. A transformers MarianMTModel of OPUS-MT's shape: 6 + 6 layers, E=512, 8 heads, FFN 2048, 58101 words shared
by the encoder, the decoder and the output projection, eos 0, pad = decoder start = the last word; random weights
from seed 0, saved with `save_pretrained` beside OPUS-MT's generation_config.json and a Marian tokenizer (a small
sentencepiece model and a vocab.json filled up to the vocabulary with placeholder words: CTranslate2's converter
reads the vocabulary from it; no text is tokenized). hf_vanilla's converter (`hf_vanilla.conversion.convert
("marian", ...)`) makes ours of that folder, CTranslate2's `TransformersConverter` its own. --layers, --width and
--vocab make the model smaller. Random weights repeat a word (the first word depends on the source, then the
same one again): the work is a translation's at a fixed length, but agreement on such tokens is a weak check of a
reduced precision; each case prints how many distinct tokens transformers generated.

Cases. Sources of 16-48 tokens, eos last (seeded ids, the same for every contender), exactly 64 new tokens a row:
end-of-sequence is suppressed until then and generation stops there, transformers' `min_new_tokens =
max_new_tokens = 64` with OPUS-MT's forced eos off (it would make the 64th token eos), CTranslate2's
`min_decoding_length = max_decoding_length = 64` (both count generated tokens without the decoder start;
CTranslate2 returns no eos). Every contender's rows are checked to hold 64 tokens.
    greedy-8   8 rows, greedy
    greedy-1   1 row (the first of greedy-8's), greedy
    beam-8     greedy-8's rows, beam search with 4 beams

Contenders, each on --threads threads (default: every core this process may run on):
    transformers              MarianMTModel.generate, sdpa attention, its default (dynamic) cache: the reference
    transformers compiled     the same with `cache_implementation="static"` and a compile config: the decoding step
                              compiled by torch.compile on the first call of each shape, so the first call holds the
                              compilation (--no-compile leaves it out)
    hf_vanilla                VanillaSeq2SeqForConditionalGeneration.from_pretrained(converted).generate
    hf_vanilla int8           the same after hf_vanilla.precision.quantize_int8
    hf_vanilla bf16           the same in bfloat16, where hf_vanilla.precision.bf16_is_fast()
    CTranslate2               ctranslate2.Translator(compute_type="float32", inter_threads=1,
                              intra_threads=threads).translate_batch on token strings
    CTranslate2 int8          the same at compute_type="int8"
    ONNX Runtime (optimum)    optimum.onnxruntime.ORTModelForSeq2SeqLM exported from the Marian folder, generate
    OpenVINO (optimum)        optimum.intel.OVModelForSeq2SeqLM exported likewise (f32 precision hint), generate
A contender whose engine cannot be imported is reported unavailable with the import error, in the table and the
JSON (one that fails to load or to generate: failed, with its error). optimum's seq2seq engines do not install
beside transformers 5.24: pip resolves optimum-onnx 0.1.0 (it requires transformers<4.58) and optimum-intel 2.2.0
(transformers<5.6) by downgrading transformers, and installed without their dependencies neither imports under
transformers 5.24 (ORTModelForSeq2SeqLM: "cannot import name 'AutoModelForVision2Seq' from 'transformers'"; the
OpenVINO models of optimum.intel: "cannot import name 'VisionRotaryEmbedding' from
'transformers.models.qwen2_vl.modeling_qwen2_vl'").

Method. Each contender runs in a process of its own that imports only its engine: CTranslate2's process imports
neither torch nor onnx (its int8 call ran slower in a process that had imported onnx: benchmarks/int8_ranges.py).
In each case every contender makes two calls, reported as first calls (compilation, caches, thread pools), then
--rounds rounds of one call each, in balanced orders (hf_vanilla.measure.balanced_orders), --settle idle before
each call, so that a slow moment of the shared machine hits every contender of the round. Steady ms is the median
over rounds; the speed-up over transformers and the ratio to CTranslate2 at the same precision are medians of the
per-round ratios t_transformers / t and t_CTranslate2 / t (above 1: faster; CTranslate2 computes no bf16 on a CPU,
so bf16 has no such ratio). Tokens: the share of generated tokens
equal to transformers' float32 tokens, the lowest over the case's calls; a float32 contender must reach 100%, else
the run ends with exit status 1, as when a contender fails.

Output: a table per case, the cold start (conversions, each process's start to ready), and --output, the run as
JSON (default benchmarks/results/generation/<cpu>-<date>.json; an existing file is never written over).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Only the standard library, numpy and _cli (light) at the top: a contender's process imports its own engine and
# nothing else.
import numpy as np
from _cli import at_least, last_error

HERE = Path(__file__).resolve().parent
NEW_TOKENS = 64
SOURCE_LENGTHS = (16, 48)
SEED = 0
EOS, UNK = 0, 1  # OPUS-MT's; pad (the decoder start) is the last word
HEADS = 8
REFERENCE = "transformers"


@dataclass(frozen=True)
class Case:
    rows: int
    beams: int
    description: str


CASES = {"greedy-8": Case(8, 1, "8 rows, greedy"), "greedy-1": Case(1, 1, "1 row, greedy"),
         "beam-8": Case(8, 4, "8 rows, beam search (4 beams)")}

# name -> (engine, precision): the processes `contender_call` starts.
CONTENDERS = {
    "transformers": ("transformers", "fp32"),
    "transformers compiled": ("transformers", "fp32"),
    "hf_vanilla": ("hf_vanilla", "fp32"),
    "hf_vanilla int8": ("hf_vanilla", "int8"),
    "hf_vanilla bf16": ("hf_vanilla", "bf16"),
    "CTranslate2": ("ctranslate2", "fp32"),
    "CTranslate2 int8": ("ctranslate2", "int8"),
    "ONNX Runtime (optimum)": ("optimum", "fp32"),
    "OpenVINO (optimum)": ("optimum", "fp32"),
}
CTRANSLATE2 = {"fp32": "CTranslate2", "int8": "CTranslate2 int8"}  # the ratio column's engine at each precision


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (default: "
                                                                 f"all)")
    parser.add_argument("--rounds", type=at_least(1), default=5, help="timed rounds per case (default 5)")
    parser.add_argument("--layers", type=at_least(1), default=6, help="encoder and decoder layers each (default 6)")
    parser.add_argument("--width", type=at_least(HEADS), default=512,
                        help=f"model width E, a multiple of {HEADS} (the heads); the FFN is 4 E (default 512)")
    parser.add_argument("--vocab", type=at_least(64), default=58101, help="words (default 58101, OPUS-MT's en-de)")
    parser.add_argument("--threads", type=at_least(1), default=len(os.sched_getaffinity(0)),
                        help="threads of every contender (default: the cores this process may run on)")
    parser.add_argument("--settle", type=float, default=0.05,
                        help="seconds idle before each timed call (default 0.05), so that no contender shares the "
                             "cores with the previous one's spinning threads")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out 'transformers compiled' (torch.compile: minutes of compilation per case)")
    parser.add_argument("--output", type=Path, default=None,
                        help="the run as JSON, a new file (default benchmarks/results/generation/<cpu>-<date>.json)")
    parser.add_argument("--worker", choices=list(CONTENDERS), help=argparse.SUPPRESS)  # a contender's process
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)  # the models it loads
    return parser


def checked(parser, args):
    """The arguments, or argparse's error naming the one refused."""
    cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    if not cases or any(name not in CASES for name in cases):
        parser.error(f"argument --cases: {args.cases!r}: choose among {', '.join(CASES)}")
    args.cases = cases
    if args.width % HEADS:
        parser.error(f"argument --width: {args.width} is not a multiple of {HEADS} (the heads)")
    if args.settle < 0:
        parser.error(f"argument --settle: at least 0, got {args.settle}")
    if args.worker is None:
        args.output = args.output or default_output()
        if args.output.exists():
            parser.error(f"argument --output: {args.output} exists: name a new file (a run's figures are never "
                         f"written over another's)")
    return args


def default_output() -> Path:
    """benchmarks/results/generation/<cpu name>-<its widest vector instructions>-<date>.json: a virtual machine's
    model name is often only the vendor's line ("AMD EPYC")."""
    from hf_vanilla.precision import cpu_capabilities, cpu_name

    found = cpu_capabilities()
    vectors = next((name for name in ("amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2") if found[name]), "")
    words = re.sub(r"[^a-z0-9]+", "-", f"{cpu_name() or 'cpu'} {vectors}".lower()).strip("-")
    return HERE / "results" / "generation" / f"{words}-{time.strftime('%Y-%m-%d')}.json"


# ---- sources: the same ids in every process ------------------------------------------------------------------------


def sources(case: Case, vocab: int) -> list:
    """The case's source rows: ids drawn from seed SEED among the words (no eos, unk or pad), eos last. Every case
    draws the same 8 rows and takes its first `case.rows`."""
    generator = np.random.default_rng(SEED)
    lengths = generator.integers(SOURCE_LENGTHS[0], SOURCE_LENGTHS[1] + 1, size=8)
    rows = [[*generator.integers(UNK + 1, vocab - 1, size=n - 1).tolist(), EOS] for n in lengths]
    return rows[:case.rows]


# ---- the model -----------------------------------------------------------------------------------------------------

SENTENCES = ["the quick brown fox jumps over the lazy dog", "attention is all you need",
             "der schnelle braune fuchs springt", "aufmerksamkeit ist alles was man braucht"]


def marian_folder(folder: Path, layers: int, width: int, vocab: int) -> Path:
    """A MarianMTModel of OPUS-MT's make (the module docstring) saved in `folder`, with OPUS-MT's generation config
    and a Marian tokenizer of `vocab` words."""
    import io

    import sentencepiece
    import torch
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    pad = vocab - 1
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SENTENCES * 20), model_writer=model,
                                             vocab_size=40, character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0,
                                             pad_id=-1, minloglevel=2)
    pieces = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    words = {"</s>": EOS, "<unk>": UNK}
    for piece in map(pieces.id_to_piece, range(pieces.get_piece_size())):
        words.setdefault(piece, len(words))
    words |= {f"word{i}": i for i in range(len(words), pad)}  # placeholders up to the vocabulary
    words["<pad>"] = pad  # last, as OPUS-MT has it (CTranslate2 drops it: its decoder starts from zeros)
    folder.mkdir(parents=True)
    for name in ("source.spm", "target.spm"):
        (folder / name).write_bytes(model.getvalue())
    (folder / "vocab.json").write_text(json.dumps(words))
    (folder / "tokenizer_config.json").write_text(json.dumps({"source_lang": "en", "target_lang": "de"}))
    config = MarianConfig(
        vocab_size=vocab, d_model=width, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=4 * width, decoder_ffn_dim=4 * width,
        max_position_embeddings=512, scale_embedding=True, activation_function="swish",
        share_encoder_decoder_embeddings=True, pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=EOS,
        forced_eos_token_id=EOS,
    )
    torch.manual_seed(SEED)
    marian = MarianMTModel(config).eval()
    marian.generation_config = GenerationConfig(  # a converted OPUS-MT's generation_config.json
        bad_words_ids=[[pad]], bos_token_id=EOS, decoder_start_token_id=pad, eos_token_id=EOS,
        forced_eos_token_id=EOS, max_length=512, num_beams=4, pad_token_id=pad, renormalize_logits=True)
    marian.save_pretrained(folder)
    return folder


def prepare(folder: Path, args, cold) -> None:
    """The Marian folder (`marian`), ours converted from it (`ours`) and CTranslate2's (`ct2`), each step timed."""
    from engines import convert_ct2

    from hf_vanilla.conversion import convert

    cold.time("Marian-shaped model built and saved", "transformers",
              lambda: marian_folder(folder / "marian", args.layers, args.width, args.vocab))
    cold.time("convert('marian', ...), verified against transformers", "hf_vanilla",
              lambda: convert("marian", folder / "marian", folder / "ours"))
    try:
        convert_ct2(folder / "marian", folder, cold, "CTranslate2")
    except ImportError as error:  # its processes report it unavailable with their own import error
        print(f"CTranslate2 conversion left out: {type(error).__name__}: {error}")


# ---- a contender's process -----------------------------------------------------------------------------------------


def contender_call(name: str, folder: Path, threads: int, vocab: int):
    """Loads `name`'s engine in this process; returns call(case) -> the generated ids, a list of rows. An
    ImportError means the engine is unavailable here."""
    engine, precision = CONTENDERS[name]
    if engine == "ctranslate2":
        return ctranslate2_call(folder, threads, precision, vocab)
    model = optimum_model(name, folder / "marian", threads) if engine == "optimum" else None  # first: fails fast
    import torch

    torch.set_num_threads(threads)
    if engine == "transformers":
        from transformers import MarianMTModel

        model = MarianMTModel.from_pretrained(folder / "marian", attn_implementation="sdpa").eval()
    elif engine == "hf_vanilla":
        from hf_vanilla import VanillaSeq2SeqForConditionalGeneration
        from hf_vanilla.precision import quantize_int8

        model = VanillaSeq2SeqForConditionalGeneration.from_pretrained(folder / "ours").eval()
        if precision == "int8":
            model = quantize_int8(model)
        elif precision == "bf16":
            model = model.to(torch.bfloat16)
    options = {}
    if name == "transformers compiled":
        from transformers import CompileConfig

        compile_config = CompileConfig(fullgraph=True, dynamic=False)
        compile_config._compile_all_devices = True  # on a CPU transformers compiles only when told to
        options = {"cache_implementation": "static", "compile_config": compile_config}
    inputs = {}

    def call(case: Case) -> list:
        if case not in inputs:  # the request in tensors, made once
            rows = sources(case, vocab)
            ids = torch.full((len(rows), max(map(len, rows))), vocab - 1)
            for i, row in enumerate(rows):
                ids[i, :len(row)] = torch.tensor(row)
            inputs[case] = {"input_ids": ids, "attention_mask": (ids != vocab - 1).long()}
        with torch.inference_mode():
            out = model.generate(**inputs[case], num_beams=case.beams, do_sample=False, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, forced_eos_token_id=None, **options)
        return out[:, 1:].tolist()  # without the decoder start, as CTranslate2 returns them
    return call


def ctranslate2_call(folder: Path, threads: int, precision: str, vocab: int):
    """CTranslate2's Translator on token strings, read from and back to ids through its vocabulary: no torch."""
    import ctranslate2

    words = json.loads((folder / "ct2" / "shared_vocabulary.json").read_text())
    index = {word: i for i, word in enumerate(words)}
    translator = ctranslate2.Translator(str(folder / "ct2"), device="cpu", inter_threads=1, intra_threads=threads,
                                        compute_type={"fp32": "float32", "int8": "int8"}[precision])
    inputs = {}

    def call(case: Case) -> list:
        if case not in inputs:
            inputs[case] = [[words[i] for i in row] for row in sources(case, vocab)]
        results = translator.translate_batch(inputs[case], beam_size=case.beams, max_decoding_length=NEW_TOKENS,
                                             min_decoding_length=NEW_TOKENS)
        return [[index[word] for word in result.hypotheses[0]] for result in results]
    return call


OPTIMUM = {"ONNX Runtime (optimum)": "pip install 'optimum-onnx[onnxruntime]'",
           "OpenVINO (optimum)": "pip install 'optimum-intel[openvino]'"}


def optimum_model(name: str, marian: Path, threads: int):
    """optimum's seq2seq model exported from the Marian folder, on `threads` threads. An ImportError names the
    package to install (the module docstring says what pip makes of it beside transformers 5)."""
    try:
        if name == "ONNX Runtime (optimum)":
            from optimum.onnxruntime import ORTModelForSeq2SeqLM
        else:
            from optimum.intel import OVModelForSeq2SeqLM
    except ImportError as error:
        raise ImportError(f"{error_text(error)} ({OPTIMUM[name]}; see --help)") from error
    if name == "ONNX Runtime (optimum)":
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        return ORTModelForSeq2SeqLM.from_pretrained(marian, export=True, session_options=options,
                                                    provider="CPUExecutionProvider")
    return OVModelForSeq2SeqLM.from_pretrained(marian, export=True, ov_config={
        "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": str(threads),
        "INFERENCE_PRECISION_HINT": "f32"})


def worker(args) -> None:
    """A contender's process: its engine loaded, then one call per request line ({"case": name}) on stdin, each
    answered on stdout with {"seconds", "tokens"} ({"error"} where it failed). The first line answered says "ready",
    "unavailable" or "failed"."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the engines print goes to the log, not into the answers

    def answer(**fields):
        channel.write(json.dumps(fields) + "\n")

    try:
        call = contender_call(args.worker, args.folder, args.threads, args.vocab)
    except ImportError as error:
        return answer(unavailable=str(error) if args.worker in OPTIMUM else error_text(error))
    except Exception as error:  # noqa: BLE001 - the parent reports it; the other contenders run on
        return answer(failed=error_text(error))
    answer(ready=True)
    for line in sys.stdin:
        case = CASES[json.loads(line)["case"]]
        try:
            start = time.perf_counter()
            tokens = call(case)
            answer(seconds=time.perf_counter() - start, tokens=tokens)
        except Exception as error:  # noqa: BLE001
            answer(error=error_text(error))


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:400]


# ---- the parent: processes, rounds, checks -------------------------------------------------------------------------


@dataclass
class Contender:
    """A contender's process, as this one drives it."""

    name: str
    status: str = "ran"  # or "unavailable", "failed", "left out"
    reason: str = None
    ready_s: float = None  # its process's start to ready: imports, load, conversion or export
    process: subprocess.Popen = None
    log: Path = None
    results: dict = field(default_factory=dict)  # case -> {"first": [s, s], "rounds": [s...], "tokens": [...]}

    @property
    def precision(self) -> str:
        return CONTENDERS[self.name][1]

    def start(self, folder: Path, args) -> None:
        self.log = folder / f"{self.name.replace(' ', '_').replace('(', '').replace(')', '')}.log"
        command = [sys.executable, __file__, "--worker", self.name, "--folder", str(folder), "--threads",
                   str(args.threads), "--vocab", str(args.vocab)]
        started = time.perf_counter()
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, bufsize=1)
        first = self.receive()
        self.ready_s = time.perf_counter() - started
        if "ready" not in first:
            self.status, self.reason = next(iter(first.items()))
            self.stop()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            error = " ".join(last_error(self.log.read_text()).split())[:400]
            return {"failed": f"its process ended (exit status {self.process.wait()}): {error}"}
        return json.loads(line)

    def call(self, case_name: str) -> tuple:
        """(seconds, tokens) of one call; RuntimeError where it failed."""
        try:
            self.process.stdin.write(json.dumps({"case": case_name}) + "\n")
        except OSError:  # its process has ended: `receive` says how
            pass
        reply = self.receive()
        if "seconds" not in reply:
            raise RuntimeError(reply.get("error") or reply.get("failed"))
        return reply["seconds"], reply["tokens"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()


def run_case(case_name: str, contenders: list, rounds: int, settle_s: float) -> None:
    """Two first calls of every contender, then `rounds` rounds in balanced orders, `settle_s` idle before each call;
    into each contender's `results[case_name]`. A contender whose call fails leaves the case with the reason."""
    from hf_vanilla.measure import balanced_orders

    active = [c for c in contenders if c.status == "ran"]
    if not active:
        return
    for contender in active:
        contender.results[case_name] = {"first": [], "rounds": [], "tokens": []}

    def timed(contender, key):
        if "failed" in contender.results[case_name]:
            return
        time.sleep(settle_s)
        try:
            seconds, tokens = contender.call(case_name)
        except RuntimeError as error:
            contender.results[case_name] = {"failed": str(error)}
            return
        contender.results[case_name][key].append(seconds)
        contender.results[case_name]["tokens"].append(tokens)

    for _ in range(2):
        for contender in active:
            timed(contender, "first")
    orders = balanced_orders(len(active))
    for i in range(rounds):
        for index in orders[i % len(orders)]:
            timed(active[index], "rounds")


def agreement(expected: list, calls: list) -> float:
    """The lowest share over `calls` of generated tokens equal to `expected`'s at the same place (a missing or extra
    token counts as different)."""
    total = sum(len(row) for row in expected)
    shares = []
    for rows in calls:
        same = sum(a == b for want, got in zip(expected, rows) for a, b in zip(want, got))
        shares.append(same / max(total, sum(len(row) for row in rows)))
    return min(shares)


def case_record(case_name: str, contenders: list, vocab: int) -> dict:
    """The case's figures: per contender its first calls, steady median, speed-up over transformers, ratio to
    CTranslate2 at the same precision (paired per round), token agreement; or why it has none."""
    case = CASES[case_name]
    by_name = {c.name: c for c in contenders}
    record = {"description": case.description, "rows": case.rows, "beams": case.beams, "new_tokens": NEW_TOKENS,
              "source_lengths": [len(row) for row in sources(case, vocab)], "contenders": {}}
    reference = by_name[REFERENCE].results.get(case_name, {})
    expected = reference["tokens"][0] if reference.get("tokens") else None
    if expected is not None:
        record["reference_distinct_tokens"] = len({token for row in expected for token in row})
    for contender in contenders:
        result = contender.results.get(case_name)
        if result is None:
            record["contenders"][contender.name] = {contender.status: contender.reason}
            continue
        if "failed" in result:
            record["contenders"][contender.name] = {"failed": result["failed"]}
            continue
        figures = {"precision": contender.precision, "first_calls_ms": [round(1e3 * s, 1) for s in result["first"]],
                   "rounds_ms": [round(1e3 * s, 1) for s in result["rounds"]],
                   "steady_ms": round(1e3 * statistics.median(result["rounds"]), 1),
                   "tokens_per_row": sorted({len(row) for call in result["tokens"] for row in call})}
        for key, other in (("speedup", REFERENCE), ("vs_ctranslate2", CTRANSLATE2.get(contender.precision))):
            theirs = by_name[other].results.get(case_name, {}).get("rounds") if other in by_name else None
            figures[key] = (round(statistics.median(t / s for t, s in zip(theirs, result["rounds"])), 3)
                            if theirs and len(theirs) == len(result["rounds"]) else None)
        figures["tokens_equal"] = round(agreement(expected, result["tokens"]), 4) if expected is not None else None
        record["contenders"][contender.name] = figures
    return record


def failed_checks(record: dict) -> list:
    """What fails the run: a contender that failed (not one unavailable or left out), a float32 contender whose
    tokens differ from transformers', rows not of NEW_TOKENS tokens."""
    failed = [] if "steady_ms" in record["contenders"][REFERENCE] else ["transformers, the reference, did not run"]
    for name, figures in record["contenders"].items():
        if "failed" in figures:
            failed.append(f"{name} failed: {figures['failed']}")
        if "steady_ms" not in figures:
            continue
        if figures["precision"] == "fp32" and figures["tokens_equal"] not in (1.0, None):
            failed.append(f"{name}: {100 * figures['tokens_equal']:.2f}% of its tokens equal transformers'")
        if figures["tokens_per_row"] != [NEW_TOKENS]:
            failed.append(f"{name}: rows of {figures['tokens_per_row']} tokens, not {NEW_TOKENS}")
    return failed


def ratio_text(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_case(case_name: str, record: dict, rounds: int, settle_s: float) -> None:
    lengths = sorted({min(record["source_lengths"]), max(record["source_lengths"])})
    print(f"\n{case_name}: {record['description']}, source tokens {'-'.join(map(str, lengths))}, {NEW_TOKENS} new "
          f"tokens a row; rounds: {rounds}, {1e3 * settle_s:g} ms idle before each call; distinct tokens in "
          f"transformers' output: {record.get('reference_distinct_tokens', '?')}\n")
    print("| contender | first call 1 ms | first call 2 ms | steady ms | speed-up over transformers | "
          "CTranslate2 (same precision) / it | tokens equal to transformers fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, figures in record["contenders"].items():
        if "steady_ms" not in figures:
            status, reason = next(iter(figures.items()))
            print(f"| {name} | {status}: {reason} ||||||")
            continue
        first = [f"{ms:.0f}" for ms in figures["first_calls_ms"]]
        tokens = "-" if figures["tokens_equal"] is None else f"{100 * figures['tokens_equal']:.1f}%"
        print(f"| {name} | {' | '.join(first)} | {figures['steady_ms']:.0f} | {ratio_text(figures['speedup'])} | "
              f"{ratio_text(figures['vs_ctranslate2'])} | {tokens} |")


def contenders_for(args) -> list:
    from hf_vanilla.precision import bf16_is_fast

    contenders = [Contender(name) for name in CONTENDERS]
    for contender in contenders:
        if contender.name == "transformers compiled" and args.no_compile:
            contender.status, contender.reason = "left out", "--no-compile"
        if contender.precision == "bf16" and not bf16_is_fast():
            contender.status, contender.reason = "left out", ("bf16 is slower than float32 on this CPU "
                                                              "(hf_vanilla.precision.bf16_is_fast() is False)")
    return contenders


def run_record(args, header: list, contenders: list, records: dict, cold_rows: list) -> dict:
    """The run as --output keeps it: the machine, commit and command, the model, each contender's status (and why it
    did not run), each case's figures (`case_record`) and the cold start."""
    from benchmark import cpu_description, git_revision
    from hf_vanilla.precision import cpu_capabilities

    return {
        "cpu": cpu_description(), "machine": header,
        "capabilities": cpu_capabilities(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
        "commit": git_revision(), "command": " ".join(["python", *sys.argv]),
        "model": {"layers": args.layers, "width": args.width, "heads": HEADS, "ffn": 4 * args.width,
                  "vocab": args.vocab},
        "method": f"{args.rounds} rounds in balanced orders after 2 first calls, {1e3 * args.settle:g} ms idle before "
                  f"each call; ratios are medians of per-round ratios",
        "contenders": {c.name: {"precision": c.precision, "status": c.status, "reason": c.reason,
                                "ready_s": None if c.ready_s is None else round(c.ready_s, 1)} for c in contenders},
        "cases": records,
        "cold_start": [{"step": what, "contender": name, "seconds": round(seconds, 1)}
                       for what, name, seconds in cold_rows],
    }


def main(args) -> int:
    import torch

    from engines import ColdStart, cpu_header

    torch.set_num_threads(args.threads)
    header = cpu_header(args.threads)
    print("\n".join(header))
    print(f"model: Marian-shaped, {args.layers} + {args.layers} layers, E={args.width}, {HEADS} heads, FFN "
          f"{4 * args.width}, {args.vocab} words, random weights (seed {SEED})", flush=True)
    cold, contenders, started = ColdStart(), contenders_for(args), time.perf_counter()
    records, failed = {}, []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        prepare(folder, args, cold)
        try:
            for contender in contenders:  # one at a time: each one's load is its own
                if contender.status == "ran":
                    contender.start(folder, args)
                    print(f"  {contender.name}: {contender.status}" + (
                        f" ({contender.reason})" if contender.reason else f", ready in {contender.ready_s:.1f} s"),
                        flush=True)
            for case_name in args.cases:
                run_case(case_name, contenders, args.rounds, args.settle)
                records[case_name] = case_record(case_name, contenders, args.vocab)
                records[case_name]["load_average"] = round(os.getloadavg()[0], 1)  # at its end: how busy it was
                print_case(case_name, records[case_name], args.rounds, args.settle)
                print(f"  ({time.perf_counter() - started:.0f} s, load average {records[case_name]['load_average']})",
                      flush=True)
                failed += [f"{case_name}, {line}" for line in failed_checks(records[case_name])]
        finally:
            for contender in contenders:
                contender.stop()
    print("\nCold start (seconds): the conversions, and each contender's process from its start to ready (imports, "
          "load, export)\n")
    print("| step | contender | seconds |\n|---|---|---:|")
    cold_rows = [*cold.rows, *(("process start to ready", c.name, c.ready_s) for c in contenders if c.status == "ran")]
    for what, name, seconds in cold_rows:
        print(f"| {what} | {name} | {seconds:.1f} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(run_record(args, header, contenders, records, cold_rows), indent=1) + "\n")
    print(f"\nThe run's figures: {args.output}; total {time.perf_counter() - started:.0f} s")
    for line in failed:
        print(f"CHECK FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    PARSER = build_parser()
    ARGS = checked(PARSER, PARSER.parse_args())
    if ARGS.worker is not None:
        sys.exit(worker(ARGS))
    sys.exit(main(ARGS))
