"""The Ray engine of examples/embed_corpus.py (`--engine ray`): the torch engine's plan and folder, embedded by a pool
of Ray actors.

The driver (the process the user started) reads the corpus, makes the plan and holds the output folder exactly as
the torch engine's main process does (_corpus.py). The shards still to do become a Ray Data dataset, one block per
shard, of rows (shard, line, text) in the plan's order, so that a batch holds neighbouring sentences of nearly
equal token counts. `map_batches` with an ActorPoolStrategy of `--workers` actors embeds them: each actor loads the
model once (`_corpus.Embedder`, the torch engine's batches) and returns every row with its embedding. The driver
streams the results back and writes each shard, atomically, once all its rows are in, in the plan's row order: the
folder is the torch engine's, row for row.

Why the driver writes: the workers then need neither the corpus nor the output folder, only the model folder at
the same path on every node (each worker checks that its copy's files are the driver's), and the lock, the manifest
and the exactly-once checks stay in one process. What comes back is small: 1.5 kB a sentence for a 384-wide model.

Faults. Ray Data starts its actors with max_restarts=-1 and max_task_retries=-1: a worker that dies is started
again and the block it held is embedded again. The driver places each row once (a row arriving twice is an error,
never a second copy) and `write_index` checks at the end that every sentence is in exactly one shard. A driver that
dies takes its job's workers with it, and the local Ray it started, if it started one (`fate_share_local_ray`); the
same command then embeds only the shards not on disk.
"""

import dataclasses
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy
import torch

import _common
import _corpus
from _common import ExampleError
from _corpus import Embedder, Settings, model_files  # the worker's: see `embeddings` for why not `_corpus.NAME`

KILL_WORKER_ONCE = "EMBED_CORPUS_KILL_WORKER_ONCE"  # the testing hook: see embed_corpus.py's docstring


@dataclasses.dataclass(frozen=True)
class Pool:
    """The actors a run asks the cluster for."""
    address: str
    nodes: int
    workers: int
    threads: int  # torch threads, and CPUs reserved, per worker
    gpu: bool  # one GPU per worker


def connect(args) -> Pool:
    """ray.init() at --ray-address (default: as Ray finds a cluster, else a new local one), and the pool that fits
    the cluster: refused, naming the numbers, when --workers asks for more than it has now."""
    import ray

    if args.ray_address:
        check_answers(args.ray_address)
    # ignore_reinit_error: main() run again in one process (a notebook, a test) uses the Ray it joined before
    context = ray.init(address=args.ray_address, ignore_reinit_error=True)
    fate_share_local_ray()
    address = context.address_info["gcs_address"]
    resources = ray.cluster_resources()
    cpus, gpus = resources.get("CPU", 0), int(resources.get("GPU", 0))
    threads, gpu = args.threads or 1, gpus >= 1 and not args.cpu
    fits = int(min(cpus // threads, gpus if gpu else cpus))
    has = f"{cpus:g} CPU(s)" + (f" and {gpus} GPU(s)" if gpu else "")
    if fits == 0:
        raise ExampleError(f"a Ray worker needs {threads} CPU(s) (--threads {threads}), but the Ray cluster at "
                           f"{address} has {has}: pass a smaller --threads, or add nodes")
    workers = args.workers or fits
    if workers > fits:
        needs = f"{workers * threads} CPU(s)" + (f" and {workers} GPU(s)" if gpu else "")
        raise ExampleError(f"--workers {workers} needs {needs} ({threads} CPU(s) per worker, --threads), but the Ray "
                           f"cluster at {address} has {has} now: pass --workers {fits} or fewer, or add nodes")
    nodes = sum(node["Alive"] for node in ray.nodes())
    return Pool(address, nodes, workers, threads, gpu)


# The watcher `fate_share_local_ray` starts: it reads its stdin, the driver's end of a pipe, until the driver is gone
# (EOF, however it ended), then kills each process (pid, start time) it was given that is still that process.
REAPER = """
import sys, psutil
sys.stdin.read()
for pid, started in zip(*[iter(map(float, sys.argv[1:]))] * 2):
    try:
        process = psutil.Process(int(pid))
        if process.create_time() == started:
            process.kill()
    except psutil.Error:
        pass
"""


def fate_share_local_ray():
    """Where ray.init() started a local Ray (its processes are this driver's descendants), make every one of them end
    with the driver, SIGKILLed or not. Ray ends its GCS and raylet with the driver (they die with their parent), but
    the raylet's DashboardAgent and RuntimeEnvAgent, seeing it gone, first report its death to the GCS, which is gone
    too, and wait a minute for that (Ray 2.60's publish_error_to_driver, 60 s) before they exit. A small watcher,
    in a session of its own, kills them as soon as the driver is gone; on a clean exit (ray.shutdown) it finds none
    left. Joining a cluster (--ray-address, or one Ray found), the driver started nothing: no watcher."""
    import subprocess

    import psutil  # a dependency of Ray's

    started = [(process.pid, process.create_time()) for process in psutil.Process().children(recursive=True)]
    if started and not _WATCHERS:  # one watcher: main() run again in this process joins the Ray it started
        _WATCHERS.append(subprocess.Popen([sys.executable, "-c", REAPER, *map(repr, sum(started, ()))],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))


_WATCHERS = []  # held, so that the pipe to the watcher stays open while this process lives


def check_answers(address: str):
    """Refuse a HOST:PORT that nothing answers at now: ray.init() would wait for it for minutes."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return  # a ray:// client address, "auto", "local": ray.init() resolves them
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as error:
        raise ExampleError(f"--ray-address {address}: nothing answers there ({error.strerror or error}). Start a "
                           f"cluster with `ray start --head` and pass the address it prints (HOST:6379)") from None


class Worker:
    """One Ray actor: the model loaded once; a batch of rows (shard, line, text) in, the same rows with their
    (B, E) float32 embeddings out."""

    def __init__(self, folder: str, settings: Settings, digests: dict, threads: int, gpu: bool,
                 kill_marker: str | None):
        torch.set_num_threads(threads)
        found = model_files(Path(folder))
        differ = sorted(name for name in found.keys() | digests.keys() if found.get(name) != digests.get(name))
        # A node with another copy would give shards of two models. Refused at the first batch, not here: Ray
        # reports an exception raised here as the actor's death, in words; one raised by a call reaches the driver
        # as the exception itself, which then prints it as the one line it is.
        self.problem = differ and (f"{folder} on {socket.gethostname()} holds another model than the driver's "
                                   f"({', '.join(differ)} differ): give every node the same model folder at the same "
                                   f"path")
        self.embed = None if differ else Embedder(Path(folder), settings, "cuda" if gpu else "cpu")
        self.kill_marker = kill_marker

    def __call__(self, batch: dict) -> dict:
        if self.problem:
            raise ExampleError(self.problem)
        embeddings = self.embed(batch["text"].tolist())
        if self.kill_marker and claim(self.kill_marker):
            os.kill(os.getpid(), signal.SIGKILL)  # the testing hook: a worker dies holding a batch it has embedded
        return {"shard": batch["shard"], "line": batch["line"], "embedding": embeddings.numpy()}


def claim(marker: str) -> bool:
    """Create `marker`; False if it exists (another worker, or this one before a restart, claimed it)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


class ShardRows:
    """One shard's rows as they come back, put in the plan's row order; complete when every row has come once."""

    def __init__(self, index: int, lines: torch.Tensor):
        self.index, self.row_of = index, {line: row for row, line in enumerate(lines.tolist())}
        self.filled = torch.zeros(len(lines), dtype=torch.bool)
        self.embeddings = None  # (n, E), allocated when the first rows tell E

    def add(self, lines: numpy.ndarray, embeddings: numpy.ndarray) -> bool:
        strays = [line for line in lines.tolist() if line not in self.row_of]
        if strays:
            raise RuntimeError(f"a Ray worker returned lines {strays[:5]} as shard {self.index}'s, which the plan "
                               f"puts elsewhere")
        rows = torch.tensor([self.row_of[line] for line in lines.tolist()], dtype=torch.int64)
        if self.filled[rows].any() or len(rows.unique()) < len(rows):
            raise RuntimeError(f"a row of shard {self.index} came back twice from the Ray workers; nothing of it "
                               f"was written")
        if self.embeddings is None:
            self.embeddings = torch.empty(len(self.filled), embeddings.shape[1], dtype=torch.float32)
        self.embeddings[rows] = torch.from_numpy(embeddings)
        self.filled[rows] = True
        return bool(self.filled.all())


def embed(args, plan: _corpus.Plan, folder: Path, output: Path):
    """Embed the shards of `plan` that `output` lacks on a Ray actor pool, writing each from this process."""
    if output.is_dir():
        _corpus.check_manifest(output, plan.manifest)  # a rerun of another run is refused before Ray starts
    pool = connect(args)  # and a pool the cluster cannot hold, before anything is written
    with _corpus.hold(output):
        pending = _corpus.start(output, plan)
        print(f"{len(plan.corpus.sentences)} sentences in {len(plan.shards)} shards; "
              f"{len(plan.shards) - len(pending)} already done, {len(pending)} to embed on {pool.workers} Ray "
              f"worker(s) x {pool.threads} thread(s){' and a GPU' if pool.gpu else ''} (Ray at {pool.address}, "
              f"{pool.nodes} node(s)); {plan.settings.describe()}", flush=True)
        start = time.perf_counter()
        first = write_as_they_come(embeddings(args, plan, folder, pool, pending), plan, pending, output) if pending \
            else start
        elapsed = time.perf_counter() - start
        _corpus.write_index(output, plan)
        _corpus.report(output, plan, pending, elapsed, f"{pool.workers} Ray worker(s) x {pool.threads} thread(s) "
                       f"on {pool.nodes} node(s), the workers' start (loading the model) included: the first rows "
                       f"came back after {first - start:.1f} s")


def embeddings(args, plan: _corpus.Plan, folder: Path, pool: Pool, pending: list[int]):
    """The Ray Data dataset of the pending shards' rows with their embeddings: one block per shard, batches of
    --batch-size neighbouring rows, on `pool.workers` actors."""
    import pyarrow
    import ray

    blocks = [pyarrow.table({"shard": pyarrow.array([index] * len(plan.shards[index]), pyarrow.int64()),
                             "line": pyarrow.array(plan.lines(index).numpy()),
                             "text": pyarrow.array(plan.sentences(plan.shards[index]), pyarrow.string())})
              for index in pending]
    # Ray sends a class by reference (its module's name) unless told otherwise, and a worker can import examples/
    # modules only where Ray put this checkout on its path (the driver's script folder, on a machine with the same
    # folders): these three travel by value instead, and a worker needs only hf_vanilla and its dependencies. By
    # value, a module named in the worker's code would travel whole, safetensors' objects too, which cannot: so the
    # worker's code names functions and classes (`Embedder`), never a module of these three (`_corpus.Embedder`).
    for module in (_common, _corpus, sys.modules[__name__]):
        ray.cloudpickle.register_pickle_by_value(module)
    # A worker's ExampleError reaches the driver as itself (in a RayTaskError), not as Ray Data's UserCodeException.
    ray.data.DataContext.get_current().raise_original_map_exception = True
    marker = os.environ.get(KILL_WORKER_ONCE)
    return ray.data.from_arrow(blocks).map_batches(
        Worker, batch_size=args.batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=pool.workers),
        num_cpus=pool.threads, num_gpus=1 if pool.gpu else 0,
        fn_constructor_kwargs=dict(folder=str(folder.resolve()), settings=plan.settings,
                                   digests=plan.manifest["model_files"], threads=pool.threads, gpu=pool.gpu,
                                   kill_marker=marker and str(Path(marker).resolve())))


def write_as_they_come(dataset, plan: _corpus.Plan, pending: list[int], output: Path) -> float:
    """Write each shard, atomically, as soon as all its rows are back. Returns when (time.perf_counter) the first
    rows came back."""
    assembling = {index: ShardRows(index, plan.lines(index)) for index in pending}
    kill_after, written, first = _corpus.kill_after_shards(), 0, None
    for batch in worker_errors_as_ours(dataset.iter_batches(batch_size=None, batch_format="numpy")):
        first = first or time.perf_counter()
        for index in numpy.unique(batch["shard"]).tolist():
            take = batch["shard"] == index
            if index not in assembling:
                raise RuntimeError(f"the Ray workers returned rows of shard {index} after it was written, or of one "
                                   f"this run did not send")
            if assembling[index].add(batch["line"][take], batch["embedding"][take]):
                _corpus.write_shard(output, index, assembling.pop(index).embeddings, plan.lines(index),
                                    kill_halfway=kill_after > 0 and written == kill_after)
                written += 1
    if assembling:
        raise RuntimeError(f"Ray Data ended without every row of shards {sorted(assembling)}; nothing of them was "
                           f"written: run the same command again to embed them")
    return first


def worker_errors_as_ours(batches):
    """The batches; a worker's ExampleError (another model on a node) raised here as the one line it is, not in
    Ray's RayTaskError with the worker's traceback."""
    try:
        yield from batches
    except Exception as error:  # noqa: BLE001  (Ray's error types: whatever it is, it is raised again)
        if isinstance(getattr(error, "cause", None), ExampleError):
            raise ExampleError(str(error.cause)) from None
        raise
