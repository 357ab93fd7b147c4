"""`replicator launch`: start N replicas per node on torchrun's machinery, restarting the job on failure."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from replicator.recovery import ATTEMPT_ENV, MAX_RESTARTS_ENV, Outcome, run_attempts

__all__ = ["LaunchSpec", "launch", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@dataclass
class LaunchSpec:
    """What to start and where. `master` is HOST:PORT of node 0; None means this machine only."""

    target: str
    args: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master: str | None = None
    module: bool = False
    threads_per_process: int | None = None
    max_restarts: int = 0  # whole-job restarts after a failure; the job resumes from its checkpoint

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"-n must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.master:
            raise ValueError("a multi-node launch needs --master HOST:PORT (the address of node 0, same on every node)")
        if self.master and (":" not in self.master or not self.master.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"--master must look like HOST:PORT, got {self.master!r}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not self.module and not os.path.exists(self.target):
            raise FileNotFoundError(f"no such script: {self.target}")


# glibc hands freed heap memory back to the kernel and faults it in again, zeroed, at the next
# step: 17,000-20,000 page faults per backward pass of the demo's ResNet on 2 replicas (2,000
# under DDP). Training reuses the same memory every step, so replicas keep it: the resident
# size stays at the step's peak instead of falling between steps. Any allocator setting of
# the user's own (these variables, GLIBC_TUNABLES, a preloaded allocator) wins.
HEAP_KEPT = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}
_ALLOCATOR_SETTINGS = (*HEAP_KEPT, "GLIBC_TUNABLES", "LD_PRELOAD")


def _environment(spec: LaunchSpec) -> dict[str, str]:
    """Variables every replica inherits: threads that share the cores, Gloo on loopback locally,
    a heap that is kept between steps."""
    threads = spec.threads_per_process or max(1, (os.cpu_count() or 1) // spec.nproc_per_node)
    env = {"OMP_NUM_THREADS": str(threads), "REPLICATOR_THREADS": str(threads)}
    if spec.nnodes == 1:
        # Nothing leaves the machine: Gloo's sockets live on the loopback interface.
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    env.update(heap_kept_environment())
    return env


def heap_kept_environment() -> dict[str, str]:
    """HEAP_KEPT, unless the user chose allocator settings of their own (then nothing)."""
    return {} if any(name in os.environ for name in _ALLOCATOR_SETTINGS) else dict(HEAP_KEPT)


def torchrun_arguments(spec: LaunchSpec, attempt: int = 0) -> list[str]:
    """torchrun's command line for one attempt: a fresh rendezvous port each time, no in-place restarts."""
    if spec.master:
        # Every node's launcher counts attempts alike, so all of them move to the same new port.
        host, base = spec.master.rsplit(":", 1)
        port = str(int(base) + attempt)
        rendezvous = ["--master-addr", host, "--master-port", port, "--rdzv-backend", "static"]
    else:
        # torchrun's static rendezvous would start a store that listens on every interface.
        rendezvous = ["--rdzv-backend", LOOPBACK_RENDEZVOUS, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                      "--rdzv-conf", "rank=0"]
    arguments = [
        "--nproc-per-node", str(spec.nproc_per_node),
        "--nnodes", str(spec.nnodes),
        "--node-rank", str(spec.node_rank),
        *rendezvous,
        # torchrun's own restarts reuse the rendezvous, and with Gloo restarted workers can
        # dial the previous attempt's dead peers or hang: restarts are ours (see recovery).
        "--max-restarts", "0",
    ]
    if spec.module:
        arguments.append("-m")
    # "--" ends torchrun's options: a script argument such as --log would otherwise be taken
    # as an abbreviation of one of torchrun's (--log-dir) and rejected.
    return [*arguments, "--", spec.target, *spec.args]


LOOPBACK_RENDEZVOUS = "replicator-loopback"


def _loopback_rendezvous(params: Any) -> Any:
    """torchrun's static rendezvous, except that the store's server listens on the endpoint's address only.

    torch's TCPStore server binds every interface whatever host it is given, so anyone who
    can reach this machine could join or disrupt the job; handed a socket bound here
    (master_listen_fd) it listens on that socket alone.
    """
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, _default_timeout_seconds
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class LoopbackRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOOPBACK_RENDEZVOUS

        def next_rendezvous(self) -> Any:
            if self._store is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((self.master_addr, self.master_port))
                listener.listen(socket.SOMAXCONN)
                options: dict[str, Any] = {"multi_tenant": True, "master_listen_fd": listener.detach()}  # the store owns it
                if _torch_version() < (2, 8):
                    options["use_libuv"] = False  # libuv's store learned to take over a listening socket in torch 2.8
                self._store = TCPStore(self.master_addr, self.master_port, self.world_size, True, self.timeout, **options)
            return super().next_rendezvous()

    host, port = parse_rendezvous_endpoint(params.endpoint, -1)
    return LoopbackRendezvous(host, port, params.get_as_int("rank", 0), params.max_nodes, params.run_id,
                              params.get_as_int("timeout", _default_timeout_seconds))


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _register_rendezvous() -> None:
    """Make LOOPBACK_RENDEZVOUS known to torchrun in this process (registering twice is harmless)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _loopback_rendezvous)


def launch(spec: LaunchSpec) -> int:
    """Run the job, restarting all of it up to `spec.max_restarts` times; returns the exit code."""
    spec.validate()
    saved = dict(os.environ)
    for key, value in _environment(spec).items():
        # An explicit --threads wins; otherwise a user's own OMP_NUM_THREADS is respected.
        if spec.threads_per_process or key not in os.environ:
            os.environ[key] = value
    os.environ[MAX_RESTARTS_ENV] = str(spec.max_restarts)
    try:
        return run_attempts(lambda attempt: _run_attempt(spec, attempt), spec.max_restarts)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run_attempt(spec: LaunchSpec, attempt: int) -> Outcome:
    """One torchrun invocation: every replica started afresh, on a new port."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _register_rendezvous()
    os.environ[ATTEMPT_ENV] = str(attempt)
    try:
        run(parse_args(torchrun_arguments(spec, attempt)))
    except ChildFailedError as failure:
        return Outcome(False, {rank: info.exitcode for rank, info in failure.failures.items()})
    except SignalException:
        return Outcome(False, interrupted=True)  # the launcher itself was told to stop
    return Outcome(True)
