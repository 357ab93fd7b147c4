"""The parameter-server regime as run(), save() and restore() see it: servers serve, workers push and pull."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from replicator import checkpoint
from replicator.asynchronous.parameter_server.checkpoints import restore_share, worker_state, write_cut
from replicator.asynchronous.parameter_server.links import Links
from replicator.asynchronous.parameter_server.report import Reports, group_lines, print_report
from replicator.asynchronous.parameter_server.server import ParameterServer
from replicator.asynchronous.parameter_server.settings import AsyncSettings, check_shardable
from replicator.asynchronous.parameter_server.shards import ShardMap
from replicator.asynchronous.parameter_server.worker import GroupExchange
from replicator.asynchronous.regime import Regime
from replicator.comm.gloo_peer import use_sockets
from replicator.context import InputContext
from replicator.epochs import InputPosition
from replicator.errors import ReplicatorUsageError
from replicator.job import Job
from replicator.sync.optimizer import SyncedOptimizers
from replicator.telemetry import StepTimes
from replicator.timeline import recorder as timeline

__all__ = ["AsyncRegime"]


class AsyncRegime(Regime):
    """Parameter servers and sync groups over one job (see docs/concepts/asynchronous.md).

    On a server, `repl.run(...)` serves until every group has finished or left, yields no
    step, and returns with the whole final model in place; `prepare_input` there reads no data.
    On a worker, run() is the synchronous loop over its sync group, except that each
    `optimizer.step()` sends the group's averaged gradient to the servers and takes the
    parameters they answer with, instead of updating locally.
    """

    saves_at_the_end = False  # groups end at steps of their own: a cut is only saved at checkpoint_every

    def __init__(self, settings: AsyncSettings, job: Job, optimizers: SyncedOptimizers,
                 position: InputPosition, trained: Callable[[], dict[str, Any]]) -> None:
        self.settings, self.job, self.optimizers, self.trained = settings, job, optimizers, trained
        mesh = self.mesh = job.mesh
        self.serves = mesh.serves
        self.prints_report = not self.serves
        self._runs = 0
        self._server: ParameterServer | None = None
        self._exchange: GroupExchange | None = None
        self._bytes_before = 0
        everyone = job.groups.everyone
        assert everyone is not None
        # Sockets, or Gloo for every pair when some process cannot use them: the whole job decides, here.
        self.links = Links(mesh, use_sockets(everyone), job.timeout_s)
        job.close_with(self)
        if not self.serves:
            # One input pipeline per worker: the groups read different data, as synchronous replicas do.
            position.context = InputContext(num_replicas=mesh.num_replicas, replica_id=mesh.replica_id,
                                            input_pipeline_id=mesh.rank, num_input_pipelines=mesh.num_stepping)

    def input_fn(self, input_fn: Callable[[InputContext], Iterable[Any]]) -> Callable[[InputContext], Iterable[Any]]:
        """Servers read no data: their input is empty and input_fn is never called there."""
        return (lambda context: []) if self.serves else input_fn

    def _shards(self) -> ShardMap:
        optimizers = [w.optimizer for w in self.optimizers.wrapped]
        if not optimizers:
            raise ReplicatorUsageError("mode='async' needs an optimizer: wrap one with repl.wrap_optimizer() on every "
                                       "process (servers included: they apply it)")
        for optimizer in optimizers:
            check_shardable(optimizer)
        return ShardMap(optimizers, self.settings.parameter_servers)

    # -- a server ----------------------------------------------------------------------------
    def serve(self) -> dict[str, Any]:
        """A server's whole run(): serve, then hold the final model; returns what repl.last_run shows."""
        with timeline.span("serve", "server"):
            return {"asynchronous": self._serving().serve()}

    def _serving(self) -> ParameterServer:
        if self._server is None:
            self._server = ParameterServer(self.mesh, self.job.groups.replica_control, self._shards(),
                                           self.settings.max_staleness, self.job.timeout_s, self._write, self.links)
        return self._server

    def _write(self, states: dict[int, bytes]) -> Path:
        assert self._server is not None
        record = {"mode": "async", "parameter_servers": self.settings.parameter_servers,
                  "sync_group_size": self.settings.sync_group_size, "workers": self.mesh.num_stepping}
        return write_cut(states, self.trained(), self.mesh, self._server.shards, self.job.groups.replica_control,
                         record)

    # -- a worker ----------------------------------------------------------------------------
    def begin(self, on_wait: Callable[[float], None]) -> None:
        """Before a worker's first step: updates go to the servers; start from their parameters. Waits on the
        servers count as communication in the step times."""
        exchange = self._exchanging()
        exchange.on_wait = on_wait
        self.optimizers.update = exchange.push
        self._runs += 1
        self._bytes_before = exchange.link_bytes()  # this run's bytes on the links to the servers, counted from here
        exchange.pull()

    def _exchanging(self) -> GroupExchange:
        if self._exchange is None:
            self._exchange = GroupExchange(self.mesh, self.job.groups.replica_control, self._shards(),
                                           self.settings.max_staleness, self.job.timeout_s, self.links)
        return self._exchange

    def finish(self, times: StepTimes, show: bool) -> dict[str, Any]:
        """After a worker's last step: wait for every group, take the final parameters; the run's figures.

        On the main worker, `groups` holds each sync group's record (updates, staleness, waits on
        servers during its steps) and `per_replica` every worker's step times: its report."""
        exchange = self._exchanging()
        reports = Reports(self._runs)
        reports.put(self.mesh.rank, {"row": times.as_values(), **exchange.record.summary()})
        if self.job.groups.replica_control is not None and self.mesh.group_size > 1:
            dist.barrier(group=self.job.groups.replica_control)  # the group's figures are in before it is done
        exchange.finish()
        self.optimizers.update = None
        if self.mesh.rank == 0 and exchange.departed:
            print(f"replicator: sync group(s) {exchange.departed} left the run early; see the servers' report",
                  file=sys.stderr, flush=True)
        carried = exchange.link_bytes() - self._bytes_before
        figures: dict[str, Any] = {"role": "worker", "group": self.mesh.group_id, "transport": exchange.transport,
                                   "payloads": exchange.payloads, "link_bytes": carried,
                                   "departed": dict(exchange.departed), **exchange.record.summary()}
        if self.mesh.rank != 0:  # the main worker reads every group's: the store may leave with it (rank 0 holds
            return {"asynchronous": figures}  # it under a plain multiprocessing start), so no other worker tries
        found = reports.gather(list(range(self.mesh.num_stepping)))
        partition = self.mesh.group_partition
        groups = {group: {"ranks": ranks, **{k: v for k, v in found[ranks[0]].items() if k != "row"}}
                  for group, ranks in enumerate(partition) if ranks[0] in found}
        per_worker = [found[rank]["row"] for rank in sorted(found)]
        if show:
            print_report(group_lines(groups, partition, exchange.departed, self.mesh.serving,
                                     self.settings.max_staleness), per_worker)
        return {"per_replica": per_worker, "asynchronous": {**figures, "groups": groups}}

    # -- checkpoints (see asynchronous.checkpoints) --------------------------------------------
    def save(self, path: str | os.PathLike[str], objects: dict[str, Any], step: int, input_state: dict[str, Any],
             extra: dict[str, Any] | None, keep: int | None) -> Path:
        """A checkpoint of the cut at this step: a worker hands its state to the servers and waits until they have
        written it; a server (outside run(), where it serves no request) answers the groups' saves."""
        if self.serves:
            self._serving().serve(until_saved=True)
            return Path(path)
        leader = self.mesh.rank == self.mesh.group_partition[self.mesh.group_id][0]
        self._exchanging().save(worker_state(objects, leader=leader, path=Path(path), step=step, keep=keep,
                                             extra=extra, input_state=input_state))
        return Path(path)

    def restore(self, path: str | os.PathLike[str], objects: dict[str, Any]) -> checkpoint.Restored:
        """Every process loads the whole model; a server, the optimizer state of the shard it holds now (any number
        of servers and workers may restore what any other wrote); a worker, its generators and input position."""
        share, layout = restore_share(objects, self.mesh, self._shards())
        return checkpoint.restore(path, **{**objects, "layout": layout, "group": self.job.groups.everyone},
                                  share=share, rng=not self.serves)

    def close(self) -> None:
        """Close this process's links (once: a later close does nothing)."""
        ends, self._server, self._exchange = (self._server, self._exchange), None, None
        for end in ends:
            if end is not None:
                end.close()
