"""Step timing, the live progress on replica 0 (a bar, or lines off a terminal) and the end-of-run breakdown table."""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from replicator import _env
from replicator.comm.agreement import Agreement

__all__ = ["Phase", "StepTimes", "Progress", "breakdown_table", "scalar_of", "summarize_run", "peak_memory"]


@dataclass
class Phase:
    """Seconds spent over some steps of a run, split by where the time went."""

    steps: int = 0
    step_seconds: float = 0.0  # inside step_fn, collectives included
    communication_seconds: float = 0.0  # blocked on collectives: exposed, not overlapped
    input_seconds: float = 0.0  # waiting for the next batch

    @property
    def compute_seconds(self) -> float:
        return max(0.0, self.step_seconds - self.communication_seconds)

    def values(self) -> list[float]:
        return [self.steps, self.step_seconds, self.compute_seconds, self.communication_seconds, self.input_seconds]


PHASE_VALUES = 5  # len(Phase().values())


@dataclass
class StepTimes:
    """Seconds accumulated over a run: the first `warmup_steps` steps (start-up, compilation, allocator
    warm-up) apart from the steady steps after them, so neither distorts the other."""

    warmup_steps: int = 0
    warmup: Phase = field(default_factory=Phase)
    steady: Phase = field(default_factory=Phase)
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)
    steady_started: float | None = None
    steady_samples: int = 0
    # Waits since the last step ended, charged to the step that ends next.
    _communication: float = 0.0
    _input: float = 0.0
    _after_step: float = 0.0  # communication after step_fn that belongs to its step (DiLoCo's outer step)

    @property
    def steps(self) -> int:
        return self.warmup.steps + self.steady.steps

    def add_communication(self, seconds: float) -> None:
        self._communication += seconds

    def add_after_step(self, seconds: float) -> None:
        """Communication between step_fn and the step's end (an observer's): the step's time too."""
        self._communication += seconds
        self._after_step += seconds

    def finish_step(self, samples: int, seconds: float = 0.0) -> None:
        phase = self.warmup if self.steps < self.warmup_steps else self.steady
        phase.steps += 1
        phase.step_seconds += seconds + self._after_step
        phase.communication_seconds += self._communication
        phase.input_seconds += self._input
        self._communication = self._input = self._after_step = 0.0
        self.samples += samples
        if self.steps == self.warmup_steps:
            self.steady_started = time.perf_counter()
        elif self.steps > self.warmup_steps:
            self.steady_samples += samples

    def steady_samples_per_second(self) -> float:
        """Samples per second after the warm-up steps (this replica)."""
        if self.steady_started is None or self.steady_samples == 0:
            elapsed = time.perf_counter() - self.started
            return self.samples / elapsed if elapsed > 0 else 0.0
        return self.steady_samples / (time.perf_counter() - self.steady_started)

    def as_values(self) -> list[float]:
        """The steady phase's figures, then the warm-up's (Phase.values each): what replicas exchange."""
        return self.steady.values() + self.warmup.values()

    # As an observer of the step loop:
    def on_input_wait(self, seconds: float) -> None:
        self._input += seconds

    def on_agreement_wait(self, seconds: float) -> None:
        self.add_communication(seconds)

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        self.finish_step(samples, seconds)

    def on_run_end(self) -> None:
        pass


def scalar_of(output: Any) -> float | None:
    """The number to show as 'loss': a scalar output, or the 'loss' entry of a dict."""
    if isinstance(output, dict):
        output = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        output = output[0]
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return float(output.detach().float().item())
    if isinstance(output, (int, float)):
        return float(output)
    return None


class Progress:
    """Replica 0's view of a run: a rich progress bar (step, loss, samples/s, ETA) redrawn at most twice a
    second on a terminal; elsewhere (Slurm, nohup, CI, `| tee`) a plain line at the first and last step and
    every `every` = (steps, seconds) between (default: REPLICATOR_PROGRESS_EVERY, or every 30 s)."""

    REDRAW_S = 0.5

    def __init__(self, total: int | None, enabled: bool, description: str = "training",
                 every: tuple[int | None, float | None] | None = None) -> None:
        self.enabled = enabled
        self.total = total
        self.description = description
        self._last_update = 0.0
        self._started = time.perf_counter()
        self._samples = 0
        self.lines = False
        self._unshown: tuple[int, Any] | None = None  # the latest step, until a line shows it
        self._first = True  # this run's first step (not step 1 when the training resumed) gets a line
        self._done_before = 0  # steps of the training before this run
        # Read on every replica, so that a bad value raises on all of them alike.
        cadence = every if every is not None else _env.progress_every()
        if not enabled:
            return
        from rich.console import Console

        console = Console()
        # A bar redrawn in place needs a terminal (or a notebook); a file or a pipe gets lines
        # (rich's own test, which TTY_INTERACTIVE=0 or 1 overrides).
        self.lines = not (console.is_interactive or console.is_jupyter)
        if self.lines:
            self._every_steps, self._every_seconds = cadence
            self._last_update = self._started
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            TimeRemainingColumn(),
            console=console,
            # No refresh thread: on a machine whose cores all train, its redraws would be taken
            # from a replica's core. update() redraws at most every REDRAW_S, between steps.
            auto_refresh=False,
        )
        self._task = self._bar.add_task(description, total=total, loss="-", rate="-")
        self._bar.start()

    def update(self, step: int, samples: int, output: Any) -> None:
        self._samples += samples
        if not self.enabled:
            return
        if self.lines:
            self._line(step, output)
            return
        now = time.perf_counter()
        if now - self._last_update < self.REDRAW_S:
            self._bar.update(self._task, completed=step)
            return
        self._last_update = now
        loss = scalar_of(output)
        rate = self._samples / max(now - self._started, 1e-9)
        self._bar.update(
            self._task,
            completed=step,
            loss="-" if loss is None or math.isnan(loss) else f"{loss:.4f}",
            rate=f"{rate:,.0f}",
        )
        self._bar.refresh()

    def _line(self, step: int, output: Any, last: bool = False) -> None:
        """Print a progress line if this step is due one: the run's first, the last, or `every` after the previous."""
        now = time.perf_counter()
        if self._first:
            self._done_before = step - 1
        self._unshown = (step, output)
        due = (last or self._first or step == self.total
               or (self._every_steps is not None and step % self._every_steps == 0)
               or (self._every_seconds is not None and now - self._last_update >= self._every_seconds))
        if not due:
            return
        self._last_update, self._unshown, self._first = now, None, False
        elapsed = now - self._started
        loss = scalar_of(output)
        parts = [f"{self.description} step {step}" + (f"/{self.total}" if self.total else "")]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        parts.append(f"{self._samples / max(elapsed, 1e-9):,.0f} samples/s")
        if self.total and step < self.total:
            per_step = elapsed / (step - self._done_before)
            parts.append(f"ETA {datetime.timedelta(seconds=round(per_step * (self.total - step)))}")
        print(" | ".join(parts), flush=True)

    def close(self) -> None:
        if self.enabled and self.lines and self._unshown is not None:
            self._line(*self._unshown, last=True)  # where the run ended, when no line said so yet
        elif self.enabled and not self.lines:
            self._bar.stop()

    # As an observer of the step loop:
    def on_input_wait(self, seconds: float) -> None:
        pass

    def on_agreement_wait(self, seconds: float) -> None:
        pass

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        self.update(step + 1, samples, output)

    def on_run_end(self) -> None:
        self.close()


def breakdown_table(per_replica: list[list[float]]) -> Any:
    """A rich Table of milliseconds per step by replica: compute, exposed communication ("comm"), input wait.

    Each row is a replica's `StepTimes.as_values()`: the steady steps fill the columns and the
    warm-up steps get a column of their own (a run of warm-up steps only shows those instead).
    """
    from rich.table import Table

    steady_steps = sum(int(row[0]) for row in per_replica)
    warmup_steps = max((int(row[PHASE_VALUES]) for row in per_replica if len(row) > PHASE_VALUES), default=0)
    main = 0 if steady_steps or not warmup_steps else PHASE_VALUES
    if main:
        title = f"step-time breakdown (ms per step; all {warmup_steps} steps were warm-up)"
    elif warmup_steps:
        title = f"step-time breakdown (ms per step, after {warmup_steps} warm-up step{'s' * (warmup_steps != 1)})"
    else:
        title = "step-time breakdown (ms per step)"
    table = Table(title=title)
    columns = ["replica", "steps", "step", "compute", "comm", "input wait", "comm share"]
    if warmup_steps and not main:
        columns.append("warm-up")
    for column in columns:
        table.add_column(column, justify="right")
    for replica, row in enumerate(per_replica):
        steps, step_s, compute_s, comm_s, input_s = row[main:main + PHASE_VALUES]
        n = max(int(steps), 1)
        share = comm_s / (step_s + input_s) if step_s + input_s > 0 else 0.0
        cells = [str(replica), str(int(steps)), f"{1e3 * step_s / n:.2f}", f"{1e3 * compute_s / n:.2f}",
                 f"{1e3 * comm_s / n:.2f}", f"{1e3 * input_s / n:.2f}", f"{100 * share:.1f}%"]
        if warmup_steps and not main:
            warm_steps, warm_s = row[PHASE_VALUES], row[PHASE_VALUES + 1]
            cells.append(f"{1e3 * warm_s / max(int(warm_steps), 1):.2f}")
        table.add_row(*cells)
    return table


def peak_memory() -> list[float]:
    """This process's peak memory so far: [resident set bytes (ru_maxrss), CUDA bytes allocated at most or -1]."""
    import resource
    import sys

    # ru_maxrss counts KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else -1
    return [float(rss), float(cuda)]


def _named_peaks(rows: list[list[float]]) -> list[dict[str, Any]]:
    """Each replica's peak_memory() as summary.json's `peak_memory` entries (no CUDA figure off CUDA)."""
    return [{"replica": replica, "max_rss_bytes": int(rss), "cuda_max_allocated_bytes": None if cuda < 0 else int(cuda)}
            for replica, (rss, cuda) in enumerate(rows)]


def summarize_run(agreement: Agreement, times: StepTimes, steps: int, ended_early: list[int],
                  show: bool) -> dict[str, Any]:
    """Gather every replica's step times; print the breakdown table where `show`; return the run's figures.

    `per_replica` holds each replica's `StepTimes.as_values()` (steady steps, then warm-up);
    `communication_share` is over the steady steps (over the warm-up when there were no others); `peak_memory` is
    each replica's peak resident memory (and CUDA allocation) by the end of the run.
    """
    # The peak memory rides on the same message as the step times: no collective of its own.
    row = times.as_values()
    summary = agreement.exchange("run summary", "", row + peak_memory())
    per_replica = [[float(v) for v in intent.values[:len(row)]] for intent in summary]
    peaks = [[float(v) for v in intent.values[len(row):]] for intent in summary]
    main = 0 if any(row[0] for row in per_replica) else PHASE_VALUES
    total_step = sum(r[main + 1] for r in per_replica)
    total_comm = sum(r[main + 3] for r in per_replica)
    total_input = sum(r[main + 4] for r in per_replica)
    if show and steps:
        from rich.console import Console

        Console().print(breakdown_table(per_replica))
    return {
        "steps": steps,
        "warmup_steps": times.warmup.steps,
        "samples_per_second": times.steady_samples_per_second(),
        "communication_share": float(total_comm / max(total_step + total_input, 1e-12)),
        "per_replica": per_replica,
        "peak_memory": _named_peaks(peaks),
        "ended_early": ended_early,
    }
