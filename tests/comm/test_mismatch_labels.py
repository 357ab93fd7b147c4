"""A mismatch names each replica's check by what the user's code was doing, not by an internal label (issue 28, 8c)."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

SAFETY_NET = {"REPLICATOR_TIMEOUT": "60"}


def collective_on_replica_zero_only(with_optimizer: bool) -> None:
    """Replica 0 calls ctx.all_sum in its first step; replica 1 goes on to the next check run() makes."""
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)) if with_optimizer else None

    def step_fn(ctx, batch):
        loss = model(batch).pow(2).mean()
        if ctx.replica_id == 0:
            ctx.all_sum(loss.detach())
        if optimizer is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return loss.detach()

    for _ in repl.run(step_fn, [torch.ones(2, 3)] * 3, progress=False, record=False):
        pass


def messages(with_optimizer: bool) -> list[str]:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(collective_on_replica_zero_only, 2, with_optimizer, env=SAFETY_NET)
    assert [e.rank for e in caught.value.errors] == [0, 1], caught.value
    return [e.message for e in caught.value.errors]


def test_the_unowned_parameter_check_is_named_by_what_run_was_doing() -> None:
    for message in messages(with_optimizer=False):
        assert "replica(s) 0: ctx.all_sum" in message, message
        assert ("replica(s) 1: run() after 1 step(s): checking that no parameter is updated without "
                "repl.wrap_optimizer()") in message, message
        assert "synchronized" not in message, "the internal label is gone"


def test_a_gradient_sync_is_named_by_its_step_and_update() -> None:
    for message in messages(with_optimizer=True):
        assert "replica(s) 1: gradient sync of optimizer 0 (SGD), step 0, update 1 at" in message, message
        assert "window" not in message, message
