"""repl.run(checkpoint_every=, checkpoint_dir=) resumes a cut-off run exactly where an uninterrupted one would be."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_replicas

GLOBAL_BATCH, SAMPLES, STEPS = 16, 256, 10  # 16 batches in the epoch that run() iterates


def train(
    directory: str, steps: int, shuffle_with_sampler: bool, dies_after: int | None = None
) -> tuple[list[int], list[float], dict[str, torch.Tensor]]:
    """Run (resuming from `directory` if it holds a checkpoint) until `steps`, or leave the loop after `dies_after`
    steps as a crash would (a run that completes saves where it ended); return steps, losses, parameters."""
    repl = rp.Replicator()
    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))  # a fresh process could start anywhere...
    with repl.scope():
        torch.manual_seed(0)  # ...but builds the same model
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 3)
        )
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        repl.wrap_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5))
    torch.manual_seed(10 + repl.replica_id)

    def input_fn(ctx: rp.InputContext):
        data = torch.Generator().manual_seed(3)
        dataset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=data),
                                                 torch.randint(0, 3, (SAMPLES,), generator=data))
        if shuffle_with_sampler:
            share = ctx.per_replica_batch_size(GLOBAL_BATCH)
            return torch.utils.data.DataLoader(dataset, batch_size=share, sampler=ctx.sampler(dataset))
        # RandomSampler draws its order from the global generator when the epoch begins.
        return torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH, shuffle=True)

    def step_fn(ctx: rp.ReplicaContext, batch):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    done, losses = [], []
    run = repl.run(step_fn, repl.prepare_input(input_fn), steps=steps, checkpoint_every=4, checkpoint_dir=directory,
                   progress=False)
    for step, loss in run:
        done.append(step)
        losses.append(float(loss))
        if step + 1 == dies_after:
            break
    return done, losses, {k: v.clone() for k, v in model.state_dict().items()}


def check_resume(tmp_path: Path, replicas: int) -> None:
    def call(*args: object) -> tuple[list[int], list[float], dict[str, torch.Tensor]]:
        return train(*args) if replicas == 1 else run_replicas(train, replicas, *args, timeout_s=180)[0]

    steps, losses, params = call(str(tmp_path / "whole"), STEPS, replicas > 1)
    assert steps == list(range(STEPS))
    first, _, _ = call(str(tmp_path / "cut"), STEPS, replicas > 1, 6)  # "dies" after 6 steps; the last checkpoint: 4
    assert first == list(range(6))
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == ["step_000000004"]
    resumed_steps, resumed_losses, resumed = call(str(tmp_path / "cut"), STEPS, replicas > 1)
    assert resumed_steps == list(range(4, STEPS))
    assert resumed_losses == losses[4:]
    for key in params:
        assert torch.equal(resumed[key], params[key]), key


def test_run_resumes_from_its_checkpoint_directory_exactly(tmp_path: Path) -> None:
    check_resume(tmp_path, 1)


def test_two_replicas_resume_exactly(tmp_path: Path) -> None:
    check_resume(tmp_path, 2)
