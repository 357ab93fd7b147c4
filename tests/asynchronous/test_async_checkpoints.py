"""Checkpoints of both asynchronous modes: a killed run resumes bit for bit; async restores into other counts."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator import checkpoint
from replicator.testing import ReplicaFailure, run_replicas

from _numerics import assert_within, training_bound

STEPS, EVERY, KILL = 8, 4, 6  # checkpoints at steps 4 and 8; the killed run dies in step 6
ENV = {"REPLICATOR_TIMEOUT": "15"}  # servers drop the killed groups within seconds


def make_model(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(8, 2))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(4, 5, generator=generator), torch.randn(4, 2, generator=generator)


def async_training(directory: str | None, steps: int, kill_at: int, servers: int, dropout: float) -> dict[str, Any]:
    """Bulk-synchronous parameter-server training (S = 0: its result does not depend on timing), with dropout
    drawn from each worker's own generator and an LR schedule; SIGKILLs every worker in step `kill_at`."""
    repl = rp.Replicator(mode="async", parameter_servers=servers, max_staleness=0)
    with repl.scope():
        model = make_model(dropout)
        optimizer = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.05))
        scheduler = repl.wrap_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5))
    torch.manual_seed(10 + repl.topology.rank)

    def step_fn(ctx: rp.ReplicaContext, inputs: Any) -> torch.Tensor:
        if ctx.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = inputs
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.detach()

    inputs = repl.prepare_input(lambda ctx: [batch(ctx.input_pipeline_id, step) for step in range(STEPS)])
    for _ in repl.run(step_fn, inputs, steps=steps, checkpoint_every=EVERY if directory else None,
                      checkpoint_dir=directory):
        pass
    return {"params": [p.detach().clone() for p in model.parameters()], "step": repl.global_step,
            "lr": optimizer.param_groups[0]["lr"], "run": repl.last_run["asynchronous"]}


def test_a_killed_asynchronous_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    whole = run_replicas(async_training, 3, None, STEPS, -1, 1, 0.3, env=ENV)
    with pytest.raises(ReplicaFailure) as killed:
        run_replicas(async_training, 3, str(tmp_path), STEPS, KILL, 1, 0.3, env=ENV)
    # The workers died (the server with them: under a plain multiprocessing start rank 0 holds the job's store).
    assert [e.kind for e in killed.value.errors][:2] == ["died", "died"], killed.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004"]
    assert checkpoint.read_info(tmp_path / "step_000000004")["regime"]["workers"] == 2

    resumed = run_replicas(async_training, 3, str(tmp_path), STEPS, -1, 1, 0.3, env=ENV)
    for rank, (mine, reference) in enumerate(zip(resumed, whole, strict=True)):
        for got, want in zip(mine["params"], reference["params"], strict=True):
            assert torch.equal(got, want), f"rank {rank} ends with other parameters than the uninterrupted run"
    assert [r["step"] for r in resumed[:2]] == [STEPS, STEPS] and resumed[0]["lr"] == whole[0]["lr"]
    assert resumed[0]["run"]["updates"] == STEPS - EVERY


def test_an_asynchronous_checkpoint_restores_into_other_numbers_of_servers_and_workers(tmp_path: Path) -> None:
    # Written by 2 servers (each its shard's Adam state) and 2 workers; read by 1 server and 1 worker.
    run_replicas(async_training, 4, str(tmp_path), EVERY, -1, 2, 0.0, env=ENV)
    saved = tmp_path / "step_000000004"
    assert sorted(p.name for p in saved.glob("*.json")) == ["replicator.json", "server1.json", "stage0.json"]
    resumed = run_replicas(async_training, 2, str(tmp_path), EVERY + 3, -1, 1, 0.0, env=ENV)

    # The same three steps in one plain process that loads the checkpoint: its model and optimizer state are whole.
    model = make_model(0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    restored = checkpoint.restore(saved, modules=model, optimizers=[optimizer], schedulers=[scheduler])
    assert restored.step == EVERY and restored.input_state["batches"] == EVERY
    for step in range(EVERY, EVERY + 3):
        x, y = batch(0, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    # The worker's 4 rows and this process's are the same, but the server applies Adam to a flat shard: the 3
    # updates' sums over 4 rows through fan-ins of 8, and Adam's few roundings, may round another way.
    tolerance = training_bound(torch.float32, [p.detach() for p in model.parameters()], 4 + 8 + 6, 3)
    for rank, result in enumerate(resumed):
        for index, (got, want) in enumerate(zip(result["params"], model.parameters(), strict=True)):
            assert_within(got, want.detach(), tolerance, f"rank {rank} parameter {index}")


def diloco_training(directory: str | None, steps: int, kill_at: int, every: int) -> dict[str, Any]:
    """Two sync groups of one, outer step every 2 steps with the paper's Nesterov outer optimizer; inner SGD with
    momentum and dropout: every kind of state a resumed round needs."""
    repl = rp.Replicator(mode="diloco", outer_every=2)
    with repl.scope():
        model = make_model(0.3)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    torch.manual_seed(10 + repl.replica_id)

    def step_fn(ctx: rp.ReplicaContext, inputs: Any) -> torch.Tensor:
        if ctx.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = inputs
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    inputs = repl.prepare_input(lambda ctx: [batch(ctx.input_pipeline_id, step) for step in range(STEPS)])
    for _ in repl.run(step_fn, inputs, steps=steps, checkpoint_every=every if directory else None,
                      checkpoint_dir=directory):
        pass
    return {"params": [p.detach().clone() for p in model.parameters()], "step": repl.global_step,
            "outer_steps": repl.last_run["outer_steps"]}


def test_a_killed_diloco_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    whole = run_replicas(diloco_training, 2, None, STEPS, -1, EVERY)
    with pytest.raises(ReplicaFailure):
        run_replicas(diloco_training, 2, str(tmp_path), STEPS, KILL, EVERY)
    saved = tmp_path / "step_000000004"
    assert sorted(p.name for p in saved.glob("*.json")) == ["group1.json", "replicator.json", "stage0.json"]
    resumed = run_replicas(diloco_training, 2, str(tmp_path), STEPS, -1, EVERY)
    assert [r["outer_steps"] for r in resumed] == [2, 2]
    for replica, (mine, reference) in enumerate(zip(resumed, whole, strict=True)):
        for got, want in zip(mine["params"], reference["params"], strict=True):
            assert torch.equal(got, want), f"replica {replica} ends with other parameters than the uninterrupted run"


def test_diloco_refuses_checkpoints_inside_a_round_on_every_replica(run_failing_fast: Any, tmp_path: Path) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(diloco_training, 2, str(tmp_path), STEPS, -1, 3)
    assert sorted(e.rank for e in failure.value.errors) == [0, 1]
    assert all("not a multiple of outer_every=2" in e.message for e in failure.value.errors), failure.value
