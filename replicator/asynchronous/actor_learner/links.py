"""Internal: an actor's links to a learner: the insert link (chunks out, credits back) and the weights link.

Each link is one comm.peer_link connection to a server the learner published in the job's
store (or, where the job cannot use sockets, the same frames over Gloo: actor_learner.carrier).
The insert link's credits arrive on a reader thread, so the actor's add() reads two integers to
know whether it may send; the weights link's replies land on a thread of their own, straight
into the actor's receive buffers, while the actor steps its environment (Acme's
VariableClient): the actor loads them at its next update point.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from replicator.asynchronous.actor_learner import exchange
from replicator.asynchronous.actor_learner.carrier import Connection
from replicator.comm.frames import Frame, TensorSpec
from replicator.comm.peer_link import PeerLinkError

__all__ = ["InsertLink", "WeightsLink"]


class InsertLink:
    """The insert link to one learner: what it granted and what this actor sent, and its last word on the run."""

    def __init__(self, learner: int, connection: Connection, changed: threading.Condition) -> None:
        self.learner = learner
        self.connection = connection
        self.changed = changed  # shared by an actor's insert links: credit from any of them wakes it
        self.granted = 0  # items this actor may have sent in all
        self.sent = 0
        self.step = -1  # the learner's step, as of its last credit
        self.done = False  # the learners finished their steps
        self.aborted = False  # some process failed (the text is in the store)
        self.live: list[int] | None = None  # the actors the learner holds alive
        self.error: PeerLinkError | None = None  # the link broke: the learner is gone
        self.last_flush = 0.0
        self._thread = threading.Thread(target=self._read, name=f"replicator-credits-{learner}", daemon=True)
        self._thread.start()

    @property
    def credit(self) -> int:
        return self.granted - self.sent

    def send_chunk(self, meta: torch.Tensor, columns: list[torch.Tensor], count: int) -> None:
        self.connection.send(exchange.CHUNK, [meta, *columns])
        self.sent += count
        self.last_flush = time.monotonic()

    def _read(self) -> None:
        try:
            while True:
                frame = self.connection.receive()
                if frame.kind != exchange.CREDIT or not frame.tensors:
                    continue
                numbers = frame.tensors[0].tolist()
                with self.changed:
                    self.granted = max(self.granted, int(numbers[0]))
                    self.step, self.done = int(numbers[1]), self.done or bool(numbers[2])
                    self.aborted = self.aborted or bool(numbers[3])
                    self.live = [a for a, alive in enumerate(numbers[exchange.CREDIT_FIXED:]) if alive]
                    self.changed.notify_all()
        except (PeerLinkError, ValueError) as error:
            with self.changed:
                self.error = error if isinstance(error, PeerLinkError) else PeerLinkError(str(error))
                self.changed.notify_all()

    def close(self) -> None:
        self.connection.close()


class WeightsLink:
    """The weights link to one learner: at most one pull in flight, its reply received into `flats` by a thread."""

    def __init__(self, connection: Connection, flats: list[torch.Tensor], timeout_s: float) -> None:
        self.connection = connection
        self.flats, self.timeout_s = flats, timeout_s
        self.asked: float | None = None  # when the pull in flight was sent
        self.latencies: list[float] = []  # seconds from each pull's request to its reply
        self._reply: Frame | BaseException | None = None
        self._replied = threading.Event()
        self._turn = threading.Semaphore(0)
        self._closed = False
        self._thread = threading.Thread(target=self._receive, name="replicator-weights", daemon=True)
        self._thread.start()

    def ask(self, index: int, version: int, checksum: int) -> None:
        """Send a pull; its reply is received in the background (collect it with `reply`)."""
        assert self.asked is None, "one pull at a time"
        self._replied.clear()
        self.asked = time.monotonic()
        self.connection.send(exchange.PULL, [torch.tensor([index, version, checksum], dtype=torch.int64)])
        self._turn.release()

    def reply(self) -> Frame:
        """The reply to the pull in flight, waiting for it if it has not arrived; raises PeerLinkError if the
        learner is gone."""
        assert self.asked is not None, "no pull in flight"
        if not self._replied.wait(2 * self.timeout_s):  # a learner answers within REPLICATOR_TIMEOUT / 4
            raise PeerLinkError(f"{self.connection.peer} sent no weights for {2 * self.timeout_s:.0f} s "
                                "(twice REPLICATOR_TIMEOUT): it hangs", self.connection.peer)
        self.asked = None
        reply, self._reply = self._reply, None
        if isinstance(reply, BaseException):
            raise reply
        assert reply is not None
        return reply

    def _into(self, kind: int, specs: Sequence[TensorSpec]) -> Sequence[torch.Tensor] | None:
        return self.flats if kind == exchange.WEIGHTS else None

    def _receive(self) -> None:
        while True:
            self._turn.acquire()
            if self._closed:
                return
            asked = self.asked
            try:
                self._reply = self.connection.receive(into=self._into)
                if asked is not None and len(self.latencies) < 100_000:
                    self.latencies.append(time.monotonic() - asked)
            except (PeerLinkError, ValueError) as error:
                self._reply = error if isinstance(error, PeerLinkError) else PeerLinkError(str(error))
            self._replied.set()

    def close(self, goodbye: bool = False) -> None:
        if goodbye and self.asked is None:
            try:
                self.connection.send(exchange.BYE)
            except PeerLinkError:
                pass  # the learner is gone already
        self._closed = True
        self._turn.release()
        self.connection.close()
