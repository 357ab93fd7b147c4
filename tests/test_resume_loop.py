"""Resuming a killed training trains each step once: the per-epoch loop, run(epochs=), a finished run extended.

64 samples in global batches of 8 make 8 steps an epoch; checkpoints every 5 steps. A job
killed at step 23 (in the middle of epoch 2) left its newest checkpoint at step 20, 4 batches
into epoch 2: the restarted job must train steps 20..39 and end with the parameters of a job
that was never stopped, bit for bit, in the documented `for epoch in range(E):
repl.run(..., epochs=epoch + 1)` loop as in one `run(epochs=E)`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.checkpoint import latest
from replicator.testing import ReplicaFailure, run_replicas

SAMPLES, FEATURES, CLASSES, GLOBAL_BATCH = 64, 6, 3, 8  # 8 steps an epoch
EVERY, EPOCHS, KILL = 5, 5, 23  # checkpoints at 5, 10, 15, 20; killed before step 23, in the middle of epoch 2


class Stop(Exception):
    """Ends a script in the middle of its training, as a crash would, but with its record flushed."""


def _training(directory: str, epochs: int, form: str, stop_at: int = -1, how: str = "kill",
              record: str | None = None) -> dict[str, Any]:
    """Shuffled, dropout training over `epochs` epochs, checkpointed; stops itself at step `stop_at`.

    `form` "loop" is `for epoch in range(epochs): repl.run(..., epochs=epoch + 1)`, "epochs" one
    `run(epochs=epochs)`, "3 then" run(epochs=3) and then run(epochs=epochs). `how`: "kill" SIGKILLs
    the process, "raise" leaves the loop by an error.
    """
    repl = rp.Replicator()
    torch.manual_seed(0)
    with repl.scope():
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(16, CLASSES))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    torch.manual_seed(10 + repl.replica_id)  # each replica's own dropout masks
    data = torch.Generator().manual_seed(3)
    dataset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, FEATURES, generator=data),
                                             torch.randint(0, CLASSES, (SAMPLES,), generator=data))

    def input_fn(ctx: rp.InputContext) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(dataset, batch_size=ctx.per_replica_batch_size(GLOBAL_BATCH),
                                           sampler=ctx.sampler(dataset, shuffle=True))

    trained: list[int] = []

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if ctx.step == stop_at:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise Stop
        trained.append(ctx.step)
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    inputs = repl.prepare_input(input_fn)
    options: dict[str, Any] = {"checkpoint_every": EVERY, "checkpoint_dir": directory, "progress": False,
                               "record": record if record is not None else False}
    bounds = {"loop": list(range(1, epochs + 1)), "epochs": [epochs], "3 then": [3, epochs]}[form]
    try:
        for bound in bounds:
            for _ in repl.run(step_fn, inputs, epochs=bound, **options):
                pass
    except Stop:
        pass
    return {"trained": trained, "step": repl.global_step,
            "parameters": [p.detach().clone() for p in model.parameters()]}


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got["parameters"], want["parameters"], strict=True))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_killed_training_resumes_each_step_once_in_the_epoch_loop_and_in_one_run(tmp_path: Path,
                                                                                   replicas: int) -> None:
    for form in ("loop", "epochs"):
        # The two forms are different trainings: the loop reads the next epoch's first batch (and draws its
        # order from the global generator) after the epoch's last step, one run() before it. Each resumes as itself.
        whole = run_replicas(_training, replicas, str(tmp_path / f"whole-{form}"), EPOCHS, form, timeout_s=240)
        assert [r["trained"] for r in whole] == [list(range(EPOCHS * 8))] * replicas
        directory = str(tmp_path / form)
        with pytest.raises(ReplicaFailure):  # killed after 3 epochs' worth of steps would have begun
            run_replicas(_training, replicas, directory, EPOCHS, form, KILL, timeout_s=240)
        assert (latest(directory) or Path()).name == "step_000000020"
        resumed = run_replicas(_training, replicas, directory, EPOCHS, form, timeout_s=240)
        for rank, (got, want) in enumerate(zip(resumed, whole, strict=True)):
            # The loop form used to start epoch 2 again from its first batch: steps 20..43, other parameters.
            assert got["trained"] == list(range(20, EPOCHS * 8)), (form, rank, got["trained"])
            assert got["step"] == EPOCHS * 8 and _same(got, want), (form, rank)


def test_a_finished_training_extended_trains_no_step_again(tmp_path: Path) -> None:
    # The same script never stopped: run(epochs=3), then run(epochs=5) in the same process.
    whole = run_replicas(_training, 2, str(tmp_path / "whole"), EPOCHS, "3 then", timeout_s=240)
    directory = str(tmp_path / "extended")
    first = run_replicas(_training, 2, directory, 3, "epochs", timeout_s=240)
    assert first[0]["trained"] == list(range(24))
    # run() ended at step 24, between the cadence's checkpoints (20 and 25): it saved where it ended.
    assert (latest(directory) or Path()).name == "step_000000024"
    extended = run_replicas(_training, 2, directory, EPOCHS, "epochs", timeout_s=240)
    for got, want in zip(extended, whole, strict=True):
        assert got["trained"] == list(range(24, EPOCHS * 8)) and _same(got, want), got["trained"]
    # The last step (40) wrote its checkpoint as the cadence's: none is written twice, none is missing.
    assert sorted(p.name for p in Path(directory).iterdir()) == ["step_000000030", "step_000000035",
                                                                 "step_000000040"]


def _steps(record: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (record / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_appending_to_its_record_leaves_one_line_per_step(tmp_path: Path) -> None:
    record = tmp_path / "record"
    run_replicas(_training, 2, str(tmp_path / "ckpt"), EPOCHS, "epochs", KILL, "raise", str(record), timeout_s=240)
    assert _steps(record) == list(range(KILL))  # steps 20..22 were recorded, then trained again after the restart
    run_replicas(_training, 2, str(tmp_path / "ckpt"), EPOCHS, "epochs", -1, "kill", str(record), timeout_s=240)
    assert _steps(record) == list(range(EPOCHS * 8))
    # TensorBoard reads both runs' event files and shows each step once: the resumed run's file hides the first's
    # events from the step it resumed at on.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(record))
    board.Reload()
    assert len(list(record.glob("events.out.tfevents.*"))) == 2
    assert [event.step for event in board.Scalars("replicator/samples_per_second")] == list(range(EPOCHS * 8))
    # In the per-epoch loop each run() appends its epoch to the same record.
    run_replicas(_training, 2, str(tmp_path / "loop"), 2, "loop", -1, "kill", str(tmp_path / "loop-record"),
                 timeout_s=240)
    assert _steps(tmp_path / "loop-record") == list(range(16))


def _ends_mid_accumulation(directory: str) -> str:
    """3 micro-steps of accumulate(2), checkpointed every update: run() ends half-way through an update."""
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(FEATURES, CLASSES)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    repl.accumulate(2)

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        for _ in repl.run(step_fn, [torch.ones(2, FEATURES)] * 3, checkpoint_every=2, checkpoint_dir=directory,
                          progress=False, record=False):
            pass
    return said.getvalue()


def test_a_run_ending_inside_an_accumulation_says_why_it_saved_no_final_checkpoint(tmp_path: Path) -> None:
    said = run_replicas(_ends_mid_accumulation, 2, str(tmp_path), timeout_s=120)
    assert "no checkpoint where run() ended (step 3): it ended in the middle of a gradient accumulation" in said[0]
    assert said[1] == ""  # the main process says it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000002"]
