"""One attempt of a job: this node's processes started by torchrun's agent on a fresh rendezvous."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

from replicator import _env
from replicator.launch.recovery import Outcome
from replicator.launch.report import LaunchLog, read_error
from replicator.launch.spec import LaunchSpec

__all__ = ["free_port", "torchrun_arguments", "run_attempt", "LOOPBACK_RENDEZVOUS"]

LOOPBACK_RENDEZVOUS = "replicator-loopback"
WORKER = "replicator.launch.worker"  # what torchrun starts: it runs the target and records its error


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def torchrun_arguments(spec: LaunchSpec, attempt: int = 0, log_dir: str | None = None) -> list[str]:
    """torchrun's command line for one attempt: a fresh rendezvous port each time, no in-place restarts.

    torchrun starts replicator's worker entry, which runs the target and records its error for
    the launcher's summary; `log_dir` is where torchrun keeps those error files.
    """
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
    if log_dir is not None:
        arguments += ["--log-dir", log_dir]
    target = ["-m", spec.target] if spec.module else [spec.target]
    # "--" ends torchrun's options: a script argument such as --log would otherwise be taken
    # as an abbreviation of one of torchrun's (--log-dir) and rejected.
    return [*arguments, "-m", "--", WORKER, *target, *spec.args]


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
                # The store owns the listening socket from here on.
                options: dict[str, Any] = {"multi_tenant": True, "master_listen_fd": listener.detach()}
                if _torch_version() < (2, 8):
                    # libuv's store learned to take over a listening socket in torch 2.8.
                    options["use_libuv"] = False
                self._store = TCPStore(
                    self.master_addr, self.master_port, self.world_size, True, self.timeout, **options
                )
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


def run_attempt(spec: LaunchSpec, attempt: int, log: LaunchLog) -> Outcome:
    """One torchrun invocation: every replica started afresh, on a new port; failures kept in `log`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _register_rendezvous()
    os.environ[_env.ATTEMPT] = str(attempt)
    here = range(spec.node_rank * spec.nproc_per_node, (spec.node_rank + 1) * spec.nproc_per_node)
    try:
        run(parse_args(torchrun_arguments(spec, attempt, str(log.directory))))
    except ChildFailedError as failure:
        codes = {rank: info.exitcode for rank, info in failure.failures.items()}
        errors = {rank: error for rank, info in failure.failures.items()
                  if (error := read_error(info.error_file_data)) is not None}
        # As soon as one replica fails torchrun's agent stops the others with SIGTERM and lists
        # them among the failures too: those that recorded no error of their own were stopped.
        # (When every one of them ended that way, something else sent the signals: all failed.)
        stopped = [rank for rank, code in codes.items() if code == -signal.SIGTERM and rank not in errors]
        if len(stopped) == len(codes):
            stopped = []
        stopped += [rank for rank in here if rank not in codes]
        failed = {rank: code for rank, code in codes.items() if rank not in stopped}
        for rank, code in sorted(failed.items()):
            log.record(attempt, rank, code, errors.get(rank))
        return Outcome(False, failed, errors=errors, stopped=sorted(stopped))
    except SignalException:
        return Outcome(False, interrupted=True, stopped=list(here))  # the launcher itself was told to stop
    return Outcome(True)
