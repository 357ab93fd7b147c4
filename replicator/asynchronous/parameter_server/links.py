"""Internal: how parameter servers and sync groups reach each other: one peer link per pair, one frame each way.

Each server listens (`comm.peer_server.PeerServer`: one event loop serves every group's
leader, whichever sends first); each group's leader connects to every server and, in a
group of several workers, listens for its members, which connect to it. An update is one
frame each way: the leader's request (for a push: the learning rates, which of the shard's
parameters have a gradient, and the gradients themselves, each from its own memory) and the
server's reply (a few numbers, then the shard's flat buffers), received in place. Where the
job cannot use sockets (`comm.gloo_peer.use_sockets`), the same frames go over Gloo
point-to-point (`comm.gloo_inbox.GlooInbox` on the servers). The job's store is only where
the links are set up, where workers put their state for a checkpoint, and where the servers
note why they dropped a group as hung (read by that group when it wakes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from replicator.comm.frames import FIRST_USER_KIND, Frame
from replicator.comm.gloo_inbox import GlooInbox
from replicator.comm.gloo_peer import GlooPair, GlooPeer
from replicator.comm.peer_link import Peer, connect
from replicator.comm.peer_server import PeerServer, Placement
from replicator.comm.store import job_store
from replicator.topology import WAIT_WITHOUT_LIMIT_S, Mesh, group_of_mine

__all__ = ["PULL", "SAVE", "DONE", "PUSH", "REPLY", "VERDICT", "PARAMETERS", "OFFER", "OK", "FAILED", "SAVE_FAILED",
           "Links", "Inbox", "Link", "SavedStates", "Dropped", "push_kind"]

# What a group's leader asks a server (the kind of its frame; the request id carries the group's step).
PULL = FIRST_USER_KIND  # the parameters, now
SAVE = FIRST_USER_KIND + 1  # checkpoint at this cut: answer once every group is here and it is written
DONE = FIRST_USER_KIND + 2  # this group has finished: answer with the final parameters once every group has
REPLY = FIRST_USER_KIND + 3  # a server's answer: [status, staleness, version, each group's departure], parameters
VERDICT = FIRST_USER_KIND + 4  # a leader to its members: [status, server, staleness per server] (+ why, on failure)
PARAMETERS = FIRST_USER_KIND + 5  # a leader to its members: the shards' flat buffers it received
# A leader on a server's node: the name of a segment for the payloads (see payloads.py); the server answers with
# the same kind, flags 1 if it mapped it (then both sides' payloads live there), 0 if it refused.
OFFER = FIRST_USER_KIND + 6
PUSH = 64  # + the optimizer's index: apply this gradient, answer with the parameters it produced

OK = 0
FAILED = 1
SAVE_FAILED = 2  # the checkpoint could not be written: SavedStates.error() says why

_PREFIX = "replicator/parameter_servers/"


def push_kind(optimizer: int) -> int:
    return PUSH + optimizer


class Inbox(Protocol):
    """A server's end: frames from whichever peer sends first, replies to any."""

    def receive(self, timeout_s: float | None = None) -> tuple[Peer, Frame] | None: ...

    def send(self, peer: Peer, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0,
             flags: int = 0) -> None: ...

    def close(self) -> None: ...


class Link(Protocol):
    """A connecting end: frames to and from one peer."""

    peer: Peer
    transport: str

    def send(self, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0, flags: int = 0) -> None: ...

    def receive(self, into: Sequence[torch.Tensor] | None = None) -> Frame: ...

    def close(self) -> None: ...


class Links:
    """The links of one parameter-server regime: their names and carrier, the same on every process.

    A leader waits on a server up to twice the timeout (a server holds a reply while the bound
    waits for a group that may take the timeout to be dropped), a member on its leader three
    times: each hears the error of the one it waits on before a timeout of its own. A server
    waits on a group without a limit of the carrier's: it drops a silent group itself, after
    the timeout (a Gloo receive that times out would break its pair for good).

    Every process makes a job's Links at the same point (over Gloo, it makes process groups)."""

    _made = 0  # regimes made in this process: every process makes them in the same order, so names agree

    def __init__(self, mesh: Mesh, sockets: bool, timeout_s: float) -> None:
        Links._made += 1
        self.prefix = f"parameter_servers/{Links._made}/"
        self.mesh, self.sockets, self.timeout_s = mesh, sockets, timeout_s
        if not sockets:
            # One group per way of waiting. A Gloo group's timeout is each process's own, and it bounds a send as
            # well as a receive (a send waits for the receiver): a server waits on groups without a limit of
            # Gloo's (a receive that timed out would break its pair for good), a leader on a server as above.
            world, serving = [list(range(mesh.world_size))], mesh.serves
            self.requests = group_of_mine(world, WAIT_WITHOUT_LIMIT_S if serving else 2 * timeout_s, "gloo")
            self.replies = group_of_mine(world, (1 if serving else 2) * timeout_s, "gloo")
            self.within_groups = group_of_mine(world, 3 * timeout_s, "gloo")

    def leaders(self) -> list[Peer]:
        return [Peer(ranks[0], f"sync group {group}", -1, "gloo")
                for group, ranks in enumerate(self.mesh.group_partition)]

    # -- a server ----------------------------------------------------------------------------------
    def serve(self, index: int, place: Placement) -> Inbox:
        if not self.sockets:
            return GlooInbox(self.leaders(), self.requests, place=place, reply_group=self.replies)
        return PeerServer(f"{self.prefix}server{index}", rank=self.mesh.rank, role=f"parameter server {index}",
                          place=place, timeout_s=self.timeout_s)

    # -- a group's leader ----------------------------------------------------------------------------
    def to_server(self, index: int) -> Link:
        rank, role = self.mesh.rank, f"sync group {self.mesh.group_id}"
        if not self.sockets:
            server = Peer(self.mesh.serving_ranks[index], f"parameter server {index}", -1, "gloo")
            return GlooPair(GlooPeer(server, self.requests), GlooPeer(server, self.replies))
        return connect(f"{self.prefix}server{index}", rank=rank, role=role, timeout_s=2 * self.timeout_s)

    def to_members(self) -> list[Link]:
        """The leader's links to the other members of its group (they connect to it)."""
        members = self.mesh.group_partition[self.mesh.group_id][1:]
        if not members:
            return []
        if not self.sockets:
            return [GlooPeer(Peer(rank, "sync group member", -1, "gloo"), self.within_groups) for rank in members]
        server = PeerServer(f"{self.prefix}group{self.mesh.group_id}", rank=self.mesh.rank,
                            role=f"leader of sync group {self.mesh.group_id}", timeout_s=self.timeout_s)
        peers = sorted(server.wait_for(len(members)), key=lambda peer: peer.rank)
        return [_Served(server, peer) for peer in peers]

    # -- a member ------------------------------------------------------------------------------------
    def to_leader(self) -> Link:
        leader = self.mesh.group_partition[self.mesh.group_id][0]
        if not self.sockets:
            return GlooPeer(Peer(leader, f"leader of sync group {self.mesh.group_id}", -1, "gloo"), self.within_groups)
        return connect(f"{self.prefix}group{self.mesh.group_id}", rank=self.mesh.rank, role="sync group member",
                       timeout_s=3 * self.timeout_s)


class _Served:
    """One peer of a PeerServer that only sends to it, as a Link."""

    transport = "socket"

    def __init__(self, server: PeerServer, peer: Peer) -> None:
        self.server, self.peer = server, peer

    def send(self, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0, flags: int = 0) -> None:
        self.server.send(self.peer, kind, tensors, request=request, flags=flags)

    def receive(self, into: Sequence[torch.Tensor] | None = None) -> Frame:
        raise NotImplementedError("a leader only sends to its members")

    def close(self) -> None:
        if self.server.connections:
            self.server.close()


class SavedStates:
    """What each worker hands the servers for a checkpoint, in the job's store (tagged JSON, never unpickled)."""

    KEY = f"{_PREFIX}save/"

    @classmethod
    def put(cls, rank: int, state: bytes) -> None:
        job_store().set(f"{cls.KEY}rank{rank}", state.decode("ascii"))  # tagged JSON is ASCII

    @classmethod
    def take(cls, ranks: list[int]) -> dict[int, bytes]:
        store = job_store()
        return {rank: store.get(f"{cls.KEY}rank{rank}") for rank in ranks}

    @classmethod
    def drop(cls, ranks: list[int]) -> None:
        store = job_store()
        for rank in ranks:
            store.delete_key(f"{cls.KEY}rank{rank}")

    @classmethod
    def fail(cls, message: str) -> None:
        job_store().set(f"{cls.KEY}error", message)

    @classmethod
    def error(cls) -> str:
        return job_store().get(f"{cls.KEY}error").decode("utf-8", errors="replace")


class Dropped:
    """Why the servers dropped a group as hung, in the store: read by the group when it wakes, even after the
    servers have finished (when nobody is left to answer its request)."""

    @staticmethod
    def note(group: int, why: str) -> None:
        try:
            job_store().set(f"{_PREFIX}dropped{group}", why)
        except RuntimeError:  # the store went away: the job is ending
            pass

    @staticmethod
    def read(group: int) -> str | None:
        try:
            store, key = job_store(), f"{_PREFIX}dropped{group}"
            return store.get(key).decode("utf-8", errors="replace") if store.check([key]) else None
        except RuntimeError:
            return None
