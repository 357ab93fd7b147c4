"""Events between a test's processes and an injectable clock: a test waits for what happened, never for a duration."""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["SteppedClock", "announce", "count", "wait_for", "wait_for_count"]


def announce(path: str | Path) -> None:
    """Say that the event `path` names has happened (to every process that waits for it, now or later)."""
    Path(path).touch()


def wait_for(path: str | Path, limit_s: float = 120.0) -> None:
    """Return once the event `path` names has happened.

    The limit is a hang guard, not a verdict: a test that relies on the event fails on its own assertions if the
    event never comes, and the limit only keeps it from waiting forever.
    """
    deadline = time.monotonic() + limit_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never happened within {limit_s:.0f} s")
        time.sleep(0.02)


class SteppedClock:
    """A stand-in for the `time` module of a library module that only reads time.perf_counter: it moves when the
    test says (`advance`), plus a microsecond a reading so that no span is zero, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now


def count(directory: str | Path, pattern: str = "*") -> int:
    """How many events matching `pattern` have happened in `directory`."""
    return sum(1 for _ in Path(directory).glob(pattern))


def wait_for_count(directory: str | Path, pattern: str, at_least: int, limit_s: float = 120.0) -> int:
    """Return the count of events matching `pattern` once it reaches `at_least` (the limit: a hang guard only)."""
    deadline = time.monotonic() + limit_s
    while (seen := count(directory, pattern)) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {seen} of {at_least} events {pattern} in {directory} within {limit_s:.0f} s")
        time.sleep(0.02)
    return seen
