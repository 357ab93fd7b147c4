"""Step timing, the live progress bar on replica 0 and the end-of-run breakdown table."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from replicator.comm.agreement import Agreement

__all__ = ["StepTimes", "Progress", "breakdown_table", "scalar_of", "summarize_run"]


@dataclass
class StepTimes:
    """Seconds accumulated over a run, split by where the time went."""

    steps: int = 0
    samples: int = 0
    step_seconds: float = 0.0  # inside step_fn, collectives included
    communication_seconds: float = 0.0  # blocked on collectives: exposed, not overlapped
    input_seconds: float = 0.0  # waiting for the next batch
    started: float = field(default_factory=time.perf_counter)
    # Steps before this many are excluded from steady-state figures (warm-up, allocator).
    warmup_steps: int = 0
    steady_started: float | None = None
    steady_samples: int = 0

    def add_communication(self, seconds: float) -> None:
        self.communication_seconds += seconds

    def finish_step(self, samples: int) -> None:
        self.steps += 1
        self.samples += samples
        if self.steps == self.warmup_steps:
            self.steady_started = time.perf_counter()
        elif self.steps > self.warmup_steps:
            self.steady_samples += samples

    @property
    def compute_seconds(self) -> float:
        return max(0.0, self.step_seconds - self.communication_seconds)

    def steady_samples_per_second(self) -> float:
        """Samples per second after the warm-up steps (this replica)."""
        if self.steady_started is None or self.steady_samples == 0:
            elapsed = time.perf_counter() - self.started
            return self.samples / elapsed if elapsed > 0 else 0.0
        return self.steady_samples / (time.perf_counter() - self.steady_started)

    def as_values(self) -> list[float]:
        return [self.steps, self.step_seconds, self.compute_seconds, self.communication_seconds, self.input_seconds]

    # As an observer of the step loop:
    def on_input_wait(self, seconds: float) -> None:
        self.input_seconds += seconds

    def on_agreement_wait(self, seconds: float) -> None:
        self.add_communication(seconds)

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        self.step_seconds += seconds
        self.finish_step(samples)

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
    """A rich progress bar (step, loss, samples/s, ETA), redrawn twice a second."""

    REDRAW_S = 0.5

    def __init__(self, total: int | None, enabled: bool, description: str = "training") -> None:
        self.enabled = enabled
        self._last_update = 0.0
        self._started = time.perf_counter()
        self._samples = 0
        if not enabled:
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
            transient=not sys.stdout.isatty(),
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

    def close(self) -> None:
        if self.enabled:
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
    """A rich Table of milliseconds per step by replica: compute, exposed communication, input wait."""
    from rich.table import Table

    table = Table(title="step-time breakdown (ms per step)")
    for column in ("replica", "steps", "step", "compute", "communication", "input wait", "comm share"):
        table.add_column(column, justify="right")
    rows = []
    for replica, (steps, step_s, compute_s, comm_s, input_s) in enumerate(per_replica):
        n = max(int(steps), 1)
        rows.append((replica, int(steps), step_s / n, compute_s / n, comm_s / n, input_s / n))
    for replica, steps, step_ms, compute_ms, comm_ms, input_ms in rows:
        share = comm_ms / (step_ms + input_ms) if step_ms + input_ms > 0 else 0.0
        table.add_row(
            str(replica), str(steps), f"{1e3 * step_ms:.2f}", f"{1e3 * compute_ms:.2f}",
            f"{1e3 * comm_ms:.2f}", f"{1e3 * input_ms:.2f}", f"{100 * share:.1f}%",
        )
    return table


def summarize_run(agreement: Agreement, times: StepTimes, steps: int, ended_early: list[int],
                  show: bool) -> dict[str, Any]:
    """Gather every replica's step times; print the breakdown table where `show`; return the run's figures."""
    summary = agreement.exchange("run summary", "", times.as_values())
    per_replica = [[float(v) for v in intent.values] for intent in summary]
    total_step = sum(r[1] for r in per_replica)
    total_comm = sum(r[3] for r in per_replica)
    total_input = sum(r[4] for r in per_replica)
    if show and steps:
        from rich.console import Console

        Console().print(breakdown_table(per_replica))
    return {
        "steps": steps,
        "samples_per_second": times.steady_samples_per_second(),
        "communication_share": float(total_comm / max(total_step + total_input, 1e-12)),
        "per_replica": per_replica,
        "ended_early": ended_early,
    }
