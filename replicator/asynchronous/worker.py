"""Internal: a sync group's side of the exchange: its leader pushes the group's averaged gradient to
every server and pulls the parameters they produce; the group's other members get them from it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from replicator.asynchronous import wire
from replicator.asynchronous.server import DIED, HEADER, reply_header_size
from replicator.asynchronous.shards import ShardMap
from replicator.asynchronous.staleness import StalenessRecord
from replicator.checkpoint.errors import CheckpointError
from replicator.errors import ReplicatorError
from replicator.identity import broadcast_from_first
from replicator.timeline import recorder as timeline
from replicator.topology import Mesh

__all__ = ["GroupExchange", "ServerError"]

# Each request as the timeline names its span.
_SPAN_NAMES = {wire.PULL: "pull", wire.PUSH: "push", wire.SAVE: "save at cut", wire.DONE: "finish"}


class ServerError(ReplicatorError):
    """A parameter server died, hung or dropped this group: raised on every worker of the group."""


class GroupExchange:
    """Push and pull for one sync group; every member calls the same methods at the same points."""

    def __init__(self, mesh: Mesh, everyone: dist.ProcessGroup, group: dist.ProcessGroup | None,
                 shards: ShardMap, max_staleness: int | None, timeout_s: float) -> None:
        self.mesh, self.everyone, self.group, self.timeout_s = mesh, everyone, group, timeout_s
        self.group_id = mesh.group_id
        self.leader = mesh.group_partition[self.group_id][0]
        self.is_leader = mesh.rank == self.leader
        self.shards = shards
        self.num_servers = mesh.servers
        self.tickets = [wire.Tickets(server) for server in range(self.num_servers)]
        self.record = StalenessRecord(max_staleness)
        self.departed: dict[int, str] = {}  # other groups the servers reported gone, and how
        self.step = 0
        self.on_wait: Callable[[float], None] = lambda seconds: None  # told each exchange's seconds (step times)

    # -- the three requests ----------------------------------------------------------------------
    def pull(self) -> None:
        """The servers' current parameters, into every optimizer's parameters (the start of a run)."""
        self._exchange(wire.PULL, None, range(len(self.shards.optimizers)))

    def push(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        """Send the group's averaged gradients of optimizer `index`; take the parameters that come back."""
        self.record.updates += 1
        self.step = self.record.updates
        self._exchange(wire.PUSH, index, [index])

    def save(self, state: bytes) -> None:
        """Hand this process's `state` to the servers and wait at the checkpoint's cut until they have written it;
        then take the parameters they hold."""
        wire.SavedStates.put(self.mesh.rank, state)
        if self.group is not None and self.mesh.group_size > 1:
            dist.barrier(group=self.group)  # every member's state is in the store before the leader asks
        self._exchange(wire.SAVE, None, range(len(self.shards.optimizers)))

    def finish(self) -> None:
        """Say this group is done; wait for every group to be, and take the final parameters."""
        self._exchange(wire.DONE, None, range(len(self.shards.optimizers)))

    # -- how -------------------------------------------------------------------------------------
    def _exchange(self, kind: int, index: int | None, optimizers: Iterable[int]) -> None:
        with timeline.span(_SPAN_NAMES[kind], "async", step=self.step, group=self.group_id):
            self._exchange_with_servers(kind, index, list(optimizers))

    def _exchange_with_servers(self, kind: int, index: int | None, optimizers: list[int]) -> None:
        started = time.perf_counter()
        # The leader's verdict travels to the group first (point to point: see _share_verdict): on a
        # server's failure every member raises the same error instead of waiting for parameters that
        # will never come.
        verdict = torch.full((2 + self.num_servers,), -1, dtype=torch.int64)
        message = ""
        if self.is_leader:
            message = self._leader_exchange(kind, index, optimizers, verdict)
        if self.group is not None and self.mesh.group_size > 1:
            self._share_verdict(verdict)
        if int(verdict[0]) == wire.SAVE_FAILED:
            raise CheckpointError(f"the parameter servers could not write the checkpoint (raised on rank "
                                  f"{self.mesh.rank}, sync group {self.group_id}): {wire.SavedStates.error()}")
        if int(verdict[0]) != wire.OK:
            server = int(verdict[1])
            raise ServerError(message or (
                f"parameter server {server} (rank {self.mesh.server_ranks[server]}) failed or dropped sync group "
                f"{self.group_id}; see the error of its leader (rank {self.leader})"))
        for k in optimizers:  # the leader's new parameters to the rest of its group
            broadcast_from_first(self.shards.whole[k].params, self.group, self.leader)
        if kind == wire.PUSH:
            self.record.values.extend(int(v) for v in verdict[2:])
        waited = time.perf_counter() - started
        self.record.wait_seconds += waited
        self.on_wait(waited)

    def _share_verdict(self, verdict: torch.Tensor) -> None:
        """The leader's verdict to the rest of its group.

        Not a broadcast: a collective gives up after REPLICATOR_TIMEOUT, and the leader itself may
        wait that long on a server (for a slow group under a staleness bound, at a checkpoint's cut,
        or on a server that hangs) before it knows the verdict. A member waits twice as long, so it
        hears the leader's verdict, a ServerError naming the server, rather than a timeout of its own.
        """
        assert self.group is not None
        if self.is_leader:
            for member in self.mesh.group_partition[self.group_id][1:]:
                dist.send(verdict, dst=member, group=self.group, tag=wire.TAG_VERDICT)
            return
        try:
            work = dist.irecv(verdict, src=self.leader, group=self.group, tag=wire.TAG_VERDICT)
            assert work is not None  # this process is in the group
            work.wait(timedelta(seconds=2 * self.timeout_s))
        except RuntimeError as error:
            raise ServerError(
                f"the leader of sync group {self.group_id} (rank {self.leader}) did not say how its exchange with the "
                f"parameter servers went within 2 x REPLICATOR_TIMEOUT ({2 * self.timeout_s:g} s; raised on rank "
                f"{self.mesh.rank}): see the leader's own error or exit status ({error})") from error

    def _leader_exchange(self, kind: int, index: int | None, optimizers: list[int], verdict: torch.Tensor) -> str:
        """Request from every server, then read every answer; returns an error message, or ""."""
        sent: list[tuple[Any, torch.Tensor]] = []
        failure = self._send_requests(kind, index, verdict, sent)
        if failure:
            return failure
        with timeline.span("wait on servers", "async"):
            return self._read_answers(optimizers, verdict, sent)

    def _send_requests(self, kind: int, index: int | None, verdict: torch.Tensor,
                       sent: list[tuple[Any, torch.Tensor]]) -> str:
        """Post a request (and for a push, the gradient) to every server; an error message, or ""."""
        for server, tickets in enumerate(self.tickets):
            try:
                tickets.post(self.group_id)
            except RuntimeError as error:  # the store left with its host: the job is ending around us
                return self._failed(verdict, server, "could not be reached through the job's store", error)
            header = torch.tensor([kind, -1 if index is None else index, self.step, self.group_id], dtype=torch.int64)
            assert header.numel() == HEADER
            tensors = [header]
            if kind == wire.PUSH:
                assert index is not None
                tensors += self._gradient(index, server)
            dst = self.mesh.server_ranks[server]
            try:
                sent += [(dist.isend(t, dst=dst, group=self.everyone, tag=wire.TAG_REQUEST), t) for t in tensors]
            except RuntimeError as error:
                return self._failed(verdict, server, "could not be reached", error)
        return ""

    def _read_answers(self, optimizers: list[int], verdict: torch.Tensor, sent: list[tuple[Any, torch.Tensor]]) -> str:
        """Every server's answer, its parameters into place; an error message, or ""."""
        verdict[0] = wire.OK
        header = torch.empty(reply_header_size(len(self.mesh.group_partition)), dtype=torch.int64)
        for server in range(self.num_servers):
            src = self.mesh.server_ranks[server]
            try:
                dist.recv(header, src=src, group=self.everyone, tag=wire.TAG_REPLY)
                if int(header[0]) == wire.SAVE_FAILED:
                    verdict[0] = wire.SAVE_FAILED
                    return ""
                if int(header[0]) != wire.OK:
                    return self._dropped(verdict, server, wire.Dropped.read(self.group_id) or "")
                verdict[2 + server] = header[1]
                self._note_departures(header[3:])
                for k in optimizers:
                    shard = self.shards.shard(k, server)
                    flats = shard.empty()
                    for flat in flats:
                        dist.recv(flat, src=src, group=self.everyone, tag=wire.TAG_REPLY)
                    shard.load(flats)
            except RuntimeError as error:
                return self._failed(verdict, server, "stopped answering", error)
        try:
            for work, _ in sent:
                work.wait()
        except RuntimeError as error:
            return self._failed(verdict, 0, "could not be reached", error)
        return ""

    def _gradient(self, index: int, server: int) -> list[torch.Tensor]:
        shard = self.shards.shard(index, server)
        grads = [p.grad for p in shard.params]
        present = torch.tensor([g is not None for g in grads], dtype=torch.uint8)
        lrs = torch.tensor([float(g["lr"]) for g in self.shards.optimizers[index].param_groups], dtype=torch.float64)
        return [lrs, present, *shard.pack(grads)]

    def _failed(self, verdict: torch.Tensor, server: int, what: str, error: BaseException | None) -> str:
        verdict[0], verdict[1] = wire.FAILED, server
        if (why := wire.Dropped.read(self.group_id)) is not None:  # the servers went on without this group
            return self._dropped(verdict, server, why)
        rank = self.mesh.server_ranks[server]
        cause = f": {error}" if error is not None else ""
        return (f"parameter server {server} (rank {rank}) {what} while sync group {self.group_id} (leader rank "
                f"{self.leader}) was at step {self.step}{cause}. The asynchronous run cannot go on without the "
                "parameters that server holds; see that server's own error or exit status")

    def _dropped(self, verdict: torch.Tensor, server: int, why: str) -> str:
        verdict[0], verdict[1] = wire.FAILED, server
        return (f"parameter server {server} (rank {self.mesh.server_ranks[server]}) dropped sync group "
                f"{self.group_id} (leader rank {self.leader}) as hung, {self.step - 1} updates into the run: "
                f"{why or 'it sent nothing for longer than REPLICATOR_TIMEOUT'}, so the servers went on without it. "
                f"A group that computes longer than REPLICATOR_TIMEOUT ({self.timeout_s:g} s) between optimizer "
                "steps needs a larger REPLICATOR_TIMEOUT")

    def _note_departures(self, codes: torch.Tensor) -> None:
        for group, code in enumerate(codes.tolist()):
            if code and group not in self.departed:
                self.departed[group] = "died" if code == DIED else "hung"
