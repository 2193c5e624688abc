"""Reference BERT checkpoints for the Hugging Face integration tests, and their vanilla conversions.

Each reference is a small random transformers `BertFor*` model with the real bert-base-uncased vocabulary (the
MiniLM tokenizer files are copied next to it), so that pipelines tokenise real text. BERT's initialisation gives
logits so flat that the order of the top-k answers could flip on a 1e-7 difference; larger random weights and
`_sharpen` make them spread out, so that the reference and the conversion are compared on answers that are clearly
decided.

`converted(tmp_path_factory, minilm_path, kind)` builds a (reference, conversion) pair once per test session and
hands the same directories to every test file that asks.
"""

import shutil
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# initializer_range 0.3 (BERT's is 0.02): at BERT's scale a random 2-layer model gives every input almost the same
# [CLS] vector, so classifiers would answer the same for every sentence; at this scale the inputs matter.
SMALL = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             initializer_range=0.3)
NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
NLI_LABELS = ["contradiction", "neutral", "entailment"]

# kind -> (transformers class, converter --head, extra config)
KINDS = {
    "masked-lm": (BertForMaskedLM, "masked-lm", {}),
    "sentiment": (BertForSequenceClassification, "sequence-classification",
                  {"id2label": {0: "NEGATIVE", 1: "POSITIVE"}}),
    "nli": (BertForSequenceClassification, "sequence-classification",
            {"id2label": dict(enumerate(NLI_LABELS))}),
    "ner": (BertForTokenClassification, "token-classification", {"id2label": dict(enumerate(NER_LABELS))}),
    "qa": (BertForQuestionAnswering, "question-answering", {}),
    "base": (BertModel, "base", {}),
}

_CACHE: dict[str, tuple[Path, Path]] = {}


def make_reference(kind: str, directory: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a small random `BertFor*` of `kind` with the tokenizer from `tokenizer_dir`; returns `directory`."""
    model_class, _, extra = KINDS[kind]
    config = BertConfig(**SMALL, **extra)
    if "id2label" in extra:
        config.label2id = {label: i for i, label in extra["id2label"].items()}
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _sharpen(model, kind)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy2(Path(tokenizer_dir) / name, directory / name)
    return directory


@torch.no_grad()
def _sharpen(model, kind: str) -> None:
    """Make the output layer decisive: logits with a spread of a few units instead of ~0.1.

    The masked-LM decoder is the embedding matrix, already at the larger scale: its logits spread by ~2 (more would
    put their float32 rounding near the 1e-5 budget)."""
    if kind in ("sentiment", "nli"):
        model.classifier.weight.normal_(0, 0.5)  # logits of a few units: larger ones eat into the 1e-5 budget
    elif kind == "ner":
        model.classifier.weight.normal_(0, 0.5)
        model.classifier.bias.copy_(torch.tensor([1.5, 0.0, 0.0, 0.0, 0.0]))  # mostly "O": separate entities
    elif kind == "qa":
        model.qa_outputs.weight.normal_(0, 0.5)


def converted(tmp_path_factory, minilm_path, kind: str) -> tuple[Path, Path]:
    """(reference directory, converted vanilla directory) for `kind`, built once per session.

    kind "minilm" is the real all-MiniLM-L6-v2 (a BertModel) and its conversion."""
    if kind not in _CACHE:
        from hf_vanilla.conversion import flow
        from hf_vanilla.conversion.formats import bert

        root = tmp_path_factory.mktemp(f"ref-{kind}")
        if kind == "minilm":
            reference, head = Path(minilm_path), "base"
        else:
            reference, head = make_reference(kind, root / "bert", minilm_path), KINDS[kind][1]
        with redirect_stdout(StringIO()):  # the converter prints its per-layer parity report
            output = flow.convert(bert.FORMAT, str(reference), str(root / "vanilla"), head=head)
        _CACHE[kind] = (reference, Path(output))
    return _CACHE[kind]


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's small models on one thread (use with `pytestmark = pytest.mark.usefixtures("single_thread")`).

    Their ops are tiny: handing each to a second thread costs more than it saves, and on a busy machine the waiting
    threads spin for whole time slices (40 training steps of a 32-wide model took 20 s of CPU on two threads and
    0.6 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
