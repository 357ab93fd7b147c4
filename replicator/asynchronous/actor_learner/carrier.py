"""Internal: what carries the actor–learner links: sockets (the peer link), or Gloo point-to-point where the job cannot.

The job decides together, as the parameter servers do (`comm.gloo_peer.use_sockets`): sockets,
unless some process sets REPLICATOR_PEER_LINK=0 or cannot open one. Over Gloo the frames, their
bounds and the protocol stay the same (`comm.gloo_peer.GlooPeer`); a learner serves each link
from one `comm.gloo_inbox.GlooInbox`, which must know its peers in advance, so nobody can join a
running job that way (`rp.join_actor` is refused). Two process groups carry the frames, one per
direction, each with the timeout that way of waiting needs (a Gloo group's timeout is each
process's own and bounds a send as well as a receive; a receive that timed out would break its
pair for good): a process waits for frames without a limit of Gloo's (its peers' deaths still
end the wait, and the regime's own clocks name hung peers), and gives up on a send after the
timeout. Each run and link has its own tag, so a thread still waiting on an earlier run's link
never takes a frame of the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from replicator.asynchronous.actor_learner import exchange
from replicator.asynchronous.actor_learner.roles import Roles
from replicator.comm.frames import Frame
from replicator.comm.gloo_inbox import GlooInbox
from replicator.comm.gloo_peer import TAG, GlooPair, GlooPeer
from replicator.comm.peer_link import IntoFor, Peer, connect
from replicator.comm.peer_server import PeerServer
from replicator.topology import WAIT_WITHOUT_LIMIT_S, group_of_mine

__all__ = ["Carrier", "Connection", "Server", "INSERTS", "WEIGHTS"]

INSERTS, WEIGHTS = 0, 1  # a learner's two links


class Connection(Protocol):
    """An actor's end of one link."""

    peer: Peer
    transport: str

    def send(self, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0, flags: int = 0) -> None: ...

    def receive(self, into: Sequence[torch.Tensor] | IntoFor | None = None) -> Frame: ...

    def close(self) -> None: ...


class Server(Protocol):
    """A learner's end of one link: frames from whichever actor sends first, replies to any."""

    def receive(self, timeout_s: float | None = None) -> tuple[Peer, Frame] | None: ...

    def send(self, peer: Peer, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0,
             flags: int = 0) -> None: ...

    def wake(self) -> None: ...

    def disconnect(self, peer: Peer) -> None: ...

    def close(self) -> None: ...


class Carrier:
    """Sockets or Gloo for one job's actor–learner links; made at the same point on every process of the job
    (over Gloo it makes process groups). An actor that joins from outside the job has `Carrier()`: sockets."""

    def __init__(self, roles: Roles | None = None, sockets: bool = True, timeout_s: float = 0.0) -> None:
        self.roles, self.sockets, self.timeout_s = roles, sockets, timeout_s
        self.transport = "socket" if sockets else "gloo"
        if not sockets:
            assert roles is not None
            world = [list(range(roles.learners + roles.others))]
            learner = roles.role == "learner"
            never, limit = WAIT_WITHOUT_LIMIT_S, 2 * timeout_s
            # Actors to learners (joins, chunks, pulls, goodbyes), then learners to actors (credits, weights).
            self.upstream = group_of_mine(world, never if learner else limit, "gloo")
            self.downstream = group_of_mine(world, limit if learner else never, "gloo")

    @staticmethod
    def tag(run: int, link: int) -> int:
        return TAG + 1 + 2 * run + link

    # -- an actor (or the evaluator) -------------------------------------------------------------
    def connect(self, run: int, learner: int, link: int, *, rank: int, role: str) -> Connection:
        """This actor's end of `learner`'s link `link` (INSERTS or WEIGHTS) for run `run`."""
        if self.sockets:
            name = (exchange.Keys.insert_link if link == INSERTS else exchange.Keys.weights_link)(run, learner)
            return connect(name, rank=rank, role=role, timeout_s=self.timeout_s, store=exchange.store())
        assert self.roles is not None
        peer = Peer(learner, f"learner {learner}", -1, "gloo")
        tag = self.tag(run, link)
        return GlooPair(GlooPeer(peer, self.upstream, tag=tag), GlooPeer(peer, self.downstream, tag=tag))

    # -- a learner ---------------------------------------------------------------------------------
    def serve(self, run: int, link: int, index: int, *, rank: int, role: str) -> Server:
        """Learner `index`'s end of its link `link` for run `run`: every actor (and the evaluator) on INSERTS, the
        ones that pull from it on WEIGHTS."""
        if self.sockets:
            name = (exchange.Keys.insert_link if link == INSERTS else exchange.Keys.weights_link)(run, index)
            return PeerServer(name, rank=rank, role=role, timeout_s=self.timeout_s, store=exchange.store())
        roles = self.roles
        assert roles is not None
        others = [a for a in range(roles.others) if link == INSERTS or a % roles.learners == index]
        peers = [Peer(roles.actor_rank(a), roles.name(a).split(" (")[0], -1, "gloo") for a in others]
        return GlooInbox(peers, self.upstream, reply_group=self.downstream, tag=self.tag(run, link))
