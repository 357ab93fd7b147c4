"""The progress bar (or lines) and the step-time breakdown: what replica 0 shows while and after training."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import replicator as rp
from replicator.telemetry import PHASE_VALUES, Progress, StepTimes, breakdown_table, scalar_of
from replicator.testing import run_replicas

from _events import SteppedClock


def test_progress_bar_draws_from_the_training_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # A refresh thread would take its redraws from a core that a replica trains on.
    monkeypatch.setattr("sys.stdout", io.StringIO())
    monkeypatch.setenv("TTY_INTERACTIVE", "1")  # rich's switch: draw as on a terminal
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


def test_breakdown_table_has_a_row_per_replica_and_a_warm_up_column() -> None:
    steady, warmup = [10, 1.0, 0.8, 0.1, 0.1], [2, 3.0, 2.9, 0.1, 0.0]
    table = breakdown_table([steady + warmup, steady + warmup])
    assert table.row_count == 2
    assert [column.header for column in table.columns][:3] == ["replica", "steps", "step"]
    assert table.columns[-1].header == "warm-up" and list(table.columns[-1].cells) == ["1500.00"] * 2
    assert list(table.columns[2].cells) == ["100.00"] * 2  # 1.0 s over the 10 steady steps only
    assert "after 2 warm-up steps" in str(table.title)


def test_step_times_keep_the_warm_up_apart() -> None:
    times = StepTimes(warmup_steps=2)
    for _ in range(5):
        times.add_communication(0.25)
        times.on_input_wait(0.5)
        times.finish_step(samples=10, seconds=1.0)
    assert (times.steps, times.samples, times.steady_samples) == (5, 50, 30)
    assert times.warmup.values() == [2, 2.0, 1.5, 0.5, 1.0]
    assert times.steady.values() == [3, 3.0, 2.25, 0.75, 1.5]
    assert times.as_values() == times.steady.values() + times.warmup.values()


def slow_first_step() -> dict:
    # The step loop's clock, injected: the first step "takes" 10 s and the others nothing, on any machine and load.
    import replicator.loop

    clock = SteppedClock()
    replicator.loop.time = clock  # type: ignore[assignment]  # the loop reads only time.perf_counter
    repl = rp.Replicator()

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        if ctx.step == 0:
            clock.advance(10.0)  # start-up: compilation, first allocations, a loader's workers
        return ctx.all_mean(batch.sum())

    for _ in repl.run(step_fn, [torch.ones(2, 3)] * 4, warmup_steps=1):
        pass
    return repl.last_run


def test_the_breakdown_reports_warm_up_steps_apart_from_the_steady_ones() -> None:
    for run in run_replicas(slow_first_step, 2, timeout_s=90):
        assert run["warmup_steps"] == 1
        for row in run["per_replica"]:
            steady_steps, steady_seconds = row[0], row[1]
            warm_steps, warm_seconds = row[PHASE_VALUES], row[PHASE_VALUES + 1]
            assert (steady_steps, warm_steps) == (3, 1)
            assert warm_seconds >= 10.0
            # Averaged in, the slow first step alone would make every step cost 2.5 s; apart, each costs the
            # clock's few readings (a microsecond each).
            assert steady_seconds / steady_steps < 1e-3


PIPED = textwrap.dedent(
    """
    import torch
    import replicator as rp

    repl = rp.Replicator()
    for _ in repl.run(lambda ctx, batch: ctx.all_mean(batch.sum()), [torch.ones(2, 3)] * 5):
        pass
    for _ in repl.run(lambda ctx, batch: ctx.all_mean(batch.sum()), [torch.ones(2, 3)] * 5, steps=7):
        pass  # steps 6 and 7 of the training
    """
)


def test_progress_off_a_terminal_is_a_plain_line_every_n_steps(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(PIPED)
    command = [sys.executable, "-m", "replicator.cli", "launch", "-n", "2", "--threads", "1", str(script)]
    env = {"REPLICATOR_PROGRESS": "1", "REPLICATOR_PROGRESS_EVERY": "2", "REPLICATOR_DEVICE": "cpu",
           "PATH": "/usr/bin:/bin", "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)  # stdout is a pipe
    assert result.returncode == 0, result.stdout + result.stderr
    shown = [line.split(" | ")[0] for line in result.stdout.splitlines() if line.startswith("training step")]
    # Each run's first and last steps and every 2nd, from replica 0 only. Before: nothing until the end.
    assert shown == ["training step 1", "training step 2", "training step 4", "training step 5",
                     "training step 6/7", "training step 7/7"], result.stdout
    assert "loss 6.0000" in result.stdout and "samples/s" in result.stdout
    assert result.stdout.count("step-time breakdown") == 2, "one table per run() call"


def test_progress_cadence_is_read_as_steps_or_seconds(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TTY_INTERACTIVE", "0")
    monkeypatch.setenv("REPLICATOR_PROGRESS_EVERY", "1s")
    progress = Progress(total=100, enabled=True)
    assert progress.lines and (progress._every_steps, progress._every_seconds) == (None, 1.0)
    for step in range(1, 4):
        progress.update(step, samples=4, output=torch.tensor(0.5))
    assert capsys.readouterr().out.count("training step") == 1  # the first step; a second has not passed
    monkeypatch.setenv("REPLICATOR_PROGRESS_EVERY", "often")
    for shown in (True, False):  # replicas that draw nothing raise too: all of them stop alike
        with pytest.raises(ValueError, match="REPLICATOR_PROGRESS_EVERY='often' is neither a number of steps"):
            Progress(total=100, enabled=shown)
