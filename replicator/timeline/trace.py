"""Chrome-trace JSON from spans (opens in ui.perfetto.dev and chrome://tracing): a track per process, lanes that nest.

Complete ("X") events on one thread must nest: a span that overlaps another without holding it
(two gradient buckets in flight) would be dropped or drawn wrongly. Each process's track is
therefore split into lanes, its threads in the trace: on the main track a span goes to the
first lane in which it nests (a step holds its forward and backward passes); on the others,
whose spans are peers (buckets in flight), to the first lane where it overlaps nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replicator.timeline.recorder import MAIN, Span

__all__ = ["ProcessSpans", "chrome_trace", "complete_event", "process_metadata", "thread_metadata", "lanes",
           "write_trace"]


@dataclass
class ProcessSpans:
    """One process's spans and who it is: `offset` is its clock minus the main process's clock (seconds)."""

    rank: int
    label: str
    spans: list[Span]
    offset: float = 0.0
    host: str = ""
    pid: int = 0
    dropped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def complete_event(name: str, category: str, start: float, end: float, pid: int, tid: int, origin: float,
                   args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One "X" event: `start`/`end` in seconds on the trace's clock, written in microseconds after `origin`."""
    # Nanoseconds are more than the clock resolves: rounding keeps the file small.
    event: dict[str, Any] = {"name": name, "cat": category, "ph": "X", "ts": round((start - origin) * 1e6, 3),
                             "dur": round(max(0.0, end - start) * 1e6, 3), "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def process_metadata(pid: int, name: str) -> list[dict[str, Any]]:
    """A process's name, and its place among the processes (by pid)."""
    return [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]


def thread_metadata(pid: int, tid: int, name: str) -> list[dict[str, Any]]:
    """A thread's name, and its place in its process (by tid)."""
    lane = {"ph": "M", "pid": pid, "tid": tid}
    return [{"name": "thread_name", **lane, "args": {"name": name}},
            {"name": "thread_sort_index", **lane, "args": {"sort_index": tid}}]


def lanes(spans: Iterable[Span], nest: bool = True) -> list[list[Span]]:
    """`spans` dealt into lanes in each of which any two spans are disjoint or (`nest`) one holds the other."""
    placed: list[list[Span]] = []
    open_ends: list[list[float]] = []  # per lane: the ends of the spans that hold the current point
    for item in sorted(spans, key=lambda s: (s.start, -s.end)):
        for lane, ends in enumerate(open_ends):
            while ends and ends[-1] <= item.start:
                ends.pop()
            if not ends or (nest and item.end <= ends[-1]):
                ends.append(item.end)
                placed[lane].append(item)
                break
        else:
            open_ends.append([item.end])
            placed.append([item])
    return placed


def _track_order(track: str) -> tuple[int, str]:
    return (0 if track == MAIN else 1, track)


def chrome_trace(processes: Sequence[ProcessSpans], other: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trace of `processes`: pid = rank + 1 (Perfetto takes pid 0 for the kernel's idle task), one thread
    per lane of each track, tid 1 the main one; times aligned by each `offset`."""
    origin = min((s.start - p.offset for p in processes for s in p.spans), default=0.0)
    events: list[dict[str, Any]] = []
    for process in sorted(processes, key=lambda p: p.rank):
        pid = process.rank + 1
        events += process_metadata(pid, process.label)
        tracks = sorted({s.track for s in process.spans} | {MAIN}, key=_track_order)
        tid = 1
        for track in tracks:
            for number, lane in enumerate(lanes((s for s in process.spans if s.track == track), nest=track == MAIN)):
                events += thread_metadata(pid, tid, track if number == 0 else f"{track} ({number + 1})")
                for s in lane:
                    events.append(complete_event(s.name, s.category, s.start - process.offset,
                                                 s.end - process.offset, pid, tid, origin, s.args))
                tid += 1
    processes_data = [{"rank": p.rank, "label": p.label, "host": p.host, "pid": p.pid, "spans": len(p.spans),
                       "dropped_spans": p.dropped, "clock_offset_us": p.offset * 1e6, **p.extra}
                      for p in sorted(processes, key=lambda p: p.rank)]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_s": origin, "processes": processes_data, **(other or {})}}


def write_trace(trace: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write `trace` as strict JSON (no NaN), atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "w", encoding="utf-8") as file:
        json.dump(trace, file, allow_nan=False, separators=(",", ":"))
    os.replace(partial, path)
    return path
