"""run(epochs=): the sampler told each epoch, ctx.epoch, and a killed run resumed bit for bit without re-reading."""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

from _numerics import assert_within, training_bound

SAMPLES, FEATURES, CLASSES = 48, 6, 3
EPOCHS, BATCH = 3, 4  # per replica: 2 replicas read 6 batches of 4 an epoch, 18 steps in all
EVERY, KILL = 4, 10  # checkpoints at steps 4 and 8; killed at step 10, in the middle of epoch 1


class NoisyDigits(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed samples with noise drawn from torch's generator on every read: a random augmentation."""

    def __init__(self) -> None:
        data = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, FEATURES, generator=data)
        self.y = torch.randint(0, CLASSES, (SAMPLES,), generator=data)
        self.reads: list[int] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append(index)
        return self.x[index] + 0.1 * torch.randn(FEATURES), self.y[index]


def _model(repl: rp.Replicator) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(16, CLASSES))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, optimizer


def _killable_training(directory: str | None, kill_at: int) -> dict[str, Any]:
    """3 epochs of shuffled, augmented, dropout training, checkpointed; SIGKILLs itself at step `kill_at`."""
    repl = rp.Replicator()
    model, optimizer = _model(repl)
    # Every replica draws its own order, noise and dropout masks from its own generators.
    torch.manual_seed(10 + repl.replica_id)
    random.seed(20 + repl.replica_id)
    np.random.seed(30 + repl.replica_id)
    dataset = NoisyDigits()

    def input_fn(ctx: rp.InputContext) -> torch.utils.data.DataLoader:
        # RandomSampler draws each epoch's order from the global generator: the hardest case to resume.
        shard = torch.utils.data.Subset(dataset, range(ctx.input_pipeline_id, SAMPLES, ctx.num_input_pipelines))
        return torch.utils.data.DataLoader(shard, batch_size=BATCH, shuffle=True)

    epochs: list[int] = []

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if ctx.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        epochs.append(ctx.epoch)
        x, y = batch
        x = x + 0.01 * random.gauss(0.0, 1.0) + 0.01 * float(np.random.randn())
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        for _ in repl.run(step_fn, repl.prepare_input(input_fn), epochs=EPOCHS,
                          checkpoint_every=EVERY if directory else None, checkpoint_dir=directory, progress=False):
            pass
    return {"params": [p.detach().clone() for p in model.parameters()], "epochs": epochs,
            "reads": len(dataset.reads), "said": said.getvalue(), "steps": repl.global_step}


def test_a_killed_multi_epoch_run_resumes_bit_for_bit_without_reading_skipped_batches(tmp_path: Path) -> None:
    whole = run_replicas(_killable_training, 2, None, -1, timeout_s=180)  # never checkpointed, never killed
    steps = EPOCHS * SAMPLES // (2 * BATCH)
    assert [r["steps"] for r in whole] == [steps, steps]
    assert whole[0]["epochs"] == [e for e in range(EPOCHS) for _ in range(steps // EPOCHS)]

    with pytest.raises(ReplicaFailure) as killed:
        run_replicas(_killable_training, 2, str(tmp_path / "cut"), KILL, timeout_s=180)
    assert {e.rank for e in killed.value.errors} == {0, 1}, killed.value  # both died (SIGKILL), nothing else
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == ["step_000000004", "step_000000008"]

    resumed = run_replicas(_killable_training, 2, str(tmp_path / "cut"), -1, timeout_s=180)
    for replica, (mine, reference) in enumerate(zip(resumed, whole)):
        for got, want in zip(mine["params"], reference["params"]):
            assert torch.equal(got, want), f"replica {replica} ends with other parameters than the uninterrupted run"
        assert mine["epochs"] == reference["epochs"][8:]
        # Only the 10 batches trained after the checkpoint were read: none of the 8 before it.
        assert mine["reads"] == (steps - 8) * BATCH, mine["reads"]
    said = resumed[0]["said"]
    assert f"resumed from step 8 in {tmp_path / 'cut' / 'step_000000008'} (epoch 1, 2 batches into it)" in said, said
    assert resumed[1]["said"] == "", "only the main process speaks"


class Indexed(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is (i, features, label): a sample's index travels with it, and reads are counted."""

    def __init__(self, samples: int = SAMPLES) -> None:
        data = torch.Generator().manual_seed(4)
        self.x, self.y = torch.randn(samples, FEATURES, generator=data), torch.randint(0, CLASSES, (samples,),
                                                                                       generator=data)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        self.reads += 1
        return torch.tensor(index), self.x[index], self.y[index]


def _plain_loader_training(batch: int, shuffle: bool, epochs: int) -> dict[str, Any]:
    """run() given a DataLoader as it is: which samples each replica trained on, per epoch, and the result."""
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(FEATURES, CLASSES)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    seen: dict[int, list[int]] = {}

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        index, x, y = batch
        seen.setdefault(ctx.epoch, []).extend(index.tolist())
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    said = io.StringIO()
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=batch, shuffle=shuffle)
    with contextlib.redirect_stdout(said):
        for _ in repl.run(step_fn, loader, epochs=epochs, progress=False):
            pass
    return {"seen": seen, "params": [p.detach().clone() for p in model.parameters()], "said": said.getvalue()}


@pytest.mark.numerics  # batches of 4 against 8
def test_a_plain_dataloader_is_split_across_replicas_and_trains_as_one_process_would() -> None:
    two = run_replicas(_plain_loader_training, 2, BATCH, False, 1, timeout_s=120)
    one = _plain_loader_training(2 * BATCH, False, 1)
    assert sorted(two[0]["seen"][0] + two[1]["seen"][0]) == list(range(SAMPLES)), "disjoint halves, all of them"
    # 2 replicas x batch 4 must train as 1 process x batch 8: the same 8-row sums in another order, through a
    # fan-in of FEATURES, for an epoch's steps.
    tolerance = training_bound(torch.float32, one["params"], 2 * BATCH + FEATURES + 2, SAMPLES // (2 * BATCH))
    for rank, replica in enumerate(two):
        for index, (got, want) in enumerate(zip(replica["params"], one["params"], strict=True)):
            assert_within(got, want, tolerance, f"replica {rank} parameter {index}")
    assert "run() split the DataLoader across 2 replicas" in two[0]["said"], two[0]["said"]
    assert one["said"] == "", "one replica: the loader is used as it is"


def test_a_shuffling_dataloader_is_split_and_reshuffled_every_epoch() -> None:
    two = run_replicas(_plain_loader_training, 2, BATCH, True, 2, timeout_s=120)
    for epoch in (0, 1):
        halves = [set(replica["seen"][epoch]) for replica in two]
        assert not halves[0] & halves[1] and len(halves[0] | halves[1]) == SAMPLES
    assert two[0]["seen"][0] != two[0]["seen"][1], "the sampler was told the new epoch"


def _iterable_loader() -> None:
    class Stream(torch.utils.data.IterableDataset[torch.Tensor]):
        def __iter__(self) -> Any:
            return iter(torch.randn(8, 2))

    repl = rp.Replicator()
    for _ in repl.run(lambda ctx, batch: batch.sum(), torch.utils.data.DataLoader(Stream(), batch_size=2)):
        pass


def test_a_dataloader_that_cannot_be_split_is_refused_on_every_replica(run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_iterable_loader, 2)
    assert [e.rank for e in caught.value.errors] == [0, 1]
    for error in caught.value.errors:
        assert error.kind == "ReplicatorUsageError" and "IterableDataset" in error.message, error
        assert "repl.prepare_input(input_fn)" in error.message, error.message


class Stop(Exception):
    """Ends a run in the middle, as a crash would (the process state is thrown away after it)."""


def _epoch_loop(directory: Path, stop_at: int, bounded: bool) -> tuple[list[torch.Tensor], str, int]:
    """`for epoch in range(3): repl.run(...)`, one process; with `bounded`, run() is given epochs=epoch + 1."""
    repl = rp.Replicator()
    model, optimizer = _model(repl)
    torch.manual_seed(7)
    dataset = Indexed(24)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if ctx.step == stop_at:
            raise Stop
        loss = F.cross_entropy(model(batch[1]), batch[2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.suppress(Stop):
        for epoch in range(3):
            for _ in repl.run(step_fn, loader, epochs=epoch + 1 if bounded else None, checkpoint_every=4,
                              checkpoint_dir=directory, progress=False):
                pass
    repl.close()
    return [p.detach().clone() for p in model.parameters()], said.getvalue(), repl.global_step


def test_a_loop_over_epochs_resumes_exactly_with_epochs_given_and_warns_without(tmp_path: Path) -> None:
    whole, _, steps = _epoch_loop(tmp_path / "whole", -1, bounded=True)
    assert steps == 18  # 6 batches an epoch
    _epoch_loop(tmp_path / "cut", 14, bounded=True)  # a crash in epoch 2; the last checkpoint is step 12
    resumed, said, steps = _epoch_loop(tmp_path / "cut", -1, bounded=True)
    assert steps == 18 and all(torch.equal(got, want) for got, want in zip(resumed, whole)), said
    assert "run(epochs=1) has nothing to do: the training is in epoch 2" in said, said

    _epoch_loop(tmp_path / "loose", 14, bounded=False)
    _, said, steps = _epoch_loop(tmp_path / "loose", -1, bounded=False)
    assert "resumes in epoch 2 and has no epochs=" in said and "Pass epochs=E" in said, said


def test_resuming_elsewhere_says_what_differs(tmp_path: Path) -> None:
    run_replicas(_checkpointed_plain_loader, 2, str(tmp_path), 4, timeout_s=120)
    result = _checkpointed_plain_loader(str(tmp_path), 8)
    said = result["said"]
    assert "resumed from step 4" in said, said
    assert "written by 2 replica(s) x 1 stage(s), this job is 1 x 1" in said, said
    assert "a global batch of 8; this run's is 4" in said, said
    # One process reads the 4 batches it trains on after step 4, not the 4 before them.
    assert result["reads"] == 4 * BATCH, result["reads"]


def _checkpointed_plain_loader(directory: str, steps: int) -> dict[str, Any]:
    repl = rp.Replicator()
    model, optimizer = _model(repl)
    dataset = Indexed(64)

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[1]), batch[2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)
        for _ in repl.run(step_fn, loader, steps=steps, checkpoint_every=4, checkpoint_dir=directory, progress=False):
            pass
    return {"said": said.getvalue(), "reads": dataset.reads}


def test_a_run_that_stops_before_its_steps_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    repl = rp.Replicator()
    batches = (torch.ones(2, 1) for _ in range(3))
    assert len(list(repl.run(lambda ctx, batch: batch.sum(), batches, steps=10, progress=False))) == 3
    said = capsys.readouterr().out
    assert "run() stopped at step 3, before steps=10: the input, a generator that can be read once, ran out" in said
    repl.close()


def test_a_new_input_starts_from_its_first_batch_and_the_same_input_goes_on() -> None:
    """Phases fed as fresh lists (a benchmark's, a curriculum's) train from each list's start; the same
    input passed again continues where the last run stopped."""
    repl = rp.Replicator()
    seen: list[float] = []

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        seen.append(float(batch[0, 0]))
        return batch.sum()

    first = [torch.full((2, 1), float(i)) for i in range(5)]
    second = [torch.full((2, 1), 10.0 + i) for i in range(8)]
    list(repl.run(step_fn, first, steps=3, progress=False))
    list(repl.run(step_fn, second, steps=repl.global_step + 4, progress=False))
    list(repl.run(step_fn, second, steps=repl.global_step + 2, progress=False))
    assert seen == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    repl.close()


def _nan_through_all_mean() -> None:
    repl = rp.Replicator()

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        loss = batch.sum()
        if ctx.replica_id == 1 and ctx.step == 2:
            loss = loss * float("nan")
        return ctx.all_mean(loss)

    for _ in repl.run(step_fn, [torch.ones(2, 1)] * 5, progress=False):
        pass


def test_a_nan_fed_into_all_mean_is_blamed_on_the_replica_it_came_from(run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_nan_through_all_mean, 2)
    assert [e.rank for e in caught.value.errors] == [0, 1]
    for error in caught.value.errors:
        assert error.kind == "NonFiniteError", error
        assert "at step 2, fed a NaN or infinite value by replica(s) [1]" in error.message, error.message
    assert "replica 1: the input of ctx.all_mean" in caught.value.errors[1].message
