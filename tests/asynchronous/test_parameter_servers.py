"""Parameter servers and sync groups: equal to synchronous training at S = 0, S never exceeded, no races."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

STEPS = 4
ROWS = 4  # per worker and step


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(ROWS, 5, generator=generator), torch.randn(ROWS, 2, generator=generator)


def reference(workers: int, optimizer_name: str) -> list[torch.Tensor]:
    """One process training on every worker's batch of each step at once."""
    model = make_model()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    for step in range(STEPS):
        parts = [batch(worker, step) for worker in range(workers)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train(servers: int, group_size: int, max_staleness: int | None, optimizer_name: str) -> dict[str, Any]:
    repl = rp.Replicator(mode="async", parameter_servers=servers, sync_group_size=group_size,
                         max_staleness=max_staleness)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(make_optimizer(optimizer_name, model.parameters()))

    def input_fn(ctx: rp.InputContext) -> list[Any]:
        return [batch(ctx.input_pipeline_id, step) for step in range(STEPS)]

    def step_fn(ctx: rp.ReplicaContext, inputs: Any) -> torch.Tensor:
        x, y = inputs
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    steps = sum(1 for _ in repl.run(step_fn, repl.prepare_input(input_fn), steps=STEPS))
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": steps,
            "run": repl.last_run["asynchronous"]}


@pytest.mark.parametrize(("world", "servers", "group_size", "optimizer_name"),
                         [(3, 1, 2, "sgd"), (4, 2, 1, "adam")], ids=["one-group-sgd", "two-groups-two-servers-adam"])
def test_bulk_synchronous_equals_synchronous_training(world: int, servers: int, group_size: int,
                                                      optimizer_name: str) -> None:
    results = run_replicas(train, world, servers, group_size, 0, optimizer_name)
    expected = reference(world - servers, optimizer_name)
    for rank, result in enumerate(results):
        for got, want in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"rank {rank}")
    workers, server_runs = results[: world - servers], results[world - servers:]
    for result in workers:
        assert result["steps"] == STEPS and result["run"]["role"] == "worker"
        assert result["run"]["staleness"]["max"] == 0 and result["run"]["updates"] == STEPS
    for result in server_runs:
        # S = 0: each round's group gradients make one update.
        assert result["run"]["versions"] == [STEPS] and result["run"]["staleness"]["exceeded"] == 0
