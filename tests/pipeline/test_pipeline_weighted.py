"""Pipeline stages beside replicas with uneven_batches="weighted": a replica's samples count once, not per stage."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_replicas

from _numerics import assert_within, training_bound

STEPS = 3


def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]


def batches(replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(replica)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(STEPS)]


def weighted_pipeline() -> dict[str, Any]:
    repl = rp.Replicator(stages=2, chunks=2, uneven_batches="weighted")
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=[1, 1])
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = pipe.train_step(batch[0], batch[1], F.mse_loss)
        optimizer.step()
        return loss

    for _ in repl.run(step_fn, batches(repl.replica_id), steps=STEPS, record=False):
        pass
    return {"stage": repl.stage_id, "params": [p.detach().clone() for p in pipe.parameters()]}


def test_weighted_gradients_beside_pipeline_stages_equal_one_process_training() -> None:
    model = torch.nn.Sequential(*layers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.cat([batches(replica)[step][0] for replica in range(2)])
        y = torch.cat([batches(replica)[step][1] for replica in range(2)])
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    # Before: the step loop counted each replica's batch once per stage, so every gradient was halved.
    for result in run_replicas(weighted_pipeline, 4, timeout_s=150):  # 2 replicas x 2 stages
        expected = list(model[result["stage"]].parameters())
        # 16 rows (2 replicas x 8) through fan-ins of 4, STEPS steps: the gradients' sums in another order.
        tolerance = training_bound(torch.float32, [p.detach() for p in model.parameters()], 16 + 4 + 3, STEPS)
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert_within(got, want.detach(), tolerance, f"stage {result['stage']} parameter {index}")
