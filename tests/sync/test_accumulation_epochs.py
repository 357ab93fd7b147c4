"""Accumulation at an epoch's end ("carry" or Accelerate's "flush"), and a ported Accelerate schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

SAMPLES = 40
GLOBAL_BATCH = 8  # 5 steps per epoch: with accumulate(2), windows of 2, 2 and 1 micro-steps
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
MICRO_STEPS = 2
EPOCHS = 2
LR = 0.1
FAN_IN = 16  # the widest layer's inputs: the longest sum of a forward or backward dot product


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=generator)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, FAN_IN), torch.nn.Tanh(), torch.nn.Linear(FAN_IN, 3))
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def one_process_flushing() -> tuple[list[torch.Tensor], float, int]:
    """One process, Accelerate's windows: each update's batch is its window's micro-batches together, and an
    epoch's end closes a window early. Returns the parameters, the largest gradient element and the updates."""
    model, optimizer = model_and_optimizer()
    x, y = data()
    largest, updates = 0.0, 0
    for _ in range(EPOCHS):
        for start in range(0, STEPS_PER_EPOCH, MICRO_STEPS):
            rows = slice(start * GLOBAL_BATCH, min(start + MICRO_STEPS, STEPS_PER_EPOCH) * GLOBAL_BATCH)
            optimizer.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            largest = max([largest, *(float(p.grad.abs().max()) for p in model.parameters())])
            optimizer.step()
            updates += 1
    return [p.detach().clone() for p in model.parameters()], largest, updates


def replicated(epoch_end: str, directory: str) -> list[torch.Tensor]:
    """The same training through replicator, the guide's per-epoch loop, saving after every epoch."""
    repl = rp.Replicator()
    with repl.scope():
        model, optimizer = model_and_optimizer()
        repl.wrap_optimizer(optimizer)
    repl.accumulate(MICRO_STEPS, epoch_end=epoch_end)
    x, y = data()
    share = GLOBAL_BATCH // repl.num_replicas
    mine = [(x[rows], y[rows]) for step in range(STEPS_PER_EPOCH)
            for rows in [slice(step * GLOBAL_BATCH + repl.replica_id * share,
                               step * GLOBAL_BATCH + (repl.replica_id + 1) * share)]]

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    for epoch in range(EPOCHS):
        for _ in repl.run(step_fn, mine, epochs=epoch + 1, progress=False, record=False):
            pass
        repl.save(Path(directory) / f"epoch-{epoch}")  # at the epoch's end: between updates with "flush"
    return [p.detach().clone() for p in model.parameters()]


def test_flush_at_epoch_end_equals_one_process_that_flushes(tmp_path: Path) -> None:
    expected, largest, updates = one_process_flushing()
    assert updates == EPOCHS * math.ceil(STEPS_PER_EPOCH / MICRO_STEPS)
    results = run_replicas(replicated, 2, "flush", str(tmp_path))
    # Each update's gradient is the same mean over the same samples, summed in another order: its elements
    # differ by at most (samples + fan-in) roundings of the largest gradient element; SGD adds lr times that
    # per update (the 2: forward and backward each round once more per term).
    eps = torch.finfo(torch.float32).eps
    tolerance = 2 * updates * LR * (GLOBAL_BATCH * MICRO_STEPS + FAN_IN) * eps * largest
    for replica in results:
        for got, want in zip(replica, expected, strict=True):
            assert (got - want).abs().max() <= tolerance
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["epoch-0", "epoch-1"]


def test_saving_mid_accumulation_names_the_epoch_end_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(replicated, 2, "carry", str(tmp_path))
    assert sorted(error.rank for error in caught.value.errors) == [0, 1]
    for error in caught.value.errors:
        assert "in the middle of an accumulation: 1 of the 2 micro-steps" in error.message, error.message
        assert "carries a partial one into the next epoch" in error.message
        assert 'epoch_end="flush"' in error.message


def checkpointed(directory: str) -> list[int]:
    """run(checkpoint_every=2) with flush: a save due in the middle of an update waits for its end."""
    repl = rp.Replicator()
    with repl.scope():
        model, optimizer = model_and_optimizer()
        repl.wrap_optimizer(optimizer)
    repl.accumulate(MICRO_STEPS, epoch_end="flush")
    x, y = data()
    batches = [(x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4]) for i in range(STEPS_PER_EPOCH)]

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()

    for _ in repl.run(step_fn, batches, epochs=EPOCHS, checkpoint_every=2, checkpoint_dir=directory, keep=10,
                      progress=False, record=False):
        pass
    return sorted(int(path.name.removeprefix("step_")) for path in Path(directory).iterdir())


def test_checkpoints_with_flush_fall_between_updates(tmp_path: Path) -> None:
    # Updates end after steps 2, 4, 5 (the epoch's end), 7, 9, 10: saves due at 6 and 8 wait for 7 and 9.
    assert run_replicas(checkpointed, 2, str(tmp_path))[0] == [2, 4, 7, 9, 10]


def resumable(directory: str, steps: int | None) -> list[torch.Tensor]:
    """run(epochs=2) with flush and checkpoints, stopped after `steps` steps (None: not stopped)."""
    repl = rp.Replicator()
    with repl.scope():
        model, _ = model_and_optimizer()
        optimizer = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))  # its state is saved too
    repl.accumulate(MICRO_STEPS, epoch_end="flush")
    x, y = data()
    batches = [(x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4]) for i in range(STEPS_PER_EPOCH)]

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()

    for _ in repl.run(step_fn, batches, steps, epochs=EPOCHS, checkpoint_every=2, checkpoint_dir=directory,
                      progress=False, record=False):
        pass
    return [p.detach().clone() for p in model.parameters()]


def test_a_run_resumed_from_a_flush_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    uninterrupted = run_replicas(resumable, 2, str(tmp_path / "whole"), None)[0]
    # Stopped at step 8, in the middle of the update of steps 7 and 8: the newest checkpoint is step 7's.
    run_replicas(resumable, 2, str(tmp_path / "cut"), 8)
    assert sorted(path.name for path in (tmp_path / "cut").iterdir())[-1] == "step_000000007"
    resumed = run_replicas(resumable, 2, str(tmp_path / "cut"), None)[0]
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))


def uneven_epochs() -> None:
    repl = rp.Replicator()
    with repl.scope():
        model, optimizer = model_and_optimizer()
        repl.wrap_optimizer(optimizer)
    repl.accumulate(MICRO_STEPS, epoch_end="flush")
    x, y = data()
    batches = [(x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4]) for i in range(5 - repl.replica_id)]

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()

    for _ in repl.run(step_fn, batches, epochs=2, progress=False, record=False):
        pass


def test_flush_refuses_epochs_that_end_apart_on_every_replica() -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(uneven_epochs, 2)
    assert sorted(error.rank for error in caught.value.errors) == [0, 1]
    for error in caught.value.errors:
        assert "step 3 ended an epoch on replica(s) [1] but not on the others" in error.message, error.message


# -- a schedule ported from Accelerate ----------------------------------------------------------------
PROCESSES = 2
UPDATES = 6


def warmup_cosine(step: int) -> float:
    """An Accelerate script's schedule, in its scheduler steps: 4 of warm-up, cosine to step 12."""
    return (step + 1) / 4 if step < 4 else 0.5 * (1 + math.cos(math.pi * min(step - 4, 8) / 8))


def accelerate_learning_rates() -> list[float]:
    """Accelerate's AcceleratedScheduler steps the scheduler num_processes times per update."""
    _, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    rates = []
    for _ in range(UPDATES):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        for _ in range(PROCESSES):
            scheduler.step()
    return rates


def ported_learning_rates() -> list[float]:
    """The guide's conversion: one scheduler step per update, the schedule read at num_replicas times the update."""
    repl = rp.Replicator()
    with repl.scope():
        model, optimizer = model_and_optimizer()
        repl.wrap_optimizer(optimizer)
        scheduler = repl.wrap_scheduler(torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda update: warmup_cosine(update * repl.num_replicas)))
    repl.accumulate(MICRO_STEPS)
    x, y = data()
    batches = [(x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4]) for i in range(UPDATES * MICRO_STEPS)]
    rates = []

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        if ctx.step % MICRO_STEPS == MICRO_STEPS - 1:
            rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()  # every micro-step, as in the Accelerate loop: wrap_scheduler steps it once per update

    for _ in repl.run(step_fn, batches, progress=False, record=False):
        pass
    return rates


def test_the_guides_schedule_conversion_gives_accelerates_learning_rates() -> None:
    expected = accelerate_learning_rates()
    assert expected[-1] != expected[UPDATES // PROCESSES]  # the schedule moves: stepping once would differ
    for rates in run_replicas(ported_learning_rates, PROCESSES):
        assert rates == expected
