"""The peers' parameter-server patterns, written here for the asynchronous benchmark: PyTorch RPC and Ray.

Both hold the model and the optimizer in one server object that applies one gradient at a
time and answers with the new weights; each of 2 workers loops: compute its batch's
gradients locally, send them, load the weights that come back (one round trip per update, as
replicator's `optimizer.step()` in mode="async"). Same model, optimizer, data and batch as
replicator's contender (`_digits.py`); written from the patterns' descriptions, not copied:

- *torch.distributed.rpc*: the server object lives on the last rank behind an RRef; workers
  call `rref.rpc_sync().apply_gradients(grads)`; a lock serializes updates, since RPC serves
  requests on a thread pool and two workers must never update the parameters at once.
- *Ray*: the server is an actor (an actor runs one method at a time, so it needs no lock);
  workers are actors calling `ray.get(server.apply_gradients.remote(*grads))`, with gradients
  and weights as NumPy arrays, as Ray's parameter-server example sends them.
"""

from __future__ import annotations

import importlib
import os
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from _digits import digits, gradient_step, make_model, make_optimizer, shard_batches

WORKERS = 2


# -- torch.distributed.rpc -----------------------------------------------------------------------


class RpcServer:
    """The parameters and their optimizer on the server; `apply_gradients` is one update under a lock."""

    def __init__(self, hidden: int, lr: float, seed: int) -> None:
        self.model = make_model(hidden, seed)
        self.params = list(self.model.parameters())
        self.optimizer = make_optimizer(self.params, lr)
        self.lock = threading.Lock()
        self.updates = 0

    def get_weights(self) -> list[torch.Tensor]:
        with self.lock:
            return [p.detach().clone() for p in self.params]

    def apply_gradients(self, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        with self.lock:
            for param, gradient in zip(self.params, gradients, strict=True):
                param.grad = gradient
            self.optimizer.step()
            self.updates += 1
            return [p.detach().clone() for p in self.params]


_server: RpcServer | None = None
_server_lock = threading.Lock()


def rpc_server(hidden: int, lr: float, seed: int) -> RpcServer:
    """The server process's one RpcServer (the first worker to ask creates it); runs on the server."""
    global _server
    with _server_lock:
        if _server is None:
            _server = RpcServer(hidden, lr, seed)
        return _server


def _load(model: torch.nn.Module, weights: list[Any]) -> None:
    with torch.no_grad():
        for param, value in zip(model.parameters(), weights, strict=True):
            param.copy_(torch.as_tensor(value))


def _moved(model: torch.nn.Module, hidden: int, seed: int) -> float:
    start = torch.cat([p.detach().reshape(-1) for p in make_model(hidden, seed).parameters()])
    return float((torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - start).abs().max())


def rpc_rate_job(hidden: int, batch: int, lr: float, seed: int, steps: int) -> dict[str, Any]:
    """One of 3 processes (under replicator.testing.run_replicas): the last serves, the others train `steps`
    updates and stamp each (CLOCK_MONOTONIC)."""
    from torch.distributed import rpc

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", rpc_timeout=120)
    is_server = rank == world - 1
    train_x, train_y, _, _ = digits()  # before the rendezvous, so the workers start together
    # torch's own TensorPipe set-up gathers its device maps through a deprecated path and says so on every rank.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    rpc.init_rpc("server" if is_server else f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    cpu = time.process_time()  # every thread of the process: TensorPipe's included
    if is_server:
        rpc.shutdown()  # waits for every worker's shutdown: serves until they are done
        assert _server is not None
        return {"stamps": [], "updates": _server.updates, "moved": _moved(_server.model, hidden, seed),
                "cpu_s": time.process_time() - cpu}
    server = rpc.remote("server", rpc_server, args=(hidden, lr, seed))
    model = make_model(hidden, seed)
    batches = shard_batches(train_x, train_y, batch, rank, world - 1, steps, seed)
    _load(model, server.rpc_sync().get_weights())
    stamps = []
    for inputs in batches:
        gradient_step(model, inputs)
        _load(model, server.rpc_sync().apply_gradients([p.grad for p in model.parameters()]))
        stamps.append(time.monotonic())
    cpu = time.process_time() - cpu
    rpc.shutdown()
    return {"stamps": stamps, "updates": None, "moved": _moved(model, hidden, seed), "cpu_s": cpu}


# -- Ray -----------------------------------------------------------------------------------------


class RayServer:
    """A Ray actor's class: the weights and the optimizer; each call is one update."""

    def __init__(self, hidden: int, lr: float, seed: int) -> None:
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # Ray's zero-copy arrays
        self.model = make_model(hidden, seed)
        self.params = list(self.model.parameters())
        self.optimizer = make_optimizer(self.params, lr)
        self.updates = 0

    def get_weights(self) -> list[Any]:
        return [p.detach().numpy().copy() for p in self.params]

    def apply_gradients(self, *gradients: Any) -> list[Any]:
        for param, gradient in zip(self.params, gradients, strict=True):
            param.grad = torch.as_tensor(gradient)
        self.optimizer.step()
        self.updates += 1
        return self.get_weights()

    def summary(self, hidden: int, seed: int) -> tuple[int, float]:
        return self.updates, _moved(self.model, hidden, seed)


class RayWorker:
    """A Ray actor's class: one worker's data and model copy; `train` loops gradient -> server -> weights."""

    def __init__(self, hidden: int, batch: int, seed: int, shard: int, steps: int) -> None:
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.model = make_model(hidden, seed)
        train_x, train_y, _, _ = digits()
        self.batches = shard_batches(train_x, train_y, batch, shard, WORKERS, steps, seed)

    def ready(self) -> bool:
        return True

    def train(self, server: Any) -> list[float]:
        import ray

        _load(self.model, ray.get(server.get_weights.remote()))
        stamps = []
        for inputs in self.batches:
            gradient_step(self.model, inputs)
            grads = [p.grad.numpy() for p in self.model.parameters()]
            _load(self.model, ray.get(server.apply_gradients.remote(*grads)))
            stamps.append(time.monotonic())
        return stamps


def process_stat(pid: int) -> tuple[int, float]:
    """A process's parent and the user and system CPU seconds of all its threads so far (/proc: this machine)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # ppid; utime + stime


def tree_cpu_seconds(root: int) -> dict[int, float]:
    """CPU seconds so far of `root` and every process below it, by pid."""
    stats = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stats[int(entry)] = process_stat(int(entry))
        except OSError:  # it ended while we looked
            continue
    below, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in below]
        below.update(children)
        frontier.extend(children)
    return {pid: stats[pid][1] for pid in below if pid in stats}


def tree_cpu_since(root: int, before: dict[int, float]) -> float:
    """CPU seconds `root` and every process below it spent since `before` (tree_cpu_seconds), new ones included."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in tree_cpu_seconds(root).items())


class RayEcho:
    """A Ray actor's class that returns what it is sent: a round trip through Ray with no work in it."""

    def echo(self, payload: Any) -> Any:
        return payload


class RayEchoes:
    """Ray started once (1 CPU) with one echo actor, for the transport part's Ray arm; close() stops Ray."""

    def __init__(self) -> None:
        import ray

        self._saved_path = _put_benchmarks_on_path()
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 object_store_memory=256 << 20)
        self.actor = ray.remote(num_cpus=1)(RayEcho).remote()

    def round_trips(self, numel: int, count: int) -> tuple[float, float]:
        """Median seconds of `count` echoes of `numel` float32 (a NumPy array, as Ray users send them) after 20 of
        warm-up, and CPU seconds per echo over every process of the arm (this driver and all of Ray's)."""
        import numpy as np
        import ray

        payload = np.zeros(numel, dtype=np.float32)
        for _ in range(20):
            ray.get(self.actor.echo.remote(payload))
        before = tree_cpu_seconds(os.getpid())
        times = []
        for _ in range(count):
            started = time.perf_counter()
            ray.get(self.actor.echo.remote(payload))
            times.append(time.perf_counter() - started)
        cpu = tree_cpu_since(os.getpid(), before)
        return statistics.median(times), cpu / count

    def close(self) -> None:
        import ray

        ray.shutdown()
        _restore_path(self._saved_path)


def ray_missing() -> str | None:
    """Why the Ray pattern cannot run here, or None when it can."""
    try:
        importlib.import_module("ray")
    except ImportError as error:
        return (f"ray pattern skipped: ray cannot be imported ({error}); it is the optional extra 'bench': "
                "pip install -e '.[bench]'")
    return None


def ray_rates(hidden: int, batch: int, lr: float, seed: int, steps: int) -> dict[str, Any]:
    """Start Ray (1 CPU each for the server and the 2 workers), train, stop Ray: the workers' stamps and checks."""
    import ray

    saved = _put_benchmarks_on_path()
    try:
        ray.init(num_cpus=WORKERS + 1, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 object_store_memory=256 << 20)
        server = ray.remote(num_cpus=1)(RayServer).remote(hidden, lr, seed)
        workers = [ray.remote(num_cpus=1)(RayWorker).remote(hidden, batch, seed, shard, steps)
                   for shard in range(WORKERS)]
        ray.get([worker.ready.remote() for worker in workers])  # started and built: both start training together
        before = tree_cpu_seconds(os.getpid())
        stamps = ray.get([worker.train.remote(server) for worker in workers])
        # Every process of the arm: this driver, Ray's daemons (GCS, raylet) and its worker processes.
        cpu = tree_cpu_since(os.getpid(), before)
        updates, moved = ray.get(server.summary.remote(hidden, seed))
        return {"stamps": stamps, "updates": updates, "moved": moved, "cpu_s": cpu}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _restore_path(saved)


def _put_benchmarks_on_path() -> str | None:
    """Let Ray's worker processes import this module and replicator by name, as the driver does; the old value."""
    here = Path(__file__).resolve().parent
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), str(here.parent), saved]))
    return saved


def _restore_path(saved: str | None) -> None:
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved
