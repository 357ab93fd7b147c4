"""Internal: how workers and parameter servers reach each other: tickets and heartbeats in the job's
store, tensors over Gloo point-to-point.

A server cannot post a Gloo receive "from whoever comes next" and still notice a worker that
died (such a receive only times out, and a Gloo timeout breaks the group). So a worker first
takes a ticket in the job's store naming its sync group; the server reads tickets in order
and then receives the request's tensors from that group's leader, a known peer whose death
Gloo reports at once. Tickets hold a decimal number, nothing that is unpickled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from replicator.comm.store import job_store

__all__ = ["PULL", "PUSH", "DONE", "SAVE", "OK", "FAILED", "SAVE_FAILED", "TAG_REQUEST", "TAG_REPLY", "Tickets",
           "Heartbeat", "SavedStates", "Dropped", "idle_sleep"]

# What a request asks for (the first number of its header).
PULL = 1  # the parameters, now
PUSH = 2  # apply this gradient, then answer with the parameters it produced
DONE = 3  # this group has finished: answer with the final parameters once every group has
SAVE = 4  # checkpoint at this cut: answer with the parameters once every group is here and it is written

OK = 0
FAILED = 1
SAVE_FAILED = 2  # the checkpoint could not be written: SavedStates.error() says why

TAG_REQUEST = 71
TAG_REPLY = 72
TAG_VERDICT = 73  # a group's leader to its members

_PREFIX = "replicator/async/"


class Tickets:
    """One server's queue of requests, in the order workers took their tickets."""

    def __init__(self, server: int) -> None:
        self.key = f"{_PREFIX}server{server}/"
        self.next = 1

    def post(self, group: int) -> None:
        """Queue a request from `group` (a worker leader, before sending its tensors)."""
        store = job_store()
        number = store.add(self.key + "count", 1)
        store.set(f"{self.key}{number}", str(group))

    def take(self) -> int | None:
        """The group of the next request, or None when none is queued yet (the server's side)."""
        store = job_store()
        key = f"{self.key}{self.next}"
        if not store.check([key]):
            return None
        group = int(store.get(key).decode("ascii"))
        store.delete_key(key)
        self.next += 1
        return group


class Heartbeat:
    """A counter in the store that a sync group's leader bumps twice a second from a daemon thread.

    Servers read it to tell a group that died (its counter stops) from one that is computing a
    long step (its counter moves); a hung group's counter moves too, so servers also time out
    groups that send nothing for REPLICATOR_TIMEOUT."""

    PERIOD_S = 0.5

    def __init__(self, group: int) -> None:
        self.key = f"{_PREFIX}beat{group}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="replicator-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        store = job_store()
        while not self._stop.wait(self.PERIOD_S):
            try:
                store.add(self.key, 1)
            except RuntimeError:  # the store went away: the job is ending
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.PERIOD_S)
            self._thread = None

    def read(self) -> int:
        return int(job_store().add(self.key, 0))


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


class HeartbeatWatch:
    """Tells which of some peers' heartbeats stopped: a counter that has not moved for a grace period.

    The grace stays well inside the timeout: a peer waiting on the watcher must hear that another
    died before its own receive gives up."""

    def __init__(self, peers: Iterable[int], timeout_s: float) -> None:
        self.grace_s = min(timeout_s / 3, 10.0)
        now = time.monotonic()
        self._seen = {peer: (Heartbeat(peer).read(), now) for peer in peers}

    def heard(self, peer: int, now: float) -> None:
        """A request from `peer` is a sign of life too."""
        self._seen[peer] = (self._seen[peer][0], now)

    def stopped_for(self, peer: int, now: float) -> float | None:
        """Seconds since `peer`'s counter last moved, once that exceeds the grace; else None."""
        beat, since = self._seen[peer]
        current = Heartbeat(peer).read()
        if current != beat:
            self._seen[peer] = (current, now)
            return None
        return now - since if now - since > self.grace_s else None


def idle_sleep(idle_since: float) -> None:
    """Poll quickly right after a request (the next one often follows), then back off to 2 ms."""
    time.sleep(min(0.002, max(0.0001, (time.monotonic() - idle_since) / 50)))
