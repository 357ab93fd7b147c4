"""A job closed with repl.close() and started again in the same processes: no hang, fresh state each time."""

from __future__ import annotations

import torch

import replicator as rp
from replicator.testing import run_replicas


def _one_job(seed: int) -> tuple[int, float]:
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(batch * (ctx.replica_id + 1)).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss

    for _ in repl.run(step, [torch.ones(2, 4)] * 3, steps=3, progress=False):
        pass
    repl.close()
    return repl.global_step, float(model.weight.sum())


def _train_and_close(rounds: int) -> list[tuple[int, float]]:
    return [_one_job(seed) for seed in range(rounds)]


def test_five_jobs_in_a_row_in_the_same_processes() -> None:
    # Before each job kept its own rendezvous store, rank 1 could reach the closing job's store,
    # find its keys and go on, leaving rank 0 waiting in init_process_group until the timeout.
    ranks = run_replicas(_train_and_close, 2, 5, timeout_s=120, env={"REPLICATOR_TIMEOUT": "30"})
    assert [steps for steps, _ in ranks[0]] == [3] * 5
    assert ranks[0] == ranks[1]  # every job trained in step on both ranks (averaged gradients, same weights)
