"""Heartbeats: a replica that waits long for its peers names the ones that are not coming, and why (internal).

A collective waits for every peer up to REPLICATOR_TIMEOUT (300 s by default) before it fails:
long enough for a slow step, too long to learn that a peer is stuck. So every process runs a
daemon thread that, every quarter of the heartbeat interval (REPLICATOR_HEARTBEAT, 30 s by
default), leaves a note in the job's store: a beat count, the time, the line of user code its
main thread is at, and what it waits for, if it waits for its peers. A process whose main
thread has waited for its peers for a whole interval reads the others' notes once and prints
who it waits for: a peer whose beats stopped (stopped by SIGSTOP or a debugger, or frozen in
native code that holds Python's lock), or a peer that is alive but not waiting, with the line
it has been running and for how long (an endless loop, a deadlock of its own, a step that long).
The wait itself goes on: only REPLICATOR_TIMEOUT ends it.

The main thread pays only for marking its waits (`waiting`), a dictionary entry set and
removed; the notes are written and read by the heartbeat thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

from replicator.comm.store import RankRecords, job_store

__all__ = ["Heartbeat", "waiting"]

_KEY = "replicator/heartbeat/"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # replicator/, not comm/
_LIBRARY_DIRS = (_PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.__file__))
_BEATS_PER_INTERVAL = 4
_SILENT_AFTER_BEATS = 3  # beats a peer may miss before it counts as silent: a beat's lateness is not silence

# Thread id -> what it waits for its peers at (anything whose str() says so, made only if reported), and since when.
_waits: dict[int, tuple[object, float]] = {}


class waiting:  # noqa: N801 - used as a `with` statement, like a function
    """`with waiting(what):` marks this thread as waiting for its peers at `what`, whose str() names it (a class:
    the cheapest context manager, as it wraps every agreement check; `what` is formatted only if reported)."""

    __slots__ = ("what", "_thread", "_outer")

    def __init__(self, what: object) -> None:
        self.what = what

    def __enter__(self) -> None:
        self._thread = threading.get_ident()
        self._outer = _waits.get(self._thread)
        if self._outer is None:  # an outer wait (the bucket wait around a check's) keeps its name and start
            _waits[self._thread] = (self.what, time.monotonic())

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._outer is None:
            _waits.pop(self._thread, None)


def user_line(frame: FrameType | None) -> str:
    """'file.py:42 in step_fn' for the innermost frame outside replicator, torch and the standard library."""
    while frame is not None and frame.f_code.co_filename.startswith((*_LIBRARY_DIRS, "<frozen")):
        frame = frame.f_back
    if frame is None:
        return "replicator's or torch's own code"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class Heartbeat:
    """This process's heartbeat thread; `names[rank]` is how a process is called in messages ("replica 1")."""

    def __init__(self, rank: int, names: list[str], interval_s: float, timeout_s: float,
                 say: Callable[[str], None] | None = None) -> None:
        self.rank, self.names, self.interval_s, self.timeout_s = rank, names, interval_s, timeout_s
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._main = threading.get_ident()  # the thread that runs the user's code
        self._stop = threading.Event()
        self._beats = 0
        self._line, self._line_since = "", time.monotonic()
        self._reported: float | None = None  # the start of the latest wait already reported
        self._thread = threading.Thread(target=self._run, name="replicator-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        # A first note before the job goes on, so that a peer stopped from its first step on is named as silent
        # rather than as not started.
        with contextlib.suppress(Exception):  # the thread's own loop says nothing of a store gone either
            self._beat(job_store())
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop beating, before the job's store goes; waits a moment at most (the thread may be inside a store
        call that a failed peer holds)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        try:
            store = job_store()
            while not self._stop.wait(self.interval_s / _BEATS_PER_INTERVAL):
                self._beat(store)
        except Exception:  # the store went with the job (its end, or a failure that says why itself)
            return

    def _beat(self, store: dist.Store) -> None:
        now = time.monotonic()
        line = user_line(sys._current_frames().get(self._main))
        if line != self._line:
            self._line, self._line_since = line, now
        wait = _waits.get(self._main)
        self._beats += 1
        note = {"beat": self._beats, "time": time.time(), "line": line, "line_for": now - self._line_since,
                "wait": str(wait[0]) if wait else "", "wait_for": now - wait[1] if wait else 0.0}
        notes = RankRecords(_KEY, store)
        notes.put(self.rank, note)
        if wait is not None and now - wait[1] >= self.interval_s and self._reported != wait[1]:
            self._reported = wait[1]
            self.say(self._describe(notes, note["wait"], now - wait[1]))

    def _describe(self, records: RankRecords, what: object, seconds: float) -> str:
        notes = records.present(rank for rank in range(len(self.names)) if rank != self.rank)
        silent_after = self.interval_s * _SILENT_AFTER_BEATS / _BEATS_PER_INTERVAL
        lines = [f"replicator: {self.names[self.rank]} has waited {seconds:.0f} s for its peers at {what}:"]
        waiting_too = []
        for rank, note in sorted(notes.items()):
            quiet = time.time() - float(note["time"])
            if quiet > silent_after:
                lines.append(f"  {self.names[rank]} has given no sign of life for {quiet:.0f} s: it is stopped "
                             f"(SIGSTOP, a debugger) or frozen in native code; it was last at {note['line']}")
            elif note["wait"]:
                waiting_too.append(f"{self.names[rank]} at {note['wait']}")
            else:
                lines.append(f"  {self.names[rank]} is alive but not waiting for its peers: it has been running "
                             f"{note['line']} for {float(note['line_for']):.0f} s")
        missing = [self.names[rank] for rank in range(len(self.names)) if rank != self.rank and rank not in notes]
        if missing:
            lines.append(f"  {', '.join(missing)}: no heartbeat yet (still starting, or stuck before the first beat)")
        if waiting_too:
            lines.append(f"  waiting as well: {'; '.join(waiting_too)}")
        lines.append(f"The wait goes on until REPLICATOR_TIMEOUT ({self.timeout_s:.0f} s) ends it. "
                     "REPLICATOR_HEARTBEAT sets how long a wait lasts before this is said (0: never).")
        return "\n".join(lines)
