"""Resuming a killed training trains each step once: in the per-epoch loop as in one run(epochs=), and records it once.

64 samples in global batches of 8 make 8 steps an epoch; checkpoints every 5 steps. A job
killed at step 23 (in the middle of epoch 2) left its newest checkpoint at step 20, 4 batches
into epoch 2: the restarted job must train steps 20..39 and end with the parameters of a job
that was never stopped, bit for bit, in the documented `for epoch in range(E):
repl.run(..., epochs=epoch + 1)` loop as in one `run(epochs=E)`.
"""

from __future__ import annotations

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


def _steps(record: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (record / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_appending_to_its_record_leaves_one_line_per_step(tmp_path: Path) -> None:
    record = tmp_path / "record"
    run_replicas(_training, 2, str(tmp_path / "ckpt"), EPOCHS, "epochs", KILL, "raise", str(record), timeout_s=240)
    assert _steps(record) == list(range(KILL))  # steps 20..22 were recorded, then trained again after the restart
    run_replicas(_training, 2, str(tmp_path / "ckpt"), EPOCHS, "epochs", -1, "kill", str(record), timeout_s=240)
    assert _steps(record) == list(range(EPOCHS * 8))
    # In the per-epoch loop each run() appends its epoch to the same record.
    run_replicas(_training, 2, str(tmp_path / "loop"), 2, "loop", -1, "kill", str(tmp_path / "loop-record"),
                 timeout_s=240)
    assert _steps(tmp_path / "loop-record") == list(range(16))
