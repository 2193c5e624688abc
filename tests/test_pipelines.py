"""`pipeline(task, model=CONVERTED_DIR)` gives the answers that the same pipeline gives on the BERT checkpoint it was
converted from: same tokens, labels and entities, scores within the float32 rule of tests/numerics.py.

Feature extraction runs on the real all-MiniLM-L6-v2; the task heads are small random BERTs with the real
vocabulary and deliberately decisive output layers (see hf_references.py). transformers 5 has no
question-answering pipeline; the QA head is compared on its start/end logits instead.
"""

import numbers

import numpy as np
import pytest
import torch
from hf_references import NER_LABELS, converted, single_thread  # noqa: F401  (fixture)
from numerics import assert_close
from transformers import AutoTokenizer, BertForQuestionAnswering, pipeline

import hf_vanilla  # noqa: F401  (registers the Auto classes: no trust_remote_code needed)
from hf_vanilla import (
    VanillaEncoderForMaskedLM,
    VanillaEncoderForQuestionAnswering,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
)

pytestmark = pytest.mark.usefixtures("single_thread")
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hugging Face is based in New York City and Paris.",
    "I loved this film, although the ending was a little slow.",
    "Marie Curie was born in Warsaw.",
]


def assert_same_answers(ours, theirs, path="output"):
    """Structural equality, with floats (scores, computed in float32) compared at the float32 rule."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), f"{path}: {ours} vs {theirs}"
        for key in theirs:
            assert_same_answers(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), f"{path}: {ours} vs {theirs}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_answers(a, b, f"{path}[{i}]")
    elif isinstance(theirs, numbers.Real) and not isinstance(theirs, numbers.Integral):
        assert_close(float(ours), float(theirs), dtype=torch.float32, msg=path)
    else:
        assert ours == theirs, f"{path}: {ours!r} vs {theirs!r}"


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory, minilm_path):
    """task name -> (our pipeline, the reference's pipeline), built lazily."""
    cache = {}

    def get(task, kind):
        if (task, kind) not in cache:
            reference, vanilla = converted(tmp_path_factory, minilm_path, kind)
            cache[task, kind] = (pipeline(task, model=str(vanilla)), pipeline(task, model=str(reference)))
        return cache[task, kind]

    return get


def test_feature_extraction_on_real_minilm(pipelines):
    ours, theirs = pipelines("feature-extraction", "minilm")
    assert isinstance(ours.model, VanillaEncoderModel)
    for sentence in SENTENCES:
        a, b = np.array(ours(sentence)), np.array(theirs(sentence))
        assert a.shape == b.shape and a.shape[-1] == 384
        assert_close(a, b, dtype=torch.float32)  # the pipeline hands back float32 results as Python lists
    a, b = ours(SENTENCES[:2], return_tensors=True), theirs(SENTENCES[:2], return_tensors=True)
    for x, y in zip(a, b):
        assert_close(x, y)


def test_fill_mask(pipelines):
    ours, theirs = pipelines("fill-mask", "masked-lm")
    assert isinstance(ours.model, VanillaEncoderForMaskedLM)
    inputs = ["The capital of France is [MASK].", "I [MASK] this movie.", "[MASK] went to the [MASK] yesterday."]
    for text in inputs:
        answer = ours(text, top_k=5)
        assert_same_answers(answer, theirs(text, top_k=5))
        # consecutive answers differ by > 1e-3 in logit (log score ratio), a hundred times the numerical error
        # between the two implementations: the order compared is decided, not a coin toss
        for answers in answer if isinstance(answer[0], list) else [answer]:
            scores = np.array([a["score"] for a in answers])
            assert (np.log(scores[:-1] / scores[1:]) > 1e-3).all(), scores
    targets = ["paris", "london", "rome"]
    assert_same_answers(ours(inputs[0], targets=targets), theirs(inputs[0], targets=targets))


def test_text_classification(pipelines):
    ours, theirs = pipelines("text-classification", "sentiment")
    assert isinstance(ours.model, VanillaEncoderForSequenceClassification)
    assert_same_answers(ours(SENTENCES), theirs(SENTENCES))
    assert_same_answers(ours(SENTENCES, top_k=None), theirs(SENTENCES, top_k=None))
    labels = {answer["label"] for answer in ours(SENTENCES)}
    assert labels <= {"NEGATIVE", "POSITIVE"}
    pair = {"text": "A man is playing a guitar.", "text_pair": "Someone makes music."}
    assert_same_answers(ours(pair, top_k=None), theirs(pair, top_k=None))


@pytest.mark.parametrize("aggregation_strategy", ["none", "simple", "first"])
def test_token_classification(pipelines, aggregation_strategy):
    ours, theirs = pipelines("token-classification", "ner")
    assert isinstance(ours.model, VanillaEncoderForTokenClassification)
    answers = ours(SENTENCES, aggregation_strategy=aggregation_strategy)
    assert_same_answers(answers, theirs(SENTENCES, aggregation_strategy=aggregation_strategy))
    found = [entity for sentence in answers for entity in sentence]
    assert found, "the comparison should cover some entities"
    if aggregation_strategy != "none":
        assert {e["entity_group"] for e in found} <= {label[2:] for label in NER_LABELS[1:]}
        assert all(isinstance(e["start"], int) and e["end"] > e["start"] for e in found)  # offsets: fast tokenizer


@pytest.mark.parametrize("multi_label", [False, True])
def test_zero_shot_classification(pipelines, multi_label):
    ours, theirs = pipelines("zero-shot-classification", "nli")
    assert isinstance(ours.model, VanillaEncoderForSequenceClassification)
    assert ours.entailment_id == theirs.entailment_id == 2
    labels = ["travel", "cooking", "politics", "sport"]
    for sentence in SENTENCES[:3]:
        answer = ours(sentence, candidate_labels=labels, multi_label=multi_label)
        assert_same_answers(answer, theirs(sentence, candidate_labels=labels, multi_label=multi_label))
        assert sorted(answer["labels"]) == sorted(labels)


def test_question_answering_is_no_longer_a_pipeline(tmp_path_factory, minilm_path):
    """What docs/hf_integration.md and examples/question_answering.py work around."""
    _, vanilla_dir = converted(tmp_path_factory, minilm_path, "qa")
    with pytest.raises(KeyError, match="question-answering"):
        pipeline("question-answering", model=str(vanilla_dir))


def test_question_answering_head_matches_bert(tmp_path_factory, minilm_path):
    """transformers 5 removed the QA pipeline; the head's start/end logits are what any QA decoding reads."""
    reference_dir, vanilla_dir = converted(tmp_path_factory, minilm_path, "qa")
    ours = VanillaEncoderForQuestionAnswering.from_pretrained(vanilla_dir).eval()
    theirs = BertForQuestionAnswering.from_pretrained(reference_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(vanilla_dir)
    batch = tokenizer(["Where was Marie Curie born?", "What is the capital of France?"],
                      ["Marie Curie was born in Warsaw, then part of the Russian Empire.", "Paris is."],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = ours(**batch), theirs(**batch)
    real = batch["attention_mask"].bool()
    assert_close(a.start_logits[real], b.start_logits[real])
    assert_close(a.end_logits[real], b.end_logits[real])
    # the same best start and end token in every row
    for ours_logits, their_logits in ((a.start_logits, b.start_logits), (a.end_logits, b.end_logits)):
        best = ours_logits.masked_fill(~real, -1e4).argmax(-1)
        assert torch.equal(best, their_logits.masked_fill(~real, -1e4).argmax(-1))
