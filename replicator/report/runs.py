"""One run record read back from its directory (what replicator.record wrote), checked as it is read."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replicator.record import BREAKDOWN_FIELDS, CONFIG, METRICS, SUMMARY, breakdown

__all__ = ["Run", "ReportError", "load_run"]


class ReportError(ValueError):
    """A path that `replicator report` cannot read as a finished run record; the message names it and the fix."""


@dataclass
class Run:
    """A run record: its configuration, its metrics (one dict per step, in step order) and its summary."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def topology(self) -> dict[str, Any]:
        return self.config.get("topology", {})

    @property
    def replicas(self) -> int:
        return int(self.topology.get("replicas", 1))

    @property
    def mode(self) -> str:
        return str(self.topology.get("mode", "sync"))

    @property
    def threads(self) -> int | None:
        """Torch threads per process (config.json's `threads`); None in records from before they were kept."""
        value = self.config.get("threads", {}).get("per_process")
        return None if value is None else int(value)

    @property
    def script(self) -> str:
        """The script and its arguments as the run's command gave them (for a command to print)."""
        command = [str(part) for part in self.config.get("command", [])[1:]]
        return " ".join(command) if command else "train.py"

    @property
    def status(self) -> str:
        return str(self.summary.get("status", "finished"))

    @property
    def throughput(self) -> float | None:
        """Samples per second of the whole job after the warm-up steps (the record's own figure when the
        run did not finish: then over all its steps)."""
        rate = self.summary.get("samples_per_second")
        if rate is None:
            rate = self.summary.get("record", {}).get("samples_per_second")
        return None if rate is None else float(rate)

    @property
    def samples_per_replica(self) -> float | None:
        """The median samples of a step on one replica (its per-replica batch)."""
        samples = [line["samples"] for line in self.metrics if line.get("samples")]
        return statistics.median(samples) / self.replicas if samples else None

    @property
    def breakdown(self) -> list[dict[str, Any]]:
        """Per replica: steps and seconds of the steady steps (BREAKDOWN_FIELDS), with `warmup` apart."""
        return self.summary.get("breakdown") or breakdown(self.summary.get("per_replica") or [])

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one column of metrics.jsonl, skipping steps where it is missing or not finite."""
        pairs = [(line["step"], float(line[key])) for line in self.metrics if line.get(key) is not None]
        return [step for step, _ in pairs], [value for _, value in pairs]

    def scalar_names(self) -> list[str]:
        """The step_fn outputs that metrics.jsonl holds, `loss` first."""
        from replicator.record import COLUMNS

        names = {key for line in self.metrics for key in line if key not in COLUMNS}
        return sorted(names, key=lambda name: (name != "loss", name))


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ReportError(f"{path}: cannot read its {what} ({type(error).__name__}: {error})") from None
    if not isinstance(content, dict):
        raise ReportError(f"{path}: its {what} is not a JSON object")
    return content


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            step = int(line["step"])
        except (ValueError, KeyError, TypeError):
            if number == len(lines):
                break  # the last line of a process that died while writing it
            raise ReportError(f"{path}:{number}: not a line of metrics (JSON with a 'step'): {text[:80]!r}") from None
        by_step[step] = line  # a step done again after a resume: its latest values
    return [by_step[step] for step in sorted(by_step)]


def load_run(path: str | Path) -> Run:
    """The run record in directory `path`; ReportError when it is not one, holds no steps, or has not ended."""
    directory = Path(path)
    if not directory.is_dir():
        what = "is a file, not a run directory" if directory.exists() else "no such directory"
        raise ReportError(f"{directory}: {what}; pass the run directories that repl.run() wrote "
                          "(runs/<time>-<name>, given as repl.last_run['run_dir'])")
    if not (directory / METRICS).is_file() or not (directory / CONFIG).is_file():
        raise ReportError(f"{directory} is not a run record (it has no {METRICS} and {CONFIG}); pass a directory "
                          "that repl.run() wrote, such as runs/<time>-<name>")
    metrics = _read_metrics(directory / METRICS)
    if not metrics:
        raise ReportError(f"{directory / METRICS} holds no steps: the run ended (or is still starting) before its "
                          "first step finished")
    if not (directory / SUMMARY).is_file():
        raise ReportError(f"{directory}: the run is still in progress, or its process was killed ({SUMMARY} is "
                          f"written when run() ends); report it when it has ended. {len(metrics)} step(s) recorded "
                          f"so far in {METRICS}")
    run = Run(directory, _read_json(directory / CONFIG, CONFIG), _read_json(directory / SUMMARY, SUMMARY), metrics)
    for entry in run.breakdown:
        missing = [name for name in BREAKDOWN_FIELDS if name not in entry]
        if missing:
            raise ReportError(f"{directory / SUMMARY}: its step-time breakdown lacks {missing}")
    return run
