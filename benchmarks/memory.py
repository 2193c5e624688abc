"""Resident memory of a loaded model per runtime: after load, the load's peak and after N calls, in MiB over a
baseline and as a ratio to the checkpoint's size, each runtime measured in a fresh process.

    python benchmarks/memory.py                      # all-MiniLM-L6-v2, converted into a temporary folder
    python benchmarks/memory.py --model bert-base    # bert-base's shape, random weights (seed 0), offline
    python benchmarks/memory.py --model PATH --calls 5
    python benchmarks/memory.py --model bert-base --runtimes openvino --shapes 1x16 1x64 1x96 8x128
                                                     # where memory grows with the request's size

Graphs are traced into a cache first, as a server finds them. The baseline is taken after importing torch,
transformers and both engines and loading OpenVINO's CPU plugin: their libraries are not the model's memory. What
counts is VmRSS (the peak: VmHWM, reset at the baseline), so a checkpoint left memory-mapped counts as far as its
pages were read (they are the page cache's, shared between processes and reclaimable); `anon` is the part no file
backs. "auto" measures every engine before it chooses, so its load is the slowest.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _cli import at_least, child_output, shape  # noqa: E402
from benchmarks.embed_corpus_engines import converted_minilm  # noqa: E402

RUNTIMES = {"eager": None, "onnxruntime": {}, "onnxruntime owned": {"owned": True}, "openvino": {}, "auto": {},
            "auto fastest": {"precision": "fastest"}}

# Run in the child: prints one JSON line of the figures, in MiB.
PROBE = """
import gc, json, sys
def status():
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) / 1024 for line in f
                if line.startswith(("VmRSS", "VmHWM", "RssAnon"))}
path, runtime, options, calls, cache, shapes = (sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]),
                                                sys.argv[5], json.loads(sys.argv[6]))
import torch, transformers, onnxruntime, openvino
from hf_vanilla.modeling_encoder import VanillaEncoderModel
openvino.Core().get_property("CPU", "FULL_DEVICE_NAME")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) from here on
base = status()
kw = {} if options is None else dict(runtime=runtime.split()[0], runtime_options=dict(cache_dir=cache, **options))
model = VanillaEncoderModel.from_pretrained(path, **kw).eval()
gc.collect()
load = status()
after = []
for shape in shapes:  # calls of each shape in turn, resident memory after each shape's
    ids = torch.randint(1000, 2000, shape)
    with torch.no_grad():
        for _ in range(calls):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    after.append(status()["VmRSS"] - base["VmRSS"])
print(json.dumps({"load": load["VmRSS"] - base["VmRSS"], "anon": load["RssAnon"] - base["RssAnon"],
                  "peak": load["VmHWM"] - base["VmRSS"], "calls": after}))
"""


def converted_bert_base(folder: Path) -> Path:
    """transformers' BertModel(BertConfig()) (bert-base's shape, weights drawn from seed 0), converted to ours and
    saved into `folder`: a bert-base-sized checkpoint without the Hub."""
    import torch
    from transformers import BertConfig, BertModel

    from hf_vanilla.conversion.formats.bert import bert_to_vanilla

    torch.manual_seed(0)
    reference = BertModel(BertConfig()).eval()
    bert_to_vanilla(reference.state_dict(), reference.config.to_dict(), "base").save_pretrained(folder)
    return folder


MODELS = {"minilm": converted_minilm, "bert-base": converted_bert_base}  # built into the temporary folder


def measured(model: Path, runtime: str, calls: int, cache: str, shapes: list) -> dict:
    """The figures of `runtime` loading `model` and called `calls` times with each of `shapes`, in a fresh Python
    process."""
    options = json.dumps(RUNTIMES[runtime])
    case = f"runtime {runtime!r} on {model}, " + (
        f"{calls} calls of each of {', '.join(f'{rows}x{tokens}' for rows, tokens in shapes)}" if shapes else
        "tracing its graph into the cache")
    out = child_output([sys.executable, "-c", PROBE, str(model), runtime, options, str(calls), cache,
                        json.dumps(shapes)], case=case, cwd=REPO)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm", help=f"a converted checkpoint's folder, or one of {list(MODELS)} "
                                                          f"built here (default: minilm, all-MiniLM-L6-v2 converted)")
    parser.add_argument("--calls", type=at_least(1), default=5, help="calls of each shape after the load")
    parser.add_argument("--shapes", nargs="+", type=shape, default=[(8, 128)], metavar="BxT",
                        help="request shapes (rows x tokens), called in turn; memory is printed after each")
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=list(RUNTIMES))
    args = parser.parse_args()
    if args.model not in MODELS and not any(Path(args.model).glob("*.safetensors")):
        parser.error(f"argument --model: no checkpoint (*.safetensors) in {args.model}: pass a converted checkpoint's "
                     f"folder, or one of {list(MODELS)}")
    from hf_vanilla.precision import cpu_name

    with tempfile.TemporaryDirectory(prefix="hf_vanilla-memory-") as folder:
        model = MODELS[args.model](Path(folder) / args.model) if args.model in MODELS else Path(args.model)
        size = sum(file.stat().st_size for file in model.glob("*.safetensors")) / 2**20
        print(f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores; {model.name}: checkpoint {size:.0f} MiB; "
              f"MiB over the baseline (ratio to the checkpoint); {args.calls} calls of each shape")
        print(f"{'runtime':<20}{'after load':>16}{'anon':>8}{'load peak':>16}"
              + "".join(f"{f'after {rows}x{tokens}':>16}" for rows, tokens in args.shapes))
        cache = str(Path(folder) / "graphs")  # one cache for every runtime: its graphs are traced once
        for runtime in args.runtimes:
            if runtime.split()[0] not in ("eager", "auto"):  # its graph traced and cached first: a load as a server's
                measured(model, runtime, 0, cache, [])
            figures = measured(model, runtime, args.calls, cache, args.shapes)
            print(f"{runtime:<20}" + "".join(f"{mib:>8.0f} ({mib / size:.2f})".rjust(16) if key != "anon" else
                                             f"{mib:>8.0f}" for key, mib in [
                                                 *((key, figures[key]) for key in ("load", "anon", "peak")),
                                                 *(("after", mib) for mib in figures["calls"])]))


if __name__ == "__main__":
    main()
