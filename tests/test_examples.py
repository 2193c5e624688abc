"""Every example runs end to end the way its docstring shows, on its default model (as a subprocess, scaled down
only through its documented options), and prints what it promises; errors are one line naming the fix. The
attention maps, the QA span decoding and the shared options are also checked in-process.

examples/train_seq2seq.py is trained to accuracy in tests/test_train_seq2seq.py and examples/train_accelerate.py
is run in tests/test_accelerate.py; here train_seq2seq.py only runs a few steps as a script."""

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
sys.path.insert(0, str(EXAMPLES))  # the examples import examples/_common.py
import _common  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def run_script(name: str, *args: str, cwd: Path, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run examples/`name` as a user would, offline; `python` replaces the plain `python script.py` launch."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg"}
    command = [sys.executable, *python] if python else [sys.executable, str(EXAMPLES / name)]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def run_example(name: str, *args: str, cwd: Path) -> str:
    result = run_script(name, *args, cwd=cwd)
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


def test_quickstart_converts_the_bundled_minilm_and_reruns(tmp_path):
    """README's first command, offline: convert, verify, reload, similarities; a second run replaces the output."""
    for _ in range(2):
        out = run_example("quickstart.py", cwd=tmp_path)
        assert "--output converted/minilm --head base" in out
        assert "OK: max |diff| against BertModel" in out
        assert "VanillaEncoderModel: 6 layers, width 384" in out
        assert "every related pair scores above every unrelated one" in out
        assert "The converted model is in converted/minilm/" in out
    assert (tmp_path / "converted" / "minilm" / "model.safetensors").is_file()
    assert "--force" in out  # the second run replaced its own earlier conversion


def test_quickstart_leaves_a_folder_it_did_not_write_alone(tmp_path):
    """An existing folder that is not an earlier conversion is kept, and the converter says why."""
    mine = tmp_path / "converted" / "minilm"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    result = run_script("quickstart.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "refuses to replace" in result.stderr and "choose another --output" in result.stderr  # why, and the way out
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"


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


def test_finetune_classification(tmp_path):
    out = run_example("finetune_classification.py", "--max-steps", "12", "--lr", "2e-4", cwd=tmp_path)
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


def test_visualize_attention_writes_a_png(tmp_path):
    """The bundled MiniLM, converted by the script; a subset of the maps, into a folder that does not exist yet."""
    output = tmp_path / "maps" / "attention.png"
    out = run_example("visualize_attention.py", "--output", str(output), "--layers", "0", "5", "--heads", "0", "1", "2",
                      cwd=tmp_path)
    assert f"Wrote {output} (2 layers x 3 heads)" in out
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 10_000


def test_semantic_search(tmp_path):
    out = run_example("semantic_search.py", "--top-k", "2", cwd=tmp_path)
    assert "VanillaEncoderModel, max_seq_length=256, pooling=mean" in out
    hits = re.findall(r"^  (\d\.\d{4})  (.+)$", out.split("Query: A man is eating pasta.")[1], flags=re.M)
    assert [text for _, text in hits[:2]] == ["A man is eating food.", "A man is eating a piece of bread."]


def test_onnx_greedy_decode_default_path(tmp_path):
    """No arguments: a random seq2seq, exported to ONNX here, decoded greedily on ONNX Runtime = generate()."""
    out = run_example("onnx_greedy_decode.py", "--max-new-tokens", "6", cwd=tmp_path)
    rows = re.findall(r"ONNX Runtime: (\[.*\])\n\s+generate\(\):   (\[.*\])", out)
    assert len(rows) == 3 and all(ours == theirs for ours, theirs in rows)
    assert out.rstrip().endswith("identical")


def test_train_seq2seq_runs_as_a_script(tmp_path):
    """A few steps through the command line: the last line is the documented accuracy line, the exit status 0."""
    out = run_example("train_seq2seq.py", "--steps", "5", "--hidden-size", "32", "--ffn-size", "64",
                      "--max-len", "4", "--batch-size", "8", "--eval-size", "10", cwd=tmp_path)
    assert re.search(r"exact-match accuracy: \d\.\d{3}$", out.rstrip())


def test_errors_are_one_line_naming_the_fix_and_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    result = run_script("fill_mask.py", "--source", missing, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --source") and result.stderr.count("\n") == 1, result.stderr
    assert missing in result.stderr and "Pass a local checkpoint directory" in result.stderr
    assert "Traceback" not in result.stderr and "--debug shows the traceback" in result.stderr

    result = run_script("fill_mask.py", "--source", missing, "--debug", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback (most recent call last)" in result.stderr


def test_a_missing_extra_is_named(tmp_path):
    """Without matplotlib (hidden here), visualize_attention.py says which extra installs it, before any work."""
    launcher = ("-c", "import runpy, sys; sys.modules['matplotlib'] = None; sys.path.insert(0, sys.argv[1]); "
                      "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')",
                str(EXAMPLES), str(EXAMPLES / "visualize_attention.py"))
    result = run_script("visualize_attention.py", cwd=tmp_path, python=launcher)
    assert result.returncode == 2
    assert result.stderr == ("error: this example needs matplotlib, which hf_vanilla's 'examples' extra installs: "
                             "pip install -e \".[examples]\" in a clone (or pip install matplotlib) "
                             "(--debug shows the traceback)\n")


def test_threads_default_to_one_and_zero_keeps_torchs_default():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        _common.parse(_common.parser("doc"), ["--threads", "0"])
        assert torch.get_num_threads() == 3
        _common.parse(_common.parser("doc"), [])
        assert torch.get_num_threads() == 1
        _common.parse(_common.parser("doc", threads=2), [])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


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

    # The default backend gives the same maps, within float32 rounding: its projections may run on the other matmul
    # kernel, which hf_vanilla/kernels.py picks by measuring the first calls of each shape.
    sdpa = AutoModel.from_pretrained(vanilla_dir).eval()
    assert_close(module.attention_weights(sdpa, batch), weights)

    bert = BertModel.from_pretrained(reference_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = torch.stack(bert(**batch, output_attentions=True).attentions)
    real_queries = batch["attention_mask"].bool()[None, :, None, :, None].expand_as(weights)
    assert_close(weights[real_queries], theirs[real_queries])
