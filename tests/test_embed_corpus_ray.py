"""examples/embed_corpus.py --engine ray: a pool of Ray actors gives the one-process torch engine's embeddings, line
for line, in the same folder; a worker SIGKILLed in the middle of its batch is restarted by Ray and nothing is lost
or repeated; a driver SIGKILLed in mid-write resumes, embedding only what is missing, and refuses to resume with
another model or corpus, and takes the local Ray it started down with it; Parquet and JSON lines columns give the
text file's embeddings.

The corpus is 90 sentences of gensim's Lee corpus (real English news) and 3 blank lines, the model the converted
all-MiniLM-L6-v2. Ray starts three times in this module: in each of the first two tests, as the script's own local
Ray (no --ray-address), and once for the others, as a cluster of two nodes on this machine (ray.cluster_utils.Cluster, one
CPU each), which the script's driver joins with --ray-address: with --workers 2 each worker runs on its own node,
as on two machines. The drivers are subprocesses, so that one can be SIGKILLed.
"""

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy
import pytest
import torch
from hf_references import converted
from numerics import assert_close
from safetensors.torch import load_file, save_file
from test_accelerate import launch
from test_examples import load_example

from _common import ExampleError  # examples/_common.py: test_examples puts examples/ on sys.path

pytest.importorskip("ray", reason="the Ray engine needs ray[data] (hf_vanilla's 'ray' extra)")
gensim_utils = pytest.importorskip("gensim.test.utils", reason="gensim ships the Lee corpus (real English news)")
import pyarrow  # noqa: E402  (ray[data] installs it)
import pyarrow.parquet  # noqa: E402

SENTENCES = 12 * 8 - 6  # 90: with --shard-size 8, 12 shards, the last one short


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, minilm_path):
    """(converted MiniLM folder, corpus file, the corpus's lines with blank ones, the non-blank lines' numbers)."""
    with open(gensim_utils.datapath("lee_background.cor"), encoding="latin-1") as file:
        text = file.read()
    lines = [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 4][:SENTENCES]
    for position, blank in ((0, "  "), (17, ""), (60, "\t")):
        lines.insert(position, blank)  # skipped, and numbered as lines
    path = tmp_path_factory.mktemp("corpus") / "lee.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    kept = torch.tensor([i for i, line in enumerate(lines) if line.strip()])
    return converted(tmp_path_factory, minilm_path, "minilm")[1], path, lines, kept


def embed(model, path, output, *extra, env=None, check=True):
    """examples/embed_corpus.py as a user runs it, in a process of its own (its Ray workers: one thread each)."""
    args = ["--model", str(model), "--input", str(path), "--output", str(output), "--shard-size", "8",
            "--batch-size", "4", "--threads", "1", *extra]
    result = launch("embed_corpus.py", *args, env=env)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def embed_here(model, path, output, *extra):
    """main() in this process: for what is refused before any worker starts."""
    load_example("embed_corpus.py").main(["--model", str(model), "--input", str(path), "--output", str(output),
                                          "--shard-size", "8", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """(line numbers, embeddings) of the torch engine on one process: the answer every Ray run must give."""
    model, path, _, kept = corpus
    output = tmp_path_factory.mktemp("one") / "embeddings"
    embed(model, path, output)
    lines, embeddings = load_example("embed_corpus.py").load_embeddings(output)
    assert torch.equal(lines, kept)
    return lines, embeddings


def assert_complete(output, one_process):
    """Every sentence in exactly one shard, and the folder reads as the one-process run's, line for line."""
    rows = torch.cat([load_file(p)["lines"] for p in sorted(output.glob("shard-*.safetensors"))])
    assert torch.equal(rows.sort().values, one_process[0])  # none lost, none repeated
    assert not list(output.glob("*.partial"))
    lines, embeddings = load_example("embed_corpus.py").load_embeddings(output)
    assert torch.equal(lines, one_process[0])
    assert_close(embeddings, one_process[1])


def test_without_an_address_a_local_ray_embeds_a_jsonl_column_as_one_process(corpus, one_process, tmp_path):
    """No --ray-address and no cluster to find: ray.init() starts a local Ray (one node). The input is a JSON lines
    file whose `sentence` column holds the text file's lines (a null where one was blank): rows are numbered as the
    lines were, and the embeddings are the one-process run's. (ray.init() would join a Ray another process began on
    this machine, which /tmp/ray names: RAY_TMPDIR points it at an empty folder, short enough for Ray's sockets.)"""
    model, _, lines, _ = corpus
    path = tmp_path / "lee.jsonl"
    rows = [{"id": i, "sentence": None if line == "" else line} for i, line in enumerate(lines)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    output, ray_tmp = tmp_path / "embeddings", tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        result = embed(model, path, output, "--column", "sentence", "--engine", "ray", "--workers", "2",
                       env={"RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert "0 already done, 12 to embed on 2 Ray worker(s) x 1 thread(s)" in result.stdout
    assert re.search(r"\(Ray at \S+, 1 node\(s\)\)", result.stdout), result.stdout
    assert re.search(r"embedded 90 sentences in [\d.]+ s \([\d.]+ sentences/s\) on 2 Ray worker", result.stdout)
    assert_complete(output, one_process)


def ray_processes(ray_tmp: str) -> list[str]:
    """The processes started with RAY_TMPDIR=`ray_tmp` (a Ray's, the driver's and its watcher), by pid and name."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"RAY_TMPDIR={ray_tmp}".encode() in environ.read_bytes().split(b"\0"):
                found.append(f"{environ.parent.name} {(environ.parent / 'comm').read_text().strip()}")
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


@pytest.mark.slow
def test_a_driver_killed_on_the_local_ray_it_started_takes_that_ray_with_it(corpus, tmp_path):
    """No --ray-address: the driver starts a local Ray, and SIGKILLs itself in mid-write. Every process of that Ray
    is gone within seconds: the raylet's DashboardAgent and RuntimeEnvAgent stayed a minute (waiting to report the
    raylet's death to the dead GCS) where nothing ended them."""
    model, path, _, _ = corpus
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        killed = embed(model, path, tmp_path / "embeddings", "--engine", "ray", "--workers", "1", check=False,
                       env={"RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp, "EMBED_CORPUS_KILL_AFTER_SHARDS": "2"})
        assert killed.returncode != 0 and "Started a local Ray instance" in killed.stderr, killed.stderr[-3000:]
        deadline, left = time.monotonic() + 15, ray_processes(ray_tmp)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = ray_processes(ray_tmp)
        assert not left, f"left running after the driver died: {left}"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_the_torch_engine_reads_a_parquet_column_as_the_text_file(corpus, one_process, tmp_path):
    model, _, lines, _ = corpus
    path = tmp_path / "lee.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": lines, "n": list(range(len(lines)))}), path)
    output = tmp_path / "embeddings"
    embed(model, path, output)
    assert_complete(output, one_process)


@pytest.fixture(scope="module")
def cluster():
    """The address of a Ray cluster of two nodes on this machine, one CPU each (the head and one more raylet)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        ray.shutdown()  # this process joined it where a test ran main() here
        cluster.shutdown()


@pytest.mark.slow
def test_two_nodes_with_a_worker_killed_mid_batch_give_the_one_process_embeddings(cluster, corpus, one_process,
                                                                                   tmp_path):
    """Two workers, one on each node; the first to claim the marker file SIGKILLs itself after embedding a batch and
    before returning it. Ray starts it again and the block is embedded again: the run completes, every sentence once."""
    model, path, _, _ = corpus
    output, marker = tmp_path / "embeddings", tmp_path / "killed-once"
    result = embed(model, path, output, "--engine", "ray", "--ray-address", cluster, "--workers", "2",
                   env={"EMBED_CORPUS_KILL_WORKER_ONCE": str(marker)})
    assert marker.exists(), "no worker was killed"
    assert re.search(rf"\(Ray at {re.escape(cluster)}, 2 node\(s\)\)", result.stdout), result.stdout
    assert_complete(output, one_process)


def contents(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_killed_driver_resumes_from_what_it_wrote_and_only_with_what_it_began_with(cluster, corpus, one_process,
                                                                                     tmp_path):
    """The driver SIGKILLs itself halfway through writing its third shard (its workers go with it): two whole shards
    and a `.partial` are left. A resume with the model's weights rewritten, or a line of the corpus edited, is refused
    naming what differs, changing nothing; the same command then embeds the 10 missing shards only."""
    model, path = shutil.copytree(corpus[0], tmp_path / "model"), tmp_path / "lee.txt"
    corpus_bytes, weights = corpus[1].read_bytes(), (model / "model.safetensors").read_bytes()
    path.write_bytes(corpus_bytes)
    output, ray = tmp_path / "embeddings", ("--engine", "ray", "--ray-address", cluster, "--workers", "2")
    killed = embed(model, path, output, *ray, env={"EMBED_CORPUS_KILL_AFTER_SHARDS": "2"}, check=False)
    assert killed.returncode != 0
    finished = {p.name: p.stat().st_mtime_ns for p in output.glob("shard-*.safetensors")}
    assert len(finished) == 2 and len(list(output.glob("*.partial"))) == 1, sorted(p.name for p in output.iterdir())
    assert not (output / "index.safetensors").exists()
    before = contents(output)

    tensors = load_file(model / "model.safetensors")
    tensors["encoder.layers.0.ffn.down_proj.bias"] += 0.01  # another model in the same folder
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExampleError, match=rf"{output} holds embeddings of another run: the model's files differ "
                                           rf"\(model\.safetensors\)\. Resuming would mix the two"):
        embed_here(model, path, output, *ray)
    (model / "model.safetensors").write_bytes(weights)
    path.write_bytes(corpus_bytes.replace(b"Hundreds of people", b"Hundreds of dogs", 1))
    with pytest.raises(ExampleError, match=r"the corpus differs \(a line added, removed, moved or edited\)"):
        embed_here(model, path, output, *ray)
    assert contents(output) == before

    path.write_bytes(corpus_bytes)
    resumed = embed(model, path, output, *ray)
    assert "2 already done, 10 to embed on 2 Ray worker(s)" in resumed.stdout
    done = sum(len(load_file(output / name)["lines"]) for name in finished)  # 16, or 10 with the short last shard
    assert f"embedded {SENTENCES - done} sentences in " in resumed.stdout, resumed.stdout
    for name, mtime in finished.items():  # finished shards were kept, not recomputed
        assert (output / name).stat().st_mtime_ns == mtime, name
    assert_complete(output, one_process)


def test_more_workers_than_the_cluster_holds_are_refused_before_anything_is_written(cluster, corpus, tmp_path):
    with pytest.raises(ExampleError, match=rf"--workers 3 needs 3 CPU\(s\) \(1 CPU\(s\) per worker, --threads\), "
                                           rf"but the Ray cluster at {re.escape(cluster)} has 2 CPU\(s\) now: pass "
                                           rf"--workers 2 or fewer, or add nodes"):
        embed_here(corpus[0], corpus[1], tmp_path / "out", "--engine", "ray", "--ray-address", cluster,
                   "--workers", "3")
    assert not (tmp_path / "out").exists()


def test_an_address_nothing_answers_at_is_refused_at_once(corpus, tmp_path):
    """ray.init() waited minutes for it, printing retries."""
    with pytest.raises(ExampleError, match=r"--ray-address 127\.0\.0\.1:1: nothing answers there \(Connection "
                                           r"refused\)\. Start a cluster with `ray start --head` and pass the address"):
        embed_here(corpus[0], corpus[1], tmp_path / "out", "--engine", "ray", "--ray-address", "127.0.0.1:1")
    assert not (tmp_path / "out").exists()


def test_a_worker_whose_model_folder_differs_from_the_drivers_refuses_to_embed(corpus):
    """On a cluster each node reads the model from its own disk: a node with another copy would give shards of two
    models. Its worker names the files that differ (the Ray test above shows such an error reaching the driver's one
    line; here the worker itself, without Ray)."""
    ray_engine = load_example("_embed_ray.py")
    model = corpus[0]
    digests = {**ray_engine.model_files(model), "model.safetensors": "0" * 64}
    settings = ray_engine.Settings("mean", True, 128, "float32")
    worker = ray_engine.Worker(str(model), settings, digests, threads=1, gpu=False, kill_marker=None)
    with pytest.raises(ExampleError, match=rf"{model} on \S+ holds another model than the driver's "
                                           rf"\(model\.safetensors differ\): give every node the same model folder"):
        worker({"shard": numpy.zeros(1), "line": numpy.zeros(1), "text": numpy.array(["A sentence."], dtype=object)})


@pytest.mark.parametrize("extra, message", [
    (("--workers", "2"), "--workers is for --engine ray; with the torch engine the launcher sets the processes"),
    (("--engine", "ray", "--workers", "0"), "--workers must be at least 1, got 0"),
])
def test_options_of_the_other_engine_are_refused(corpus, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit:
        embed_here(corpus[0], corpus[1], tmp_path / "out", *extra)
    assert exit.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_table_column_is_named_and_checked_before_the_model_loads(corpus, tmp_path):
    """A missing column, one that is not text, and --column with a text file: each one line, with nothing read past
    the corpus (here there is no model to read)."""
    path = tmp_path / "rows.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": ["A sentence."], "n": [1]}), path)
    with pytest.raises(ExampleError, match=rf"--column 'sentence' is not in {path}; it has \['text', 'n'\]"):
        embed_here(tmp_path / "no-model", path, tmp_path / "out", "--column", "sentence")
    with pytest.raises(ExampleError, match=rf"--column 'n' of {path} holds int64, not text"):
        embed_here(tmp_path / "no-model", path, tmp_path / "out", "--column", "n")
    with pytest.raises(ExampleError, match=rf"--input {corpus[1]} is read as text, one sentence per line: drop "
                                           rf"--column"):
        embed_here(tmp_path / "no-model", corpus[1], tmp_path / "out", "--column", "text")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "A sentence."}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ExampleError, match=rf"--input {broken} cannot be read as JSON lines \("):
        embed_here(tmp_path / "no-model", broken, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.jsonl", "rows.parquet"]
