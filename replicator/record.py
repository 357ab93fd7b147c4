"""The run record: the directory a run() leaves behind, with its metrics, configuration, summary and TensorBoard events.

Only the main process (rank 0, which runs steps in every mode) writes; see docs/how-to/run-records.md.
`replicator report` reads what this module writes.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import numbers
import os
import queue
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import torch
from torch.nn.parameter import is_lazy

from replicator import _env
from replicator._tree import named_leaves
from replicator.board import EventFile, tensorboard_installed
from replicator.errors import ReplicatorUsageError
from replicator.job import Job
from replicator.telemetry import PHASE_VALUES

__all__ = ["RunRecord", "job_config", "METRICS", "CONFIG", "SUMMARY", "BREAKDOWN_FIELDS"]

METRICS, CONFIG, SUMMARY = "metrics.jsonl", "config.json", "summary.json"
# The columns the record writes itself; a step_fn output of the same name is written as `output/<name>`.
COLUMNS = ("step", "time", "wall_time", "samples", "samples_per_second", "step_seconds")
# The figures of one phase of telemetry.Phase.values(), named for summary.json's `breakdown`.
BREAKDOWN_FIELDS = ("steps", "step_seconds", "compute_seconds", "communication_seconds", "input_seconds")
# Seconds between hand-overs of host scalars' TensorBoard events to the writer thread, which writes and flushes each
# batch (a crashed run keeps its curves up to about then): waking it every step cost more than the step's line.
BOARD_HANDOFF_S = 0.5


@dataclass
class _Step:
    """One step's line of metrics.jsonl, its scalars still tensors until they are written."""

    step: int
    time: float
    wall_time: float
    samples: int
    interval: float
    seconds: float
    scalars: list[tuple[str, Any]] = field(default_factory=list)


def check_request(record: object, name: object) -> None:
    """Raise on a `run(record=..., name=...)` that cannot be honoured; the same on every process."""
    if not isinstance(record, (bool, str, os.PathLike)):
        raise ReplicatorUsageError(
            f"run(record={record!r}) must be True (a new directory under REPLICATOR_RUNS, default runs/), "
            "False (no record) or the path of the run's directory")
    if name is not None and (not isinstance(name, str) or not name.strip() or re.search(r"[/\\]", name)):
        raise ReplicatorUsageError(
            f"run(name={name!r}) must be a non-empty string without path separators: it names the run's directory "
            "under runs/ (give record=PATH to choose the whole path)")


def default_name() -> str:
    """The script's stem (`train` for `python train.py`, the package for `python -m package`), else "run"."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    if script is None:
        return "run"  # an interactive session or `python -c`
    stem = script.parent.name if script.stem == "__main__" else script.stem
    return stem or "run"


def _claim(root: Path, name: str) -> Path:
    """A new directory `root/<time>-<name>`, with `-2`, `-3`... when another run took that second."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}"
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        candidate = root / (base if attempt == 1 else f"{base}-{attempt}")
        try:
            candidate.mkdir()  # atomic: two runs never share a directory
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"{root / base}: a thousand runs this second")


def _jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: numbers, strings, lists and dicts; anything else as its repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, numbers.Number):
        return _jsonable(float(value))  # type: ignore[arg-type]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _jsonable(value.item())
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (Path, torch.device, torch.dtype)):
        return str(value)
    return repr(value)


@functools.cache  # read once: importlib.metadata parses the package's metadata file every time (~2 ms)
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def job_config(arguments: dict[str, Any], job: Job, reducer: object, modules: list[torch.nn.Module]) -> dict[str, Any]:
    """config.json: the Replicator's arguments as given, the job's shape, the model's size, the software."""
    topology, mesh = job.topology, job.mesh
    parameters = {id(p): p for module in modules for p in module.parameters()}  # shared ones once
    return _jsonable({
        "arguments": arguments,
        "topology": {
            "world_size": topology.world_size, "replicas": mesh.num_replicas, "stages": mesh.stages,
            "nodes": topology.num_nodes, "processes_per_node": topology.local_world_size,
            "mode": getattr(arguments.get("mode", "sync"), "name", arguments.get("mode", "sync")),  # or its config's
            "servers": mesh.serving, "serving_role": mesh.role_names[1], "backend": topology.backend,
            "device": topology.device.type, "launcher": topology.launcher,
        },
        "reducer": getattr(reducer, "name", type(reducer).__name__),
        "bucket_cap_mb": arguments.get("bucket_cap_mb"),
        # Threads per process (the main process's; the launcher gives every replica the same): a 1-replica
        # baseline with more threads than each replica had is not a fair one (`replicator report` says so).
        "threads": {"per_process": torch.get_num_threads(), "launcher": _env.threads(), "cpus": os.cpu_count()},
        "model": {
            # Of the modules this process trains: with pipeline stages, stage 0's share of the model.
            "of": "the whole model" if mesh.stages == 1 else "stage 0 (this process's stage)",
            # A lazy module's parameters have no size before its first forward: left out (and counted as lazy).
            "parameters": sum(p.numel() for p in parameters.values() if not is_lazy(p)),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in parameters.values() if not is_lazy(p)),
            "lazy_parameters": sum(is_lazy(p) for p in parameters.values()),
            "modules": [type(module).__name__ for module in modules],
        },
        "versions": {"replicator": _version("replicator"), "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "command": [sys.executable, *sys.argv],
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    })


def _scalars(output: Any) -> list[tuple[str, Any]]:
    """The scalars of a step_fn output, named: a number or one-element tensor is `loss`; a dict's leaves go by
    their keys (`metrics/accuracy`); a tuple's or list's first element is `loss`, the others `output/<i>`."""
    if isinstance(output, (torch.Tensor, numbers.Number)):
        leaves: list[tuple[str, Any]] = [("loss", output)]
    else:
        positional = isinstance(output, (tuple, list)) and not hasattr(output, "_fields")
        leaves = [(("loss" if name == "0" else f"output/{name}") if positional else name, leaf)
                  for name, leaf in named_leaves(output)]
    scalars: list[tuple[str, Any]] = []
    for name, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.numel() == 1 and not leaf.is_complex():
            scalars.append((f"output/{name}" if name in COLUMNS else name, leaf.detach()))
        elif isinstance(leaf, numbers.Real):
            scalars.append((f"output/{name}" if name in COLUMNS else name, leaf))
    return scalars


def _number(value: Any) -> float | int | None:
    """A scalar as JSON writes it: int for integers and booleans, float otherwise, None for NaN and infinities."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, (bool, int)):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


def _final_step_in(path: Path) -> int | None:
    """The step of the last complete line of a metrics.jsonl (read from its end), or None."""
    with open(path, "rb") as file:
        file.seek(0, os.SEEK_END)
        file.seek(max(0, file.tell() - 4096))
        for line in reversed(file.read().splitlines()):
            with contextlib.suppress(ValueError, KeyError, TypeError):  # a torn line, the crash's
                return int(json.loads(line)["step"])
    return None


def _drop_steps_from(path: Path, first: int) -> None:
    """Rewrite a metrics.jsonl without its lines of step `first` and after (and without a torn last line)."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if int(json.loads(line)["step"]) < first:
                kept.append(line + "\n")
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text("".join(kept), encoding="utf-8")
    os.replace(partial, path)  # a reader never sees half a file


def breakdown(per_replica: list[list[float]]) -> list[dict[str, Any]]:
    """repl.last_run's per_replica rows (steady phase, then warm-up) as named figures per replica."""
    named = []
    for replica, row in enumerate(per_replica):
        entry: dict[str, Any] = {"replica": replica, **dict(zip(BREAKDOWN_FIELDS, row[:PHASE_VALUES]))}
        if len(row) > PHASE_VALUES:
            entry["warmup"] = dict(zip(BREAKDOWN_FIELDS, row[PHASE_VALUES:2 * PHASE_VALUES]))
        named.append(entry)
    return named


class RunRecord:
    """One run()'s record, as an observer of the step loop (replicator.loop.Observer).

    On the main process it writes `config.json` when the run starts, a line of `metrics.jsonl` per step,
    flushed as it goes (and TensorBoard scalars, flushed in batches), and `summary.json` when the run ends: by
    `finish()` with repl.last_run, or, when the loop was left by an error or a `break`, with what the
    record itself measured. Elsewhere, or when recording is off, it does nothing and `directory` is None.
    """

    def __init__(self, directory: Path | None = None, config: dict[str, Any] | None = None) -> None:
        self.directory = directory
        self.config = config or {}
        self.tensorboard = False
        self._metrics: IO[str] | None = None
        self._board: EventFile | None = None  # made at the first step (it may drop steps first)
        self._board_flushed = 0.0  # when the writer thread last flushed it
        # A step whose scalars are on the host has its line written at once (a few µs); its TensorBoard events
        # go to a thread of their own in batches, so their encoding stays off the step. Once a scalar is on a
        # device, every line goes through that thread too (in order): reading a loss from a GPU there never
        # makes the training thread wait for the device.
        self._queue: queue.SimpleQueue[_Step | list[_Step] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._board_steps: list[_Step] = []  # host steps whose TensorBoard events are not handed over yet
        self._handed = 0.0  # when they last were
        self._through_writer = False  # a scalar was on a device: lines go through the writer thread
        self._started = self._last_end = time.perf_counter()
        self._clock_started = False
        self._steps = self._samples = 0
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._first_written: int | None = None  # the step of the run's first line in metrics.jsonl
        if directory is not None:
            self._write_json(CONFIG, self.config)
            self._metrics = open(directory / METRICS, "a", encoding="utf-8")  # appends when a run resumes here
            self.tensorboard = tensorboard_installed()
            self._writer = threading.Thread(target=self._write_lines, name="replicator-run-record", daemon=True)
            self._writer.start()

    @classmethod
    def open(cls, record: bool | str | os.PathLike[str], name: str | None, job: Job, arguments: dict[str, Any],
             reducer: object, modules: list[torch.nn.Module]) -> RunRecord:
        """The record of a run that starts now: in `runs/<time>-<name>` for record=True (REPLICATOR_RUNS
        chooses the root, or turns recording off), in `record` itself for a path (appending to a record
        already there), none for False. A directory that cannot be written is warned about, not raised:
        the training goes on without its record."""
        check_request(record, name)
        if job.topology.rank != 0 or record is False:
            return cls()
        root = _env.runs_root() if record is True else None
        if record is True and root is None:
            return cls()
        try:
            if record is True:
                assert root is not None
                directory = _claim(Path(root), name or default_name())
            else:
                directory = Path(record)
                directory.mkdir(parents=True, exist_ok=True)
            config = {"name": name or default_name(), "directory": str(directory),
                      **job_config(arguments, job, reducer, modules)}
            return cls(directory, config)
        except OSError as error:
            print(f"replicator: cannot write the run record ({type(error).__name__}: {error}); training goes on "
                  "without one. Pass run(record=PATH) somewhere writable, set REPLICATOR_RUNS=ROOT, or "
                  "record=False", file=sys.stderr, flush=True)
            return cls()

    # As an observer of the step loop:
    def on_input_wait(self, seconds: float) -> None:
        if not self._clock_started:  # the loop's first batch: the run's clock starts there, after any restore
            self._started = self._last_end = time.perf_counter() - seconds
            self._clock_started = True

    def on_agreement_wait(self, seconds: float) -> None:
        pass

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        if self._metrics is None:
            return
        now = time.perf_counter()
        entry = _Step(step, now - self._started, time.time(), samples, now - self._last_end, seconds, _scalars(output))
        if not self._through_writer and all(not isinstance(value, torch.Tensor) or value.device.type == "cpu"
                                            for _, value in entry.scalars):
            self._write_step(entry, board=False)
            self._board_steps.append(entry)
            if now - self._handed >= BOARD_HANDOFF_S:
                self._hand_over_board(now)
        else:
            self._hand_over_board(now)
            self._through_writer = True
            self._queue.put(entry)
        self._last_end = now
        self._steps += 1
        self._samples += samples
        self._first_step = step if self._first_step is None else self._first_step
        self._last_step = step

    def on_run_end(self) -> None:
        """The loop ended: write what is pending and close; without a normal end, the summary too."""
        if self.directory is None:
            return
        if self._writer is not None:
            self._hand_over_board(time.perf_counter())
            self._queue.put(None)  # every line before it is written and flushed, then the files close
            self._writer.join()
        ending = sys.exc_info()[1]  # called from the loop's `finally`: the error leaving it, if any
        if isinstance(ending, GeneratorExit):
            self._summarize({"status": "stopped", "reason": "the loop over run() was left early (a break)"})
        elif ending is not None:
            self._summarize({"status": "failed", "error": f"{type(ending).__name__}: {ending}"})
        else:  # finish() replaces it with repl.last_run; kept if what follows the loop raises
            self._summarize({"status": "ended", "reason": "the loop ended; run() did not finish its summary"})

    def finish(self, figures: dict[str, Any]) -> dict[str, Any]:
        """repl.last_run: `figures` with `run_dir`; on the main process, also written to summary.json."""
        figures = {**figures, "run_dir": None if self.directory is None else str(self.directory)}
        if self.directory is not None:
            self._summarize({"status": "finished", **figures,
                             "breakdown": breakdown(figures.get("per_replica") or [])})
        return figures

    def _hand_over_board(self, now: float) -> None:
        """Give the writer thread the TensorBoard events of the host steps written since the last hand-over."""
        if self._board_steps:
            if self._board is not None:
                self._queue.put(self._board_steps)
            self._board_steps = []
        self._handed = now

    def _write_lines(self) -> None:
        """The writer thread: each step's line (or a batch of host steps' TensorBoard events) as it comes."""
        while (entry := self._queue.get()) is not None:
            if isinstance(entry, list):
                for step in entry:
                    self._write_board(step, {name: _number(value) for name, value in step.scalars})
            elif self._metrics is not None:
                self._write_step(entry)
            self._flush_board(every_s=0.0 if isinstance(entry, list) else BOARD_HANDOFF_S)
        self._close()

    def _flush_board(self, every_s: float) -> None:
        """Flush the TensorBoard events written so far, if `every_s` has passed since the last flush."""
        now = time.perf_counter()
        if self._board is None or now - self._board_flushed < every_s:
            return
        self._board_flushed = now
        try:
            self._board.flush()
        except OSError as error:
            self._board_failed(error)

    def _write_step(self, entry: _Step, board: bool = True) -> None:
        if self._first_written is None:  # on the thread that writes first: the training thread for host scalars
            self._begin_writing(entry.step)
        assert self._metrics is not None
        values = {name: _number(value) for name, value in entry.scalars}
        rate = entry.samples / entry.interval if entry.interval > 0 else None
        line = {"step": entry.step, "time": round(entry.time, 6), "wall_time": round(entry.wall_time, 6),
                "samples": entry.samples, "samples_per_second": rate, "step_seconds": round(entry.seconds, 6),
                **values}
        try:
            self._metrics.write(json.dumps(line) + "\n")
            self._metrics.flush()  # a crashed run keeps every line written so far
        except OSError as error:
            print(f"replicator: the run record stopped at step {entry.step} ({type(error).__name__}: {error})",
                  file=sys.stderr, flush=True)
            if board:  # the writer thread, which alone writes the files by now
                self._close()
            else:  # the training thread: the writer thread closes TensorBoard's file when the run ends
                self._metrics.close()
                self._metrics, self._board_steps = None, []
            return
        if board:
            self._write_board(entry, values)

    def _write_board(self, entry: _Step, values: dict[str, float | int | None]) -> None:
        """The step's scalars as one TensorBoard event."""
        if self._board is None:
            return
        rate = entry.samples / entry.interval if entry.interval > 0 else None
        named = [*values.items(), ("replicator/samples_per_second", rate)]
        try:
            self._board.add_scalars(entry.step, entry.wall_time, [(n, v) for n, v in named if v is not None])
        except OSError as error:
            self._board_failed(error)

    def _board_failed(self, error: OSError) -> None:
        assert self._board is not None
        print(f"replicator: the run record's TensorBoard events stopped at {self._board.path} "
              f"({type(error).__name__}: {error}); metrics.jsonl goes on", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            self._board.close()
        self._board = None

    def _begin_writing(self, first: int) -> None:
        """Before the run's first line: drop the lines of steps from `first` on, which a run that appends to an
        earlier record (a restart from an earlier checkpoint) trains again; TensorBoard hides its events too."""
        assert self.directory is not None and self._metrics is not None
        self._first_written = first
        path = self.directory / METRICS
        purge = None
        try:
            if (last := _final_step_in(path)) is not None and last >= first:
                self._metrics.close()
                _drop_steps_from(path, first)
                self._metrics = open(path, "a", encoding="utf-8")
                purge = first
        except OSError as error:  # the lines stay; the run goes on recording
            print(f"replicator: cannot drop the steps from {first} on from {path} ({type(error).__name__}: {error})",
                  file=sys.stderr, flush=True)
            if self._metrics.closed:
                self._metrics = open(path, "a", encoding="utf-8")
        if self.tensorboard:
            try:
                self._board = EventFile(self.directory, purge_step=purge)
            except OSError as error:
                print(f"replicator: cannot write the run record's TensorBoard events in {self.directory} "
                      f"({type(error).__name__}: {error}); metrics.jsonl goes on", file=sys.stderr, flush=True)

    def _close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._board is not None:
            try:
                self._board.close()  # its last batch is flushed here
            except OSError as error:
                self._board_failed(error)
            self._board = None

    def _summarize(self, outcome: dict[str, Any]) -> None:
        elapsed = self._last_end - self._started
        measured = {"steps": self._steps, "first_step": self._first_step, "last_step": self._last_step,
                    "samples": self._samples, "seconds": elapsed,
                    "samples_per_second": self._samples / elapsed if elapsed > 0 else None,
                    "tensorboard": self.tensorboard}
        self._write_json(SUMMARY, {**outcome, "record": measured,
                                   "ended": datetime.datetime.now().astimezone().isoformat(timespec="seconds")})

    def _write_json(self, name: str, content: dict[str, Any]) -> None:
        assert self.directory is not None
        partial = self.directory / f".{name}.partial"
        try:
            partial.write_text(json.dumps(_jsonable(content), indent=1) + "\n", encoding="utf-8")
            os.replace(partial, self.directory / name)  # a reader never sees half a file
        except OSError as error:
            print(f"replicator: cannot write {self.directory / name} ({type(error).__name__}: {error})",
                  file=sys.stderr, flush=True)
