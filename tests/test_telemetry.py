"""The progress bar and the step-time breakdown: what replica 0 shows while and after training."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from replicator.telemetry import Progress, StepTimes, breakdown_table, scalar_of


def test_progress_bar_draws_from_the_training_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # A refresh thread would take its redraws from a core that a replica trains on.
    monkeypatch.setattr("sys.stdout", io.StringIO())
    before = {thread.ident for thread in threading.enumerate()}
    bar = Progress(total=3, enabled=True)
    for step in range(1, 4):
        bar.update(step, samples=8, output=torch.tensor(0.5))
    assert {thread.ident for thread in threading.enumerate()} == before
    task = bar._bar.tasks[0]
    assert task.completed == 3  # every step counted, though redrawn at most every REDRAW_S
    assert task.fields["loss"] == "0.5000"  # the first update redraws at once
    bar.close()


def test_disabled_progress_draws_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    bar = Progress(total=2, enabled=False)
    bar.update(1, samples=4, output=1.0)
    bar.close()
    assert capsys.readouterr().out == ""


def test_scalar_of_reads_losses_in_the_shapes_step_fn_returns() -> None:
    assert scalar_of(torch.tensor(2.5)) == 2.5
    assert scalar_of({"loss": torch.tensor([1.5]), "other": 3}) == 1.5
    assert scalar_of((4, "x")) == 4.0
    assert scalar_of(torch.ones(2)) is None  # not one number: nothing to show


def test_breakdown_table_has_a_row_per_replica() -> None:
    table = breakdown_table([[10, 1.0, 0.8, 0.1, 0.1], [10, 1.0, 0.7, 0.2, 0.1]])
    assert table.row_count == 2
    assert [column.header for column in table.columns][:3] == ["replica", "steps", "step"]


def test_step_times_leave_the_warm_up_out_of_the_steady_rate() -> None:
    times = StepTimes(warmup_steps=2)
    for _ in range(5):
        times.finish_step(samples=10)
    assert (times.steps, times.samples, times.steady_samples) == (5, 50, 30)
    times.step_seconds, times.communication_seconds = 1.0, 0.25
    assert times.compute_seconds == 0.75
    assert times.as_values()[:3] == [5, 1.0, 0.75]
