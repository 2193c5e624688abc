"""examples/embed_corpus.py: the converted all-MiniLM-L6-v2 embeds a corpus like sentence-transformers does with
the original; two processes (torchrun, gloo) give the one-process embeddings; a run killed in mid-write resumes
without losing, repeating or rewriting a sentence; and a folder made with other settings is refused, untouched."""

import fcntl
import json
import os
import random
import shutil

import pytest
import torch
from hf_references import converted
from numerics import assert_close
from safetensors.torch import load_file, save_file
from test_accelerate import launch
from test_examples import load_example

from _common import ExampleError  # examples/_common.py: test_examples puts examples/ on sys.path

pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402

WORDS = ("the river town council voted on a new bridge after floods closed the old road for weeks while farmers "
         "waited and children walked two hours to school each morning through fields of wheat").split()


def sentence(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))).capitalize() + "."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, minilm_path):
    """(converted MiniLM folder, corpus file, its line numbers with text, sentence-transformers' embeddings)."""
    rng = random.Random(0)
    lines = [sentence(rng) for _ in range(90)]
    # Characters that str.splitlines() ends a line at, and only "\n" does here (\f, NEL, the Unicode line separator);
    # and Windows line endings, whose "\r" belongs to the ending.
    for position, separator in ((5, "\f"), (30, "\x85"), (50, "\u2028")):
        lines[position] = lines[position].replace(" ", separator, 1)
    lines[40] += "\r"
    for position, blank in ((0, "  "), (17, "\r"), (60, "  ")):
        lines.insert(position, blank)  # blank lines are skipped, and the index says so
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    kept = [i for i, line in enumerate(lines) if line.strip()]
    expected = SentenceTransformer(str(minilm_path), device="cpu").encode([lines[i].removesuffix("\r") for i in kept],
                                                                          convert_to_tensor=True)
    return converted(tmp_path_factory, minilm_path, "minilm")[1], path, torch.tensor(kept), expected


def embed(model, path, output, *extra, processes=1, env=None, check=True):
    args = ["--model", str(model), "--input", str(path), "--output", str(output), "--shard-size", "8",
            "--batch-size", "4", "--threads", "1", *extra]
    result = launch("embed_corpus.py", *args, processes=processes, env=env)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """(line numbers, embeddings, the output folder) of a one-process run."""
    model, path, _, _ = corpus
    output = tmp_path_factory.mktemp("one") / "embeddings"
    embed(model, path, output)
    return *load_example("embed_corpus.py").load_embeddings(output), output


def test_one_process_embeds_like_sentence_transformers(corpus, one_process):
    _, _, kept, expected = corpus
    lines, embeddings, _ = one_process
    assert torch.equal(lines, kept)
    assert_close(embeddings, expected)  # mean pooling over real tokens, then unit length, as the original


def test_two_processes_resume_after_a_kill_and_equal_one_process(corpus, one_process, tmp_path):
    model, path, kept, _ = corpus
    output = tmp_path / "embeddings"
    # Each process SIGKILLs itself halfway through writing its third shard, as a crash would (torchrun may end the
    # other process first when one dies).
    killed = embed(model, path, output, processes=2, env={"EMBED_CORPUS_KILL_AFTER_SHARDS": "2"}, check=False)
    assert killed.returncode != 0
    finished = {p.name: p.stat().st_mtime_ns for p in output.glob("shard-*.safetensors")}
    assert 2 <= len(finished) <= 4, sorted(finished)  # whole shards only: two per process at most
    assert list(output.glob("*.partial")), "the kill should have left a half-written shard behind"
    assert not (output / "index.safetensors").exists()

    resumed = embed(model, path, output, processes=2)
    assert f"{len(finished)} already done, {12 - len(finished)} to embed on 2 process(es)" in resumed.stdout
    for name, mtime in finished.items():  # finished shards were kept, not recomputed
        assert (output / name).stat().st_mtime_ns == mtime, name
    assert not list(output.glob("*.partial"))
    rows = torch.cat([load_file(p)["lines"] for p in sorted(output.glob("shard-*.safetensors"))])
    assert torch.equal(rows.sort().values, kept)  # every sentence exactly once: none lost, none repeated

    lines, embeddings = load_example("embed_corpus.py").load_embeddings(output)
    assert torch.equal(lines, one_process[0])
    assert_close(embeddings, one_process[1])

    before = {p.name: p.stat().st_mtime_ns for p in output.iterdir()}
    other_settings = {**json.loads((output / "manifest.json").read_text()), "max_length": 32}
    with pytest.raises(ExampleError, match="max_length"):
        load_example("embed_corpus.py").check_manifest(output, other_settings)
    assert {p.name: p.stat().st_mtime_ns for p in output.iterdir()} == before


def refused(result, message: str) -> None:
    """The script ended as every example does on a user's error: status 2 and one `error:` line naming the fix."""
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.count("error: ") == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr.splitlines()[-1], result.stderr


def test_an_error_is_one_line_with_status_2(corpus, tmp_path):
    refused(embed(corpus[0], tmp_path / "missing.txt", tmp_path / "out", check=False),
            f"error: --input {tmp_path / 'missing.txt'}: no such file; pass a UTF-8 text file")


def contents(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_run_resumes_only_with_what_it_began_with(corpus, one_process, tmp_path):
    """A run is keyed by what it embeds. Killed after two shards, it was resumed after its model folder was rewritten
    (shards of two models) and after a blank line of its corpus moved (then "repeats lines" at every rerun): both are
    refused now, naming what differs and changing nothing. With both as they were, it resumes."""
    model, path = shutil.copytree(corpus[0], tmp_path / "model"), tmp_path / "corpus.txt"
    corpus_bytes, weights = corpus[1].read_bytes(), (model / "model.safetensors").read_bytes()
    path.write_bytes(corpus_bytes)
    output = tmp_path / "embeddings"
    killed = embed(model, path, output, env={"EMBED_CORPUS_KILL_AFTER_SHARDS": "2"}, check=False)
    assert killed.returncode != 0 and len(list(output.glob("shard-*.safetensors"))) == 2
    before = contents(output)

    tensors = load_file(model / "model.safetensors")
    tensors["encoder.layers.0.ffn.down_proj.bias"] += 0.01  # another model in the same folder
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    refused(embed(model, path, output, check=False),
            f"{output} holds embeddings of another run: the model's files differ (model.safetensors). Resuming would "
            f"mix the two: choose another --output, or rerun with the model, corpus and settings that made them")
    (model / "model.safetensors").write_bytes(weights)

    lines = corpus_bytes.split(b"\n")
    lines.insert(5, lines.pop(0))  # the first line, blank, moved: the same sentences, on other lines
    path.write_bytes(b"\n".join(lines))
    refused(embed(model, path, output, check=False), "the corpus differs (a line added, removed, moved or edited)")
    assert contents(output) == before

    path.write_bytes(corpus_bytes)
    assert "2 already done, 10 to embed" in embed(model, path, output).stdout
    lines, embeddings = load_example("embed_corpus.py").load_embeddings(output)
    assert torch.equal(lines, one_process[0])
    assert_close(embeddings, one_process[1])


def embed_here(model, path, output, *extra):
    """examples/embed_corpus.py's main() in this process (on this process's thread count): for errors, which it
    raises as the ExampleError that `_common.run` prints as one line with exit status 2."""
    load_example("embed_corpus.py").main(["--model", str(model), "--input", str(path), "--output", str(output),
                                          "--threads", str(torch.get_num_threads()), *extra])


def test_what_can_be_checked_before_the_model_loads_is(tmp_path):
    """A corpus that is not UTF-8 failed with a UnicodeDecodeError once the model had loaded, and an --output that is
    a file with a NotADirectoryError: both are named before the model is read (here there is none to read)."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("first line\nsecond line, café\n".encode("latin-1"))
    with pytest.raises(ExampleError, match=rf"--input {latin1} is not UTF-8 text: byte 0xe9 on line 2 is not valid "
                                           rf"UTF-8\. Convert the file to UTF-8"):
        embed_here(tmp_path / "no-model", latin1, tmp_path / "out")
    (tmp_path / "notes.txt").write_text("a user's file")
    with pytest.raises(ExampleError, match=rf"--output {tmp_path / 'notes.txt'} is a file; pass a folder"):
        embed_here(tmp_path / "no-model", tmp_path / "notes.txt", tmp_path / "notes.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.txt", "notes.txt"]


def test_a_max_length_past_the_position_table_is_refused_before_anything_is_written(corpus, tmp_path):
    """It was written into the manifest and failed in the first shard holding a longer sentence; the manifest then
    refused the corrected rerun (another max_length)."""
    path = tmp_path / "long.txt"
    path.write_text(" ".join(["word"] * 600) + "\nA short one.\n", encoding="utf-8")
    with pytest.raises(ExampleError, match=r"--max-length is 1024, but the model's position table holds 512 positions "
                                           r"\(max_position_embeddings=512, position_offset=0\): pass --max-length 512 "
                                           r"or less"):
        embed_here(corpus[0], path, tmp_path / "out", "--max-length", "1024")
    assert not (tmp_path / "out").exists()


def test_a_damaged_manifest_is_named_with_the_way_out(corpus, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "manifest.json").write_text('{"corpus_sha256": "12')  # cut short
    with pytest.raises(ExampleError, match=rf"{output / 'manifest.json'} is damaged \(.*\): the shards in {output} "
                                           rf"cannot be matched to a corpus and a model without it\. Delete {output} "
                                           rf"to start again, or choose another --output"):
        embed_here(corpus[0], corpus[1], output)
    assert contents(output) == {"manifest.json": b'{"corpus_sha256": "12'}


def test_a_damaged_shard_is_embedded_again(corpus, one_process, tmp_path):
    """A shard file cut short (a copy interrupted, a disk that failed) made every rerun fail the same way, in reading
    it for the index: it is named and embedded again, the others kept."""
    output = shutil.copytree(one_process[2], tmp_path / "embeddings")
    damaged = output / "shard-00003.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    kept = {p.name: p.stat().st_mtime_ns for p in output.glob("shard-*") if p != damaged}
    resumed = embed(corpus[0], corpus[1], output)
    assert f"Note: {damaged} cannot be read (" in resumed.stdout and "): embedding it again" in resumed.stdout
    assert "11 already done, 1 to embed" in resumed.stdout
    assert {p.name: p.stat().st_mtime_ns for p in output.glob("shard-*") if p != damaged} == kept
    lines, embeddings = load_example("embed_corpus.py").load_embeddings(output)
    assert torch.equal(lines, one_process[0])
    assert_close(embeddings, one_process[1])


def test_a_second_run_into_a_folder_in_use_is_refused(corpus, tmp_path):
    """Two runs into one folder wrote each shard's `.partial` file together, and one died renaming it. A run holds
    its folder (flock, which the kernel drops when the process ends, SIGKILL included: the kill-and-resume tests
    resume): a second is refused, writing nothing."""
    output = tmp_path / "out"
    output.mkdir()
    held = os.open(output, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a run in another process holds it
    try:
        with pytest.raises(ExampleError, match=rf"{output} is being written by another run of embed_corpus\.py: wait "
                                               rf"for it to end, or choose another --output"):
            embed_here(corpus[0], corpus[1], output)
    finally:
        os.close(held)
    assert list(output.iterdir()) == []
