"""What run(timeline=...) hands off to: record this process's spans during the run, then merge every process's.

Every process of the job records, servers and actors included (their run() serves or acts
instead of stepping). At the end each hands its spans to the job's key-value store (the
launcher's rendezvous store, which every process reaches on every machine, and which no
collective ordering can deadlock); the main process takes them, aligns the clocks and writes
ONE Chrome trace. A process that fails writes its own spans beside the trace instead, and the
main process waits for nobody who failed or never started recording.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import socket
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from replicator import _env
from replicator.comm.store import job_store
from replicator.errors import ReplicatorUsageError
from replicator.timeline.hooks import ModelSpans
from replicator.timeline.recorder import Recorder, Span, activate, clock
from replicator.timeline.trace import ProcessSpans, chrome_trace, write_trace

if TYPE_CHECKING:
    from replicator.job import Job

__all__ = ["recorded", "timeline_path", "destination_of", "Session", "measure_clock_offset"]

TimelineArgument = bool | str | os.PathLike[str] | None
_PREFIX = "replicator/timeline/"
_OFFSET_ROUNDS = 5
# How long the main process waits for a process that never said it records (a script that
# passed timeline= on some processes only): long enough for a slow start, short for a mistake.
_UNANNOUNCED_GRACE_S = 10.0
_POLL_S = 0.02


class Recordable(Protocol):
    """What the session reads of the Replicator whose run() it records."""

    job: Job
    models: Any  # its `modules`: the top-level modules built in repl.scope()
    num_stages: int
    regime: Any
    last_run: dict[str, Any]
    record: Any  # the run record: its `directory` on the main process when the run is recorded, else None


def timeline_path(run_dir: Path | None = None) -> Path:
    """Where a timeline goes when none is named (timeline=True, REPLICATOR_TIMELINE=1): `run_dir` (default: the
    current directory) / timeline-<date>-<time>.json."""
    return (Path(".") if run_dir is None else Path(run_dir)) / f"timeline-{time.strftime('%Y%m%d-%H%M%S')}.json"


def destination_of(timeline: TimelineArgument) -> Path | None:
    """The file run(timeline=...) writes (None: REPLICATOR_TIMELINE decides), or None when it records nothing."""
    if timeline is None:
        timeline = _env.timeline()
    if timeline is False:
        return None
    if timeline is True:
        return timeline_path()
    if not isinstance(timeline, (str, os.PathLike)) or not os.fspath(timeline):
        raise ReplicatorUsageError(f"run(timeline=...) takes True, False or a file path (a directory: a file named "
                                   f"by the time in it), got {timeline!r}")
    path = Path(timeline)
    return timeline_path(path) if path.is_dir() else path


def process_label(repl: Recordable) -> str:
    """This process in the trace's words: 'rank 1: replica 1', 'rank 2: parameter server 0', 'actor 0 (rank 1)'."""
    roles = getattr(repl.regime, "roles", None)
    if roles is not None:
        return str(roles.describe())
    mesh, rank = repl.job.mesh, repl.job.topology.rank
    if mesh.serving:
        what = (f"parameter server {rank - mesh.num_stepping}" if mesh.serves
                else f"worker {mesh.replica_id} of sync group {mesh.group_id}")
    elif mesh.stages > 1:
        what = f"replica {mesh.replica_id}, stage {mesh.stage_id}"
    else:
        what = f"replica {mesh.replica_id}"
    return f"rank {rank}: {what}"


def measure_clock_offset(group: dist.ProcessGroup) -> float:
    """This process's clock minus the group's first process's, in seconds: the median over a few rounds of a
    barrier followed by an exchange of clock readings (every member calls it)."""
    differences = []
    for _ in range(_OFFSET_ROUNDS):
        dist.barrier(group=group)
        now = torch.tensor([clock()], dtype=torch.float64)
        readings = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(readings, now, group=group)
        differences.append(float(now) - float(readings[0]))
    return statistics.median(differences)


class Session:
    """One run()'s recording on this process: the active recorder, the model's hooks, and the hand-in at the end."""

    runs = 0  # recorded runs of this process: names this run's keys in the store

    def __init__(self, repl: Recordable, destination: Path) -> None:
        job = repl.job
        self.destination = destination
        self.rank, self.world_size, self.timeout_s = job.topology.rank, job.topology.world_size, job.timeout_s
        self.label = process_label(repl)
        self.host = socket.gethostname()
        Session.runs += 1
        self.prefix = f"{_PREFIX}attempt{_env.attempt()}/run{Session.runs}/"
        distributed = self.world_size > 1 and dist.is_initialized()
        self.store = job_store() if distributed else None
        if self.store is not None:
            self.store.set(f"{self.prefix}begun{self.rank}", "1")
        # One machine has one clock; across machines, align every process to the main one (a collective:
        # first make sure every process records, so that a script that records on some only fails clearly).
        group = job.groups.everyone or job.groups.control
        self.offset = 0.0
        if self.store is not None and job.mesh.num_nodes > 1 and group is not None:
            self._wait_for_everyone()
            self.offset = measure_clock_offset(group)
        self.recorder = Recorder()
        self._previous = activate(self.recorder)
        # A pipeline's stages record their own actions; hooks on its layers would only repeat them.
        self.hooks = ModelSpans(self.recorder, repl.models.modules) if repl.num_stages == 1 else None

    def _wait_for_everyone(self) -> None:
        assert self.store is not None
        keys = [f"{self.prefix}begun{rank}" for rank in range(self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                absent = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
                raise ReplicatorUsageError(
                    f"rank(s) {absent} did not start recording a timeline within REPLICATOR_TIMEOUT ({self.timeout_s:g}"
                    f" s; raised on rank {self.rank}): a job over several machines measures its clocks together, so "
                    "pass the same run(timeline=...) (or REPLICATOR_TIMELINE) on every process")
            time.sleep(_POLL_S)

    def _stop(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        activate(self._previous)

    def _into(self, run_dir: Path | None) -> None:
        if run_dir is not None:
            self.destination = Path(run_dir) / "timeline.json"

    def _mine(self) -> ProcessSpans:
        return ProcessSpans(self.rank, self.label, self.recorder.spans, self.offset, self.host, os.getpid(),
                            self.recorder.dropped, {"measured_clock_offset_us": self.offset * 1e6})

    def finish(self, run_dir: Path | None = None) -> Path:
        """The run ended: hand this process's spans in; the main process merges them (into `run_dir`/timeline.json
        when given). Returns where the trace is (on the other processes: where the main process writes it)."""
        self._into(run_dir)
        self._stop()
        if self.rank != 0:
            if self.store is not None:
                try:
                    self.store.set(f"{self.prefix}rank{self.rank}", _encode(self._mine()))
                except RuntimeError as error:  # the store left with the main process: it gave up on this one
                    print(f"replicator: rank {self.rank} could not hand its timeline in ({error})", file=sys.stderr,
                          flush=True)
            return self.destination.absolute()
        processes, missing = self._collect()
        other: dict[str, Any] = {"missing_ranks": missing} if missing else {}
        path = write_trace(chrome_trace([self._mine(), *processes], other), _unused(self.destination)).absolute()
        gone = f"; rank(s) {missing} sent none (they failed, or did not record)" if missing else ""
        print(f"replicator: timeline of {len(processes) + 1} process(es) written to {path}{gone}: open it in "
              "ui.perfetto.dev or chrome://tracing", flush=True)
        return path

    def abandon(self, run_dir: Path | None = None) -> None:
        """run() raised here: write this process's own spans beside the trace, and tell the main process not to
        wait for them."""
        self._into(run_dir)
        self._stop()
        if self.store is not None and self.rank != 0:
            try:
                self.store.set(f"{self.prefix}failed{self.rank}", "1")
            except RuntimeError:
                pass
        path = self.destination.with_name(f"{self.destination.stem}.rank{self.rank}{self.destination.suffix}")
        try:
            write_trace(chrome_trace([self._mine()], {"incomplete": "run() raised on this process"}), path)
        except OSError:
            return
        print(f"replicator: run() failed on rank {self.rank}; its timeline so far is in {path}", file=sys.stderr,
              flush=True)

    def _collect(self) -> tuple[list[ProcessSpans], list[int]]:
        """Every other process's spans, as they arrive in the store; then the ranks that sent none."""
        store = self.store
        if store is None:
            return [], []
        waiting, found = set(range(1, self.world_size)), []
        started = time.monotonic()
        while waiting:
            waited = time.monotonic() - started
            for rank in sorted(waiting):
                key = f"{self.prefix}rank{rank}"
                if store.check([key]):
                    found.append(_decode(rank, store.get(key), self.host))
                    store.delete_key(key)
                    waiting.discard(rank)
                elif store.check([f"{self.prefix}failed{rank}"]) or (
                        waited > _UNANNOUNCED_GRACE_S and not store.check([f"{self.prefix}begun{rank}"])):
                    waiting.discard(rank)
            if waited > self.timeout_s:
                break
            if waiting:
                time.sleep(_POLL_S)
        for rank in range(self.world_size):
            for mark in ("begun", "failed"):
                store.delete_key(f"{self.prefix}{mark}{rank}")
        return found, sorted(set(range(1, self.world_size)) - {p.rank for p in found})


def _unused(path: Path) -> Path:
    """`path`, or for a name made from the time (timeline=True twice in a second) the first free -N variant."""
    if not path.name.startswith("timeline-") or not path.exists():
        return path
    number = 2
    while (candidate := path.with_name(f"{path.stem}-{number}{path.suffix}")).exists():
        number += 1
    return candidate


def _encode(process: ProcessSpans) -> str:
    body = {"label": process.label, "host": process.host, "pid": process.pid, "offset": process.offset,
            "dropped": process.dropped, "extra": process.extra,
            "spans": [[s.name, s.category, s.start, s.end, s.track, s.args] for s in process.spans]}
    return base64.b64encode(zlib.compress(json.dumps(body, allow_nan=False).encode("utf-8"))).decode("ascii")


def _decode(rank: int, payload: bytes, main_host: str) -> ProcessSpans:
    """Another process's spans: JSON numbers and strings only, nothing that is unpickled."""
    body = json.loads(zlib.decompress(base64.b64decode(payload, validate=True)).decode("utf-8"))
    spans = [Span(str(name), str(category), float(start), float(end), str(track),
                  dict(args) if isinstance(args, dict) else None)
             for name, category, start, end, track, args in body["spans"]]
    host = str(body["host"])
    # On the main process's machine the clock is the main process's own: a measured offset there is only noise.
    offset = 0.0 if host == main_host else float(body["offset"])
    extra = {str(key): value for key, value in body["extra"].items() if isinstance(value, (int, float, str))}
    return ProcessSpans(rank, str(body["label"]), spans, offset, host, int(body["pid"]), int(body["dropped"]), extra)


_Run = TypeVar("_Run", bound=Callable[..., Iterator[Any]])


def recorded(run: _Run) -> _Run:
    """Replicator.run's decorator: its `timeline=` argument (else REPLICATOR_TIMELINE) records the run's timeline.

    Off, it costs one check per run() and installs nothing. On, the trace is written when run() ends
    (a `break` out of its loop included), and `repl.last_run["timeline"]` names the file.
    """

    @functools.wraps(run)
    def recording_run(repl: Recordable, *args: Any, timeline: TimelineArgument = None,
                      **kwargs: Any) -> Generator[Any, None, None]:
        destination = destination_of(timeline)
        if destination is None:
            yield from run(repl, *args, **kwargs)
            return
        session = Session(repl, destination)
        # Unnamed (True, REPLICATOR_TIMELINE=1), the trace joins the run's record as timeline.json; the record's
        # directory is known once run() has started.
        unnamed = (_env.timeline() if timeline is None else timeline) is True
        in_record = (lambda: repl.record.directory) if unnamed else None
        try:
            yield from run(repl, *args, **kwargs)
        except GeneratorExit:  # the caller left the loop early: the steps so far are the timeline
            session.finish(in_record and in_record())
            raise
        except BaseException:
            session.abandon(in_record and in_record())
            raise
        repl.last_run["timeline"] = str(session.finish(in_record and in_record()))

    return cast(_Run, recording_run)
