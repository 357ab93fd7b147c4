"""Spans on named tracks, recorded by this process while a run records its timeline (at most one at a time).

The library's rooms (the step loop, the synchronizer, pipeline stages, the asynchronous regimes)
call `span(...)` or `active()` where something worth seeing happens. With no recording under
way that costs one check of a module global: no hooks, no clock reads, nothing kept.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

__all__ = ["Span", "Recorder", "InFlight", "clock", "active", "span", "activate", "MAIN", "BUCKETS", "SERVICE",
           "DEFAULT_LIMIT"]

# Wall-clock seconds: the processes of one machine share this clock, and across machines the
# recording measures each process's offset once, at the start of the run.
clock: Callable[[], float] = time.time

MAIN = "main"  # the process's own thread of work: steps, passes, waits
BUCKETS = "gradient buckets"  # reductions in flight overlap each other and the backward pass
SERVICE = "service"  # a background thread's work (a learner's service)

# About 100 bytes a span: a long run keeps its first spans and counts the rest as dropped.
DEFAULT_LIMIT = 1_000_000


class Span(NamedTuple):
    """Something one process did from `start` to `end` (clock() seconds) on `track`; `args` say which.

    A named tuple: made several times per step while recording, it must be cheap to build."""

    name: str
    category: str
    start: float
    end: float
    track: str = MAIN
    args: dict[str, Any] | None = None


class Recorder:
    """The spans this process recorded, in the order they ended; at most `limit` of them."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.spans: list[Span] = []
        self.limit = limit
        self.dropped = 0

    def add(self, name: str, category: str, start: float, end: float, track: str = MAIN,
            args: dict[str, Any] | None = None) -> None:
        """Keep one span (list.append is atomic, so other threads may add too)."""
        if len(self.spans) >= self.limit:
            self.dropped += 1
            return
        self.spans.append(Span(name, category, start, end, track, args))

    def span(self, name: str, category: str, track: str = MAIN,
             args: dict[str, Any] | None = None) -> AbstractContextManager[None]:
        """Time the block as one span; it is kept when the block raises too."""
        return _Timed(self, name, category, track, args)


class _Timed:
    """A block timed into a recorder: a plain class, since a generator-based context manager costs several times
    more per block."""

    __slots__ = ("recorder", "name", "category", "track", "args", "start")

    def __init__(self, recorder: Recorder, name: str, category: str, track: str, args: dict[str, Any] | None) -> None:
        self.recorder, self.name, self.category, self.track, self.args = recorder, name, category, track, args

    def __enter__(self) -> None:
        self.start = clock()

    def __exit__(self, *exception: object) -> None:
        self.recorder.add(self.name, self.category, self.start, clock(), self.track, self.args)


_active: Recorder | None = None
_OFF: AbstractContextManager[None] = contextlib.nullcontext()


def active() -> Recorder | None:
    """The recorder of the run that records its timeline, or None (then record nothing)."""
    return _active


def activate(recorder: Recorder | None) -> Recorder | None:
    """Make `recorder` the active one (None: stop recording); returns the one it replaces."""
    global _active
    previous, _active = _active, recorder
    return previous


def span(name: str, category: str, track: str = MAIN, **args: Any) -> AbstractContextManager[None]:
    """Time the block as a span of the active recording; with none, a shared block that does nothing."""
    recorder = _active
    if recorder is None:
        return _OFF
    return recorder.span(name, category, track, args or None)


class InFlight:
    """A communication's span from its launch to its completion, which another thread may observe first.

    Completion is when torch.distributed's work says so (its future's callback), when a
    background reduction says it finished (`finished_at`), or else when `close()` is called
    after waiting for it: never later than the waiter saw it done.
    """

    def __init__(self, recorder: Recorder, name: str, category: str, start: float, work: object, track: str,
                 args: dict[str, Any] | None = None) -> None:
        self.recorder, self.name, self.category, self.track, self.args = recorder, name, category, track, args
        self.start = start
        self.completed: float | None = None
        get_future = getattr(work, "get_future", None)
        if get_future is not None:
            try:
                get_future().add_done_callback(self._complete)
            except RuntimeError:  # a backend whose work has no future: the waiter's time stands
                pass

    def _complete(self, _: object) -> None:
        self.completed = clock()

    def close(self, work: object) -> None:
        """`work` was waited for: record the span."""
        now = clock()
        finished = getattr(work, "finished_at", None)
        end = min(now, self.completed or now, finished or now)
        self.recorder.add(self.name, self.category, self.start, max(end, self.start), self.track, self.args)
