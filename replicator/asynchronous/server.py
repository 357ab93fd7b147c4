"""Internal: a parameter server: applies the user's optimizer to its shard as group gradients arrive,
within the staleness bound, one request at a time (so no two workers ever race on its parameters)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from replicator.asynchronous import wire
from replicator.asynchronous.shards import Shard, ShardMap
from replicator.asynchronous.staleness import StalenessRecord
from replicator.identity import broadcast_from_first
from replicator.timeline import recorder as timeline
from replicator.topology import Mesh

__all__ = ["ParameterServer", "DIED", "HUNG", "HEADER", "reply_header_size"]

HEADER = 4  # a request's header: kind, optimizer, the group's step, the group
DIED, HUNG = 1, 2  # how a departed group left, as the replies report it
# Each request as the timeline names the server's span of handling it.
_SPAN_NAMES: dict[int | None, str] = {wire.PULL: "serve pull", wire.PUSH: "serve push", wire.SAVE: "serve save",
                                      wire.DONE: "serve finish"}


def reply_header_size(num_groups: int) -> int:
    """status, staleness of the gradient just applied (-1: none), version, then each group's departure."""
    return 3 + num_groups


@dataclass
class _Gradient:
    flats: list[torch.Tensor]
    present: torch.Tensor  # uint8 per parameter: 0 where no replica of the group had a gradient
    lrs: torch.Tensor


@dataclass
class _Book:
    """One optimizer's shard on this server: its version, what each group last pulled, gradients waiting."""

    shard: Shard
    optimizer: torch.optim.Optimizer
    version: int = 0
    pulled: dict[int, int] = field(default_factory=dict)
    pending: dict[int, _Gradient] = field(default_factory=dict)


class ParameterServer:
    """Serves its shard of every wrapped optimizer until every sync group has finished or left."""

    def __init__(self, mesh: Mesh, everyone: dist.ProcessGroup, servers: dist.ProcessGroup | None,
                 shards: ShardMap, max_staleness: int | None, timeout_s: float,
                 on_save: Callable[[dict[int, bytes]], object]) -> None:
        self.mesh, self.everyone, self.servers_group = mesh, everyone, servers
        self.index = mesh.rank - mesh.num_workers
        self.groups = mesh.group_partition
        self.shards = shards
        self.bound = max_staleness
        self.timeout_s = timeout_s
        self.books = [_Book(shards.shard(k, self.index), optimizer) for k, optimizer in enumerate(shards.optimizers)]
        self.tickets = wire.Tickets(self.index)
        self.record = StalenessRecord(max_staleness)
        self.departed: dict[int, dict[str, Any]] = {}
        self.applied = [0] * len(self.groups)  # gradients applied, per group
        self._sending: dict[int, list[Any]] = {}
        self.on_save = on_save  # writes a checkpoint from the workers' states, by rank (every server calls it)
        self.saving: set[int] = set()  # groups waiting at a checkpoint's cut

    # -- the loop ----------------------------------------------------------------------------
    def serve(self, until_saved: bool = False) -> dict[str, Any]:
        """Answer requests until no group is left; then give every server the whole model.

        `until_saved`: outside run(), answer the groups' checkpoint requests, then return.
        """
        started = self.started = time.monotonic()
        groups = range(len(self.groups))
        self.active = set(groups) - set(self.departed)
        self.finished: set[int] = set()
        self.saving = set()
        for book in self.books:
            book.pulled = dict.fromkeys(self.active, book.version)
        self.last_heard = dict.fromkeys(groups, started)
        self.last_step = dict.fromkeys(groups, 0)
        self.heartbeats = wire.HeartbeatWatch(groups, self.timeout_s)
        idle_since, checked = started, started
        while self.active:
            group = self.tickets.take()
            now = time.monotonic()
            if group is None:
                if now - checked > wire.Heartbeat.PERIOD_S:
                    checked = now
                    self._check_liveness(now)
                wire.idle_sleep(idle_since)
            else:
                idle_since = now
                began = timeline.clock()
                kind = self._handle(group)
                self._advance()
                if (recording := timeline.active()) is not None:
                    recording.add(_SPAN_NAMES.get(kind, "serve request"), "server", began, timeline.clock(),
                                  args={"group": group})
            if self.saving and self.active <= self.saving:  # every group still in the run is at the cut
                with timeline.span("checkpoint save", "checkpoint"):
                    self._save()
                if until_saved:
                    return {}
        for group in sorted(self.finished):
            self._reply(group, -1, range(len(self.books)))
        self._drain()
        with timeline.span("share final parameters", "server"):
            self._share_final_parameters()
        return {"role": "server", "server": self.index, "versions": [book.version for book in self.books],
                "applied_per_group": list(self.applied), "departed": dict(self.departed),
                "seconds": time.monotonic() - started, **self.record.summary()}

    def _handle(self, group: int) -> int | None:
        """Receive and take in one request of `group`; its kind (None: the group failed mid-request)."""
        leader = self.groups[group][0]
        header = torch.empty(HEADER, dtype=torch.int64)
        try:
            dist.recv(header, src=leader, group=self.everyone, tag=wire.TAG_REQUEST)
            kind, optimizer, step = (int(v) for v in header[:3])
            self.last_heard[group], self.last_step[group] = time.monotonic(), step
            gradient = self._receive_gradient(leader, optimizer) if kind == wire.PUSH else None
        except RuntimeError as error:
            self._depart(group, DIED, f"its leader (rank {leader}) failed mid-request: {error}")
            return None
        if group in self.departed:  # declared hung, yet here: tell it, so it stops with a clear error
            self._reply(group, -1, [], status=wire.FAILED)
            return kind
        if kind == wire.PULL:
            self._reply(group, -1, range(len(self.books)))
            for book in self.books:
                book.pulled[group] = book.version
        elif kind == wire.PUSH:
            assert gradient is not None
            self.books[optimizer].pending[group] = gradient
        elif kind == wire.SAVE:
            self.saving.add(group)
        elif kind == wire.DONE:
            self.active.discard(group)
            self.finished.add(group)
            for book in self.books:
                book.pulled.pop(group, None)
        return kind

    def _receive_gradient(self, leader: int, optimizer: int) -> _Gradient:
        book = self.books[optimizer]
        lrs = torch.empty(len(book.optimizer.param_groups), dtype=torch.float64)
        present = torch.empty(len(book.shard.params), dtype=torch.uint8)
        flats = book.shard.empty()
        for tensor in (lrs, present, *flats):
            dist.recv(tensor, src=leader, group=self.everyone, tag=wire.TAG_REQUEST)
        return _Gradient(flats, present, lrs)

    # -- updates -----------------------------------------------------------------------------
    def _advance(self) -> None:
        for index, book in enumerate(self.books):
            if book.pending and self._may_advance(book):
                with timeline.span("apply update", "server", optimizer=index, gradients=len(book.pending)):
                    self._apply(index, book)

    def _may_advance(self, book: _Book) -> bool:
        """Would one more update leave every group still computing within the bound?

        Gradients that cannot go in now wait, and their groups with them, until the laggard's
        gradient arrives (or it leaves); then all waiting gradients make one averaged update.
        With S = 0 that is every group's gradient each round: bulk-synchronous training."""
        if self.bound is None:
            return True
        computing = [g for g in self.active if g not in book.pending and g not in self.saving]
        return all(book.version + 1 - book.pulled[g] <= self.bound for g in computing)

    def _apply(self, index: int, book: _Book) -> None:
        waiting = sorted(book.pending)
        gradients = [book.pending.pop(g) for g in waiting]
        with torch.no_grad():
            totals = [torch.zeros_like(view) for view in book.shard.unpack(gradients[0].flats)]
            present = torch.zeros(len(book.shard.params), dtype=torch.bool)
            for gradient in gradients:
                present |= gradient.present.bool()
                for total, view in zip(totals, book.shard.unpack(gradient.flats), strict=True):
                    total += view
            for param, total, has in zip(book.shard.params, totals, present.tolist(), strict=True):
                param.grad = (total / len(gradients)).to(param.device, param.dtype) if has else None
            for param_group, lr in zip(book.optimizer.param_groups, gradients[0].lrs.tolist(), strict=True):
                param_group["lr"] = lr  # the workers' schedulers set the rate, as in synchronous mode
            type(book.optimizer).step(book.optimizer)  # the user's optimizer itself, past the wrapper
            for param in book.shard.params:
                param.grad = None
        before, book.version = book.version, book.version + 1
        self.record.updates += 1
        for group in waiting:
            staleness = before - book.pulled[group]
            self.record.add(staleness)
            self.applied[group] += 1
            book.pulled[group] = book.version
            self._reply(group, staleness, [index])

    # -- checkpoints -------------------------------------------------------------------------
    def _save(self) -> None:
        """Write the checkpoint of the cut every waiting group stands at, then let them go on from the parameters now.

        No group computes meanwhile, so no update falls between one server's snapshot and another's."""
        waiting = sorted(self.saving)
        ranks = [rank for group in waiting for rank in self.groups[group]]
        try:
            self.on_save(wire.SavedStates.take(ranks))
        except Exception as error:
            wire.SavedStates.fail(f"parameter server {self.index} (rank {self.mesh.rank}): {error}")
            for group in waiting:
                self._reply(group, -1, [], status=wire.SAVE_FAILED)
            self._drain()
            raise
        if self.index == 0:  # every server has read them: the save ended with the servers' barrier
            wire.SavedStates.drop(ranks)
        self.saving.clear()
        for group in waiting:
            self._reply(group, -1, range(len(self.books)))
            for book in self.books:
                book.pulled[group] = book.version

    # -- replies -----------------------------------------------------------------------------
    def _reply(self, group: int, staleness: int, optimizers: Any, status: int = wire.OK) -> None:
        """Send `group` the header and the shards of `optimizers`, without waiting for it to read them."""
        leader = self.groups[group][0]
        codes = [self.departed[g]["code"] if g in self.departed else 0 for g in range(len(self.groups))]
        version = self.books[next(iter(optimizers), 0)].version if self.books else 0
        header = torch.tensor([status, staleness, version, *codes], dtype=torch.int64)
        tensors = [header] + [flat for k in optimizers for flat in self.books[k].shard.pack(self.books[k].shard.params)]
        try:
            self._wait_sent(group)
            self._sending[group] = [(dist.isend(t, dst=leader, group=self.everyone, tag=wire.TAG_REPLY), t)
                                    for t in tensors]
        except RuntimeError as error:
            self._depart(group, DIED, f"its leader (rank {leader}) could not be reached: {error}")

    def _wait_sent(self, group: int) -> None:
        for work, _ in self._sending.pop(group, []):
            work.wait()

    def _drain(self) -> None:
        for group in list(self._sending):
            try:
                self._wait_sent(group)
            except RuntimeError as error:
                self._depart(group, DIED, f"it left before reading the final parameters: {error}")

    # -- groups that leave -------------------------------------------------------------------
    def _check_liveness(self, now: float) -> None:
        for group in sorted(self.active):
            stopped = self.heartbeats.stopped_for(group, now)
            if stopped is not None:
                self._depart(group, DIED, f"its heartbeat stopped {stopped:.0f} s ago")
                continue
            waited_on = group in self.saving or any(group in book.pending for book in self.books)
            if not waited_on and now - self.last_heard[group] > self.timeout_s:
                self._depart(group, HUNG, f"it sent nothing for {now - self.last_heard[group]:.0f} s "
                                          f"(REPLICATOR_TIMEOUT={self.timeout_s:g})")
        self._advance()

    def _depart(self, group: int, code: int, why: str) -> None:
        if group in self.departed:
            return
        seconds = time.monotonic() - self.started
        self.departed[group] = {"code": code, "how": "died" if code == DIED else "hung", "step": self.last_step[group],
                                "seconds": seconds, "ranks": self.groups[group], "why": why}
        self.active.discard(group)
        self.finished.discard(group)
        self.saving.discard(group)
        self._sending.pop(group, None)
        for book in self.books:
            book.pending.pop(group, None)
            book.pulled.pop(group, None)
        if code == HUNG:
            wire.Dropped.note(group, why)
        left = sorted(self.active | self.finished)
        print(f"replicator: parameter server {self.index}: sync group {group} (ranks {self.groups[group]}) "
              f"{'died' if code == DIED else 'hung'} after its step {self.last_step[group]}, {seconds:.1f} s into "
              f"the run ({why}); going on with group(s) {left}", file=sys.stderr, flush=True)

    # -- the end -------------------------------------------------------------------------------
    def _share_final_parameters(self) -> None:
        """Every server ends holding the whole model: each broadcasts its shards to the others."""
        if self.servers_group is None or self.mesh.servers == 1:
            return
        for k in range(len(self.books)):
            for server, rank in enumerate(self.mesh.server_ranks):
                broadcast_from_first(self.shards.shard(k, server).params, self.servers_group, rank)
