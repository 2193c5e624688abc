"""The Hugging Face integration examples run end to end (as subprocesses, with small settings) and print what they
promise; the attention maps and the QA span decoding are also checked in-process."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_references import converted, single_thread  # noqa: F401  (fixture)
from numerics import assert_close
from transformers import AutoModel, AutoTokenizer, BertModel
from transformers.modeling_outputs import QuestionAnsweringModelOutput

import hf_vanilla  # noqa: F401

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.usefixtures("single_thread")


def run_example(name: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MPLBACKEND": "Agg"}
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name.removesuffix('.py')}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def minilm(tmp_path_factory, minilm_path):
    """(the original all-MiniLM-L6-v2, its vanilla conversion)"""
    return converted(tmp_path_factory, minilm_path, "minilm")


def test_fill_mask(tmp_path):
    out = run_example("fill_mask.py", "--text", "The capital of France is [MASK].", "--top-k", "3", cwd=tmp_path)
    assert "RANDOM and UNTRAINED" in out  # the default model has no real masked-LM weights, and says so
    answers = re.findall(r"^  (\d\.\d{4})  (\S+)$", out, flags=re.M)
    assert len(answers) == 3
    scores = [float(score) for score, _ in answers]
    assert scores == sorted(scores, reverse=True)
    assert "Same tokens as transformers' BERT pipeline" in out


def test_question_answering(tmp_path):
    module = load_example("question_answering.py")
    out = run_example("question_answering.py", cwd=tmp_path)
    assert "RANDOM and UNTRAINED" in out
    span = re.search(r"^Answer:   '(.*)'  \(characters (\d+)-(\d+)", out, flags=re.M)
    assert span, out
    text, start, end = span.group(1), int(span.group(2)), int(span.group(3))
    assert text and module.CONTEXT[start:end] == text  # a real span of the context, cut at token boundaries


def test_question_answering_span_decoding(minilm):
    """With logits that point at "Warsaw", the decoding recovers exactly that text from the context."""
    module = load_example("question_answering.py")
    tokenizer = AutoTokenizer.from_pretrained(minilm[1])
    encoding = tokenizer(module.QUESTION, module.CONTEXT, truncation="only_second", max_length=384)
    target = encoding["input_ids"].index(tokenizer.convert_tokens_to_ids("warsaw"))
    question_token = 3  # a higher-scoring token inside the question must be ignored: answers come from the context

    def fake_model(**batch):
        T = batch["input_ids"].shape[1]
        start, end = torch.zeros(1, T), torch.zeros(1, T)
        start[0, target], end[0, target] = 5.0, 5.0
        start[0, question_token], end[0, question_token] = 9.0, 9.0
        end[0, target - 3] = 7.0  # an end before the start must be ignored too
        return QuestionAnsweringModelOutput(start_logits=start, end_logits=end)

    result = module.answer(fake_model, tokenizer, module.QUESTION, module.CONTEXT, 384, 30)
    assert result["answer"] == "Warsaw"
    assert (result["start_token"], result["end_token"]) == (target, target)


def test_finetune_classification(tmp_path, minilm):
    out = run_example("finetune_classification.py", "--source", str(minilm[1]), "--max-steps", "12", "--lr", "2e-4",
                      cwd=tmp_path)
    loss = re.search(r"^held-out loss: (\S+) before, (\S+) after", out, flags=re.M)
    accuracy = re.search(r"^held-out accuracy: (\S+) before fine-tuning, (\S+) after", out, flags=re.M)
    assert loss and accuracy, out
    assert float(loss.group(2)) < float(loss.group(1))
    assert 0.0 <= float(accuracy.group(2)) <= 1.0


def test_sentence_similarity(tmp_path):
    out = run_example("sentence_similarity.py", "--query", "Who is making music?", "--top-k", "2", cwd=tmp_path)
    assert "Cosine similarity between the sentences:" in out
    hits = re.findall(r"^  (\d\.\d{4})  (.+)$", out.split("Query: Who is making music?")[1], flags=re.M)
    assert {text for _, text in hits} == {"A man is playing a guitar.", "Someone is playing an instrument."}


def test_visualize_attention_writes_a_png(tmp_path, minilm):
    output = tmp_path / "maps" / "attention.png"
    out = run_example("visualize_attention.py", "--source", str(minilm[1]), "--output", str(output),
                      "--layers", "0", "5", "--heads", "0", "1", "2", cwd=tmp_path)
    assert f"Wrote {output} (2 layers x 3 heads)" in out
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 10_000


def test_attention_maps_are_distributions_that_skip_padding(minilm):
    reference_dir, vanilla_dir = minilm
    module = load_example("visualize_attention.py")
    tokenizer = AutoTokenizer.from_pretrained(vanilla_dir)
    batch = tokenizer(["A short one.", "A much longer sentence, so that the first one is padded."], padding=True,
                      return_tensors="pt")
    model = AutoModel.from_pretrained(vanilla_dir, attn_implementation="eager").eval()
    weights = module.attention_weights(model, batch)  # (L, B, H, T, T)
    L, B, H, T, _ = weights.shape
    assert (L, B, H) == (6, 2, 12)
    assert_close(weights.sum(-1), torch.ones(L, B, H, T))
    padding_keys = batch["attention_mask"] == 0  # (B, T)
    assert padding_keys.any()
    assert (weights.permute(1, 4, 0, 2, 3)[padding_keys] == 0).all()  # no query reads a padding token

    sdpa = AutoModel.from_pretrained(vanilla_dir).eval()  # the default backend gives the same maps
    assert torch.equal(module.attention_weights(sdpa, batch), weights)

    bert = BertModel.from_pretrained(reference_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = torch.stack(bert(**batch, output_attentions=True).attentions)
    real_queries = batch["attention_mask"].bool()[None, :, None, :, None].expand_as(weights)
    assert_close(weights[real_queries], theirs[real_queries])
