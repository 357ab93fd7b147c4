"""Waits that can never end: replicas waiting for each other on different channels find out and fail (internal).

A pipeline job checks on two channels: the whole job's (steps, the facade's verbs) and this
stage's replicas' (ctx collectives, gradient syncs). Checks on one channel pair in order, so a
call made by some replicas only meets another check and fails at once. Across two channels it
can meet nothing: one replica waits on its stage's channel for a peer that waits on the job's
channel for it, and neither wait can end. So after a short grace a waiting process leaves a
note in the job's store (its check, the channel, how many checks it has made on each channel),
and reads its stage peers' notes: a peer that waits for it while it waits for that peer is a
deadlock, and both raise, naming each other's checks. Nothing is written while checks complete
within the grace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replicator.comm.store import RankRecords

__all__ = ["Channel", "StallWatch", "Waiting", "grace_for"]

_NOTES = RankRecords("replicator/waiting/")  # each waiting rank's note: what it waits for
_INTENT_KEY = "replicator/intent/"
LOOK_EVERY_S = 0.25


@dataclass(frozen=True)
class Channel:
    """One ordered channel of checks: its name (the same on every member), members, and this process's count."""

    name: str
    members: tuple[int, ...]
    posted: Callable[[], int]  # checks this process has started on it so far
    settle_arrived: Callable[[], None]  # judge its latest check if every member has made it (may raise)


class StallWatch:
    """This process's channels and the peers (its stage's replicas) whose notes it reads while it waits."""

    def __init__(self, rank: int, who: str, peers: list[int], grace_s: float) -> None:
        self.rank, self.who, self.grace_s = rank, who, grace_s
        self.peers = [peer for peer in peers if peer != rank]
        self.channels: dict[str, Channel] = {}
        self._serial = 0

    def add(self, channel: Channel) -> None:
        self.channels[channel.name] = channel

    def settle_others(self, channel: str) -> None:
        """Judge the checks of the other channels that have arrived meanwhile: a mismatch there (a
        peer's stray call met this process's check) raises now, not after this wait's timeout."""
        for name, other in self.channels.items():
            if name != channel:
                other.settle_arrived()

    def intents(self, channel: str, ticket: int, mine: dict[str, Any]) -> list[dict[str, Any] | None]:
        """Every member's intent at a check that did not match, through the store, where each member
        that finds the mismatch leaves its own. A backend's all-gather would need every member, and one
        may be waiting on the other channel: it finds the mismatch within a grace or two (see
        `settle_others`), and is reported as None if it does not."""
        members = self.channels[channel].members
        intents = RankRecords(f"{_INTENT_KEY}{channel}/{ticket}/")
        found: list[dict[str, Any] | None] = [mine if rank == self.rank else None for rank in members]
        try:
            store = intents.store
            intents.put(self.rank, mine)
            deadline = time.monotonic() + 4 * self.grace_s
            theirs = intents.wait(members, 4 * self.grace_s)
            found = [mine if rank == self.rank else theirs.get(rank) for rank in members]
            # Leave only once every member that answered has read the others: the store may live in
            # one of them (rank 0), and goes when that process exits with its error.
            answered = sum(note is not None for note in found)
            done = f"{_INTENT_KEY}{channel}/{ticket}/read"
            store.add(done, 1)
            while time.monotonic() < deadline and store.add(done, 0) < answered:
                time.sleep(0.05)
        except Exception:  # the store went with a process that failed first: report what is known
            pass
        return found

    def waiting(self, channel: str, ticket: int, signature: str, site: str) -> Waiting:
        """A wait on `channel`'s check number `ticket` that has outlasted the grace."""
        self._serial += 1
        return Waiting(self, {"serial": self._serial, "rank": self.rank, "who": self.who, "channel": channel,
                              "ticket": ticket, "check": signature, "site": site,
                              "posted": {name: c.posted() for name, c in self.channels.items()}})


class Waiting:
    """One long wait: its note in the store, and what the peers' notes say."""

    def __init__(self, watch: StallWatch, note: dict[str, Any]) -> None:
        self.watch, self.note = watch, note
        self._published = False
        self._suspects: dict[int, int] = {}  # rank -> serial of a note seen waiting for us, last look

    def look(self) -> dict[str, Any] | None:
        """Publish this wait once; return a peer's note when it and this process wait for each other.

        A peer's note is trusted once seen twice with the same serial, so that a note read
        while that peer's wait was ending (and not yet taken down) cannot mislead."""
        if not self._published:
            _NOTES.put(self.watch.rank, self.note)
            self._published = True
        suspects: dict[int, int] = {}
        for peer, theirs in _NOTES.present(self.watch.peers).items():
            if self._waits_for_us(theirs) and self._we_wait_for(theirs):
                if self._suspects.get(peer) == theirs["serial"]:
                    return dict(theirs)
                suspects[peer] = theirs["serial"]
        self._suspects = suspects
        return None

    def done(self) -> None:
        """The wait ended normally: take the note down."""
        if self._published:
            _NOTES.remove(self.watch.rank)

    def _waits_for_us(self, theirs: dict[str, Any]) -> bool:
        channel = self.watch.channels.get(theirs["channel"])
        return channel is not None and self.watch.rank in channel.members and channel.posted() <= theirs["ticket"]

    def _we_wait_for(self, theirs: dict[str, Any]) -> bool:
        mine = self.watch.channels[self.note["channel"]]
        return theirs["rank"] in mine.members and theirs["posted"].get(mine.name, 0) <= self.note["ticket"]


def grace_for(timeout_s: float) -> float:
    """How long a check waits before it looks for a deadlock: short, but well inside the timeout."""
    return min(2.0, timeout_s / 4)
