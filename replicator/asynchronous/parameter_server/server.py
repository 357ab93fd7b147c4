"""Internal: a parameter server: one event loop applies the user's optimizer to its shard as group gradients
arrive over the peer link, within the staleness bound, one frame at a time (so no two workers ever race on its
parameters)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from replicator.asynchronous.parameter_server import links, stepping
from replicator.asynchronous.parameter_server.payloads import SharedPayloads, open_offer
from replicator.asynchronous.parameter_server.shards import Shard, ShardMap
from replicator.asynchronous.parameter_server.staleness import StalenessRecord
from replicator.comm.frames import Frame, Outgoing, TensorSpec, byte_view
from replicator.comm.peer_link import Peer, PeerLinkError
from replicator.identity import broadcast_from_first
from replicator.timeline import recorder as timeline
from replicator.topology import Mesh

__all__ = ["ParameterServer", "DIED", "HUNG", "reply_header_size"]

DIED, HUNG = 1, 2  # how a departed group left, as the replies report it
# Each request as the timeline names the server's span of handling it.
_SPAN_NAMES: dict[int, str] = {links.PULL: "serve pull", links.SAVE: "serve save", links.DONE: "serve finish",
                               links.OFFER: "open shared payloads"}


def reply_header_size(num_groups: int) -> int:
    """status, staleness of the gradient just applied (-1: none), version, then each group's departure."""
    return 3 + num_groups


class _Gradient:
    """One group's pushed gradient for one optimizer's shard, where its frame landed (the group's own buffers)."""

    def __init__(self, shard: Shard, optimizer: torch.optim.Optimizer, shared: list[torch.Tensor] | None) -> None:
        self.lrs = torch.empty(len(optimizer.param_groups), dtype=torch.float64)
        self.present = torch.empty(len(shard.params), dtype=torch.uint8)  # 0: no replica of the group had a gradient
        # Shaped as the shard's parameters, views of one flat buffer per dtype: the group's gradient slot in shared
        # memory (the frame carries only the rates and presence), else buffers of this server's.
        self.views = shared if shared is not None else shard.unpack(shard.empty())
        # Where a push lands: a tuple, so the link checks and views it once; the numbers read back without torch.
        self.tensors = (self.lrs, self.present, *([] if shared is not None else self.views))
        self.rates, self.has = byte_view(self.lrs).cast("d"), byte_view(self.present)


@dataclass
class _Book:
    """One optimizer's shard on this server: its version, what each group last pulled, gradients waiting."""

    shard: Shard
    optimizer: torch.optim.Optimizer
    version: int = 0
    pulled: dict[int, int] = field(default_factory=dict)
    pending: dict[int, _Gradient] = field(default_factory=dict)
    landing: dict[int, _Gradient] = field(default_factory=dict)  # each group's push lands in its own buffers


class ParameterServer:
    """Serves its shard of every wrapped optimizer until every sync group has finished or left."""

    def __init__(self, mesh: Mesh, servers: dist.ProcessGroup | None, shards: ShardMap, max_staleness: int | None,
                 timeout_s: float, on_save: Callable[[dict[int, bytes]], object], plan: links.Links) -> None:
        self.mesh, self.servers_group = mesh, servers
        self.index = mesh.rank - mesh.num_stepping
        self.groups = mesh.group_partition
        self.group_of = {ranks[0]: group for group, ranks in enumerate(self.groups)}  # a leader's rank: its group
        self.shards = shards
        self.bound = max_staleness
        self.timeout_s = timeout_s
        self.books = [_Book(shards.shard(k, self.index), optimizer) for k, optimizer in enumerate(shards.optimizers)]
        for book in self.books:
            book.shard.bind()  # the parameters become views of the flat buffers a reply is sent from
        self.record = StalenessRecord(max_staleness)
        self.departed: dict[int, dict[str, Any]] = {}
        self.applied = [0] * len(self.groups)  # gradients applied, per group
        self.on_save = on_save  # writes a checkpoint from the workers' states, by rank (every server calls it)
        self.saving: set[int] = set()  # groups waiting at a checkpoint's cut
        self.leaders: dict[int, Peer] = {}  # each group's connection, once it has sent a frame
        self.codes: dict[int, int] = {}  # how each departed group left, as replies report it
        # Each set of optimizers' reply: its frame (the header, then the flat buffers) and the header's numbers.
        self.replies: dict[tuple[tuple[int, ...], bool], tuple[Outgoing, memoryview]] = {}
        self.shared: dict[int, SharedPayloads] = {}  # groups on this node whose payloads travel in shared memory
        self.inbox = plan.serve(self.index, self._place)

    # -- the loop ----------------------------------------------------------------------------
    @torch.no_grad()  # a server computes no gradient: grad mode off once, not around every update
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
        while self.active:
            try:  # no sleep, no poll: the kernel wakes this loop for a frame, a departure or the next deadline
                event = self.inbox.receive(self._until_next_deadline())
            except PeerLinkError as error:
                self._left(error)
                event = None
            if event is None:
                self._check_liveness(time.monotonic())
            else:
                began = timeline.clock()
                kind, group = self._handle(*event)
                self._advance()
                if (recording := timeline.active()) is not None and group is not None:
                    recording.add(_SPAN_NAMES.get(kind, "serve push"), "server", began, timeline.clock(),
                                  args={"group": group})
            if self.saving and self.active <= self.saving:  # every group still in the run is at the cut
                with timeline.span("checkpoint save", "checkpoint"):
                    self._save()
                if until_saved:
                    return {}
        for group in sorted(self.finished):
            self._reply(group, -1, range(len(self.books)))
        with timeline.span("share final parameters", "server"):
            self._share_final_parameters()
        return {"role": "server", "server": self.index, "versions": [book.version for book in self.books],
                "applied_per_group": list(self.applied), "departed": dict(self.departed),
                "seconds": time.monotonic() - started, **self.record.summary()}

    def _until_next_deadline(self) -> float | None:
        """Seconds until the first group that nobody waits on has been silent for the timeout (None: no such group)."""
        silent = [self.last_heard[g] for g in self.active if not self._waited_on(g)]
        return None if not silent else max(0.0, min(silent) + self.timeout_s - time.monotonic())

    def _place(self, peer: Peer, kind: int, specs: Sequence[TensorSpec]) -> Sequence[torch.Tensor] | None:
        """Where a frame's tensors land: a push's, in its group's buffers for that optimizer (made once)."""
        group, optimizer = self.group_of.get(peer.rank), kind - links.PUSH
        if group is None or not 0 <= optimizer < len(self.books):
            return None
        book = self.books[optimizer]
        if group not in book.landing:
            shared = self.shared.get(group)
            book.landing[group] = _Gradient(book.shard, book.optimizer,
                                            None if shared is None else shared.gradient_views(optimizer, book.shard))
        return book.landing[group].tensors

    def _handle(self, peer: Peer, frame: Frame) -> tuple[int, int | None]:
        """Take in one request; its kind and group (None: not from a group's leader, ignored)."""
        kind, group = frame.kind, self.group_of.get(peer.rank)
        if group is None:
            print(f"replicator: parameter server {self.index}: ignored a frame from {peer}, not a sync group's "
                  "leader", file=sys.stderr, flush=True)
            return kind, None
        self.leaders[group] = peer
        self.last_heard[group], self.last_step[group] = time.monotonic(), frame.request
        optimizer = kind - links.PUSH if kind >= links.PUSH else None
        if kind == links.OFFER:
            self._take_offer(peer, group, frame)
            return kind, group
        if group in self.departed:  # declared hung, yet here: tell it, so it stops with a clear error
            self._reply(group, -1, [optimizer] if optimizer is not None else range(len(self.books)),
                        status=links.FAILED)
            return kind, group
        if kind == links.PULL:
            self._reply(group, -1, range(len(self.books)))
            for book in self.books:
                book.pulled[group] = book.version
        elif optimizer is not None:
            book = self.books[optimizer]
            book.pending[group] = book.landing[group]  # the frame's tensors: they landed there
        elif kind == links.SAVE:
            self.saving.add(group)
        elif kind == links.DONE:
            self.active.discard(group)
            self.finished.add(group)
            for book in self.books:
                book.pulled.pop(group, None)
        return kind, group

    def _take_offer(self, peer: Peer, group: int, frame: Frame) -> None:
        """A leader on this node offers a segment for its payloads: map it and say so (flags 1), or refuse (0)."""
        name = frame.tensors[0] if len(frame.tensors) == 1 else None
        fresh = group not in self.shared and not any(group in book.landing for book in self.books)
        payloads = None
        if name is not None and name.dtype == torch.uint8 and name.dim() == 1 and name.numel() <= 128 and fresh:
            payloads = open_offer(bytes(name.numpy()), self.shards, self.index, peer)
        else:
            print(f"replicator: parameter server {self.index}: refused an offer of shared memory from {peer}: not "
                  "one name, or after its first push", file=sys.stderr, flush=True)
        if payloads is not None:
            self.shared[group] = payloads
        try:
            self.inbox.send(peer, links.OFFER, flags=int(payloads is not None))
        except PeerLinkError as error:
            self._depart(group, DIED, f"its leader (rank {self.groups[group][0]}) could not be reached: {error}")

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
        # The gradients as they landed: one is applied from its own buffers; several are summed into the
        # first's, in group order, and averaged (the same sums as from zeros: 0 + g is g, bit for bit).
        first = gradients[0]
        present = first.has.tolist()
        if len(gradients) > 1:
            for gradient in gradients[1:]:
                present = [a or b for a, b in zip(present, gradient.has.tolist(), strict=True)]
                for total, view in zip(first.views, gradient.views, strict=True):
                    total += view
            for total in first.views:
                total /= len(gradients)
        params = book.shard.params
        for param, total, has in zip(params, first.views, present, strict=True):
            # On the host, the landed gradient itself: no copy.
            param.grad = (total if total.device == param.device else total.to(param.device)) if has else None
        for param_group, lr in zip(book.optimizer.param_groups, first.rates.tolist(), strict=True):
            param_group["lr"] = lr  # the workers' schedulers set the rate, as in synchronous mode
        stepping.step(book.optimizer)  # the user's optimizer itself, past replicator's wrapper
        for param in params:
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
            self.on_save(links.SavedStates.take(ranks))
        except Exception as error:
            links.SavedStates.fail(f"parameter server {self.index} (rank {self.mesh.rank}): {error}")
            for group in waiting:
                self._reply(group, -1, range(len(self.books)), status=links.SAVE_FAILED)
            raise
        if self.index == 0:  # every server has read them: the save ended with the servers' barrier
            links.SavedStates.drop(ranks)
        self.saving.clear()
        for group in waiting:
            self._reply(group, -1, range(len(self.books)))
            for book in self.books:
                book.pulled[group] = book.version

    # -- replies -----------------------------------------------------------------------------
    def _reply(self, group: int, staleness: int, optimizers: Any, status: int = links.OK) -> None:
        """One frame to `group`'s leader: the status, the staleness, the version and every group's departure, then
        the flat buffers of `optimizers`' shards (the parameters themselves)."""
        key, shared = tuple(optimizers), self.shared.get(group)
        if (reply := self.replies.get((key, shared is not None))) is None:  # made once: the header's memory and the
            header = torch.zeros(reply_header_size(len(self.groups)), dtype=torch.int64)  # flat buffers never move
            flats = [] if shared is not None else [flat for k in key for flat in self.books[k].shard.flats]
            reply = self.replies[(key, shared is not None)] = (Outgoing([header, *flats]), byte_view(header).cast("q"))
        frame, numbers = reply
        numbers[0], numbers[1], numbers[2] = status, staleness, self.books[key[0]].version if key else 0
        for g, code in self.codes.items():
            numbers[3 + g] = code
        for k in key:
            self.books[k].shard.gather()
            if shared is not None:  # the group's leader waits for this reply: nobody reads the slot meanwhile
                for slot, flat in zip(shared.slots[k].reply, self.books[k].shard.flats, strict=True):
                    slot.copy_(flat)
        try:
            self.inbox.send(self.leaders[group], links.REPLY, frame, flags=status)
        except PeerLinkError as error:
            self._depart(group, DIED, f"its leader (rank {self.groups[group][0]}) could not be reached: {error}")

    # -- groups that leave -------------------------------------------------------------------
    def _waited_on(self, group: int) -> bool:
        """Is `group` waiting on this server (its reply held back), so that its silence says nothing?"""
        return group in self.saving or any(group in book.pending for book in self.books)

    def _left(self, error: PeerLinkError) -> None:
        """A group's leader closed its link (it died: its end of file, at once) or broke the protocol."""
        group = self.group_of.get(error.peer.rank) if error.peer is not None else None
        if group is None or group not in self.active | self.finished:
            return
        self._depart(group, DIED, f"its leader (rank {self.groups[group][0]}) left: {error}")
        self._advance()

    def _check_liveness(self, now: float) -> None:
        for group in sorted(self.active):
            if not self._waited_on(group) and now - self.last_heard[group] >= self.timeout_s:
                self._depart(group, HUNG, f"it sent nothing for {now - self.last_heard[group]:.0f} s "
                                          f"(REPLICATOR_TIMEOUT={self.timeout_s:g})")
        self._advance()

    def _depart(self, group: int, code: int, why: str) -> None:
        if group in self.departed:
            return
        seconds = time.monotonic() - self.started
        self.departed[group] = {"code": code, "how": "died" if code == DIED else "hung", "step": self.last_step[group],
                                "seconds": seconds, "ranks": self.groups[group], "why": why}
        self.codes[group] = code
        self.active.discard(group)
        self.finished.discard(group)
        self.saving.discard(group)
        for book in self.books:
            book.pending.pop(group, None)
            book.pulled.pop(group, None)
        if code == HUNG:
            links.Dropped.note(group, why)
        left = sorted(self.active | self.finished)
        print(f"replicator: parameter server {self.index}: sync group {group} (ranks {self.groups[group]}) "
              f"{'died' if code == DIED else 'hung'} after its step {self.last_step[group]}, {seconds:.1f} s into "
              f"the run ({why}); going on with group(s) {left}", file=sys.stderr, flush=True)

    # -- the end -------------------------------------------------------------------------------
    def _share_final_parameters(self) -> None:
        """Every server ends holding the whole model: each broadcasts its shards to the others."""
        if self.servers_group is None or self.mesh.serving == 1:
            return
        for k in range(len(self.books)):
            for server, rank in enumerate(self.mesh.serving_ranks):
                broadcast_from_first(self.shards.shard(k, server).params, self.servers_group, rank)

    def close(self) -> None:
        self.inbox.close()
