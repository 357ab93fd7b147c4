"""Internal: actors' and the evaluator's heartbeats: a counter each bumps in the job's store, which the learners watch.

An actor's death is known at once from its link's end of file; the heartbeat tells a learner
that an actor which has not sent for a while is alive (stepping a slow environment) rather than
stopped, and names one that stopped answering while its socket stayed open (SIGSTOP, a debugger).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from replicator.comm.store import job_store

__all__ = ["Heartbeat", "HeartbeatWatch"]

_PREFIX = "replicator/async/"


class Heartbeat:
    """A counter in the store that an actor (or the evaluator) bumps twice a second from a daemon thread."""

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
