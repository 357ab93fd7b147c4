"""`replicator launch`: start N replicas per node on torchrun's machinery, restarting the job on failure."""

from __future__ import annotations

import os

from replicator import _env
from replicator.heap import HEAP_MARK, USER_ALLOCATOR_SETTINGS
from replicator.launch.master import resolve_master, wait_for_master
from replicator.launch.recovery import Outcome, run_attempts
from replicator.launch.report import LaunchLog
from replicator.launch.spawn import run_attempt
from replicator.launch.spec import LaunchSpec

__all__ = ["launch", "heap_kept_environment", "HEAP_KEPT"]

# glibc hands freed heap memory back to the kernel and faults it in again, zeroed, at the next
# step: 17,000-20,000 page faults per backward pass of the demo's ResNet on 2 replicas (2,000
# under DDP). Training reuses the same memory every step, so replicas keep it: the resident
# size stays at the step's peak instead of falling between steps. Any allocator setting of
# the user's own (these variables, GLIBC_TUNABLES, a preloaded allocator) wins.
# The mark tells the library these are the launcher's settings: shard="parameters" returns freed blocks instead.
HEAP_KEPT = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30), HEAP_MARK: "kept"}
_ALLOCATOR_SETTINGS = USER_ALLOCATOR_SETTINGS


def _environment(spec: LaunchSpec) -> dict[str, str]:
    """Variables every replica inherits: threads that share the cores, Gloo on loopback locally,
    a heap that is kept between steps."""
    threads = spec.threads_per_process or max(1, (os.cpu_count() or 1) // spec.nproc_per_node)
    env = {"OMP_NUM_THREADS": str(threads), _env.THREADS: str(threads)}
    if spec.nnodes == 1:
        # Nothing leaves the machine: Gloo's sockets live on the loopback interface.
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    env.update(heap_kept_environment())
    return env


def heap_kept_environment() -> dict[str, str]:
    """HEAP_KEPT, unless the user chose allocator settings of their own (then nothing)."""
    return {} if any(name in os.environ for name in _ALLOCATOR_SETTINGS) else dict(HEAP_KEPT)


def launch(spec: LaunchSpec) -> int:
    """Run the job, restarting all of it up to `spec.max_restarts` times; returns the exit code.

    Raises ValueError when `--master` does not resolve, TimeoutError when node 0 never listens.
    """
    spec.validate()
    master = resolve_master(spec.master) if spec.master else None
    saved = dict(os.environ)
    for key, value in _environment(spec).items():
        # An explicit --threads wins; otherwise a user's own OMP_NUM_THREADS is respected.
        if spec.threads_per_process or key not in os.environ:
            os.environ[key] = value
    os.environ[_env.MAX_RESTARTS] = str(spec.max_restarts)

    def attempt(number: int) -> Outcome:
        if master is not None and spec.node_rank > 0:
            host, base = master
            wait_for_master(host, base + number, spec.master_timeout_s, spec.node_rank, _say)
        return run_attempt(spec, number, log)

    try:
        with LaunchLog(spec.log_dir) as log:
            code = run_attempts(attempt, spec.max_restarts)
        if log.failed:
            _say(f"replicator: full tracebacks and torchrun's messages are in {log.path}")
        return code
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _say(line: str) -> None:
    print(line, flush=True)  # interleaves in order with the replicas' own output
