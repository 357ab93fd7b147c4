"""run_replicas: call a function in N real processes joined by Gloo on 127.0.0.1."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replicator import _env
from replicator.launch import free_port

__all__ = ["run_replicas", "ReplicaFailure", "RankError"]


@dataclass
class RankError:
    rank: int
    kind: str
    message: str
    traceback: str


class ReplicaFailure(AssertionError):
    """Raised in the parent when a replica raised; `errors` holds every failing rank's error."""

    def __init__(self, errors: list[RankError], results: dict[int, Any]) -> None:
        self.errors = errors
        self.results = results
        details = "\n".join(f"--- rank {e.rank}: {e.kind}: {e.message}\n{e.traceback}" for e in errors)
        super().__init__(f"{len(errors)} replica(s) failed:\n{details}")


def _worker(rank: int, world_size: int, local_world_size: int, port: int, env: dict[str, str],
            fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local_world_size),
        LOCAL_WORLD_SIZE=str(local_world_size), GROUP_RANK=str(rank // local_world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
    )
    # The processes share this machine's cores and, where there is one, its GPU: they compute on CPU
    # with Gloo unless `env` names REPLICATOR_DEVICE (NCCL refuses two processes on one GPU).
    os.environ.update({_env.THREADS: "1", _env.PROGRESS: "0", _env.DEVICE: "cpu"})
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # Plain pickle bytes: torch's queue reductions would share memory with a process about to exit.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException as error:  # report everything, including SystemExit, to the parent
        failure = RankError(rank, type(error).__name__, str(error), traceback.format_exc())
        results.put((rank, "error", pickle.dumps(failure)))
        # Leave as any failing replica does, so that its peers hear of it now rather than at their timeout.
        from replicator.job import leave_after_failure

        leave_after_failure()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_replicas(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, local_world_size: int | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` processes; return their results in rank order.

    Each process sees torchrun's variables (RANK, WORLD_SIZE, ...) so `rp.Replicator()`
    joins the group as it would under `replicator launch`. `fn` must be importable (a
    module-level function). `local_world_size` < world_size pretends the processes sit on
    world_size / local_world_size nodes (all on loopback), for hierarchical code paths. The
    processes compute on CPU even where a GPU is visible; `env={"REPLICATOR_DEVICE": "cuda"}`
    (one GPU per process) or adding `"REPLICATOR_BACKEND": "gloo"` (CUDA tensors over Gloo) changes that. If
    any rank raises, ReplicaFailure lists every rank's error; if any rank is still running
    after `timeout_s`, all are killed and TimeoutError names them.
    """
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo too: torch's optimizers import it, 0.6 s in every replica that the fork did not spare.
    context.set_forkserver_preload(["torch", "torch._dynamo", "replicator"])
    results = context.Queue()
    port = free_port()
    local_world_size = local_world_size or world_size
    if world_size % local_world_size:
        raise ValueError(f"local_world_size {local_world_size} does not divide world_size {world_size}")
    processes = [
        context.Process(target=_worker, daemon=True,
                        args=(rank, world_size, local_world_size, port, env or {}, fn, args, results))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(collected) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
            collected[rank] = (status, pickle.loads(value))
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break
    for process in processes:
        process.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
    stuck = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    if stuck and len(collected) < world_size:
        raise TimeoutError(f"ranks {stuck} did not finish within {timeout_s:.0f} s (a hang)")
    errors = [value for status, value in collected.values() if status == "error"]
    vanished = [rank for rank in range(world_size) if rank not in collected]
    errors += [RankError(rank, "died", f"exit code {processes[rank].exitcode}", "") for rank in vanished]
    if errors:
        succeeded = {r: v for r, (s, v) in collected.items() if s == "ok"}
        raise ReplicaFailure(sorted(errors, key=lambda e: e.rank), succeeded)
    return [collected[rank][1] for rank in range(world_size)]
