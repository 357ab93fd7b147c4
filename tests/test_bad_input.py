"""Bad input raises a clear error on every replica, never a hang or a silent wrong answer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

from _events import announce, wait_for

# Errors must arrive within seconds; a hang would hit this.


def tiny_setup():
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return repl, model, optimizer


def collective_on_replica_zero_only() -> None:
    repl, model, optimizer = tiny_setup()

    def step_fn(ctx, batch):
        loss = model(batch).pow(2).mean()
        if ctx.replica_id == 0:
            ctx.all_sum(loss.detach())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in repl.run(step_fn, [torch.ones(2, 3)] * 3):
        pass


def optimizers_stepped_in_different_orders() -> None:
    """Two same-shaped models: summing one replica's buckets with the other's would go unnoticed by sizes."""
    repl = rp.Replicator()
    with repl.scope():
        models = [torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)]
        optimizers = [repl.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1)) for m in models]
    order = [0, 1] if repl.replica_id == 0 else [1, 0]

    def step_fn(ctx, batch):
        for index in order:
            optimizers[index].zero_grad()
            models[index](batch).pow(2).mean().backward()
            optimizers[index].step()

    for _ in repl.run(step_fn, [torch.ones(2, 3)] * 3):
        pass


def returns_a_string() -> None:
    repl, model, optimizer = tiny_setup()
    for _ in repl.run(lambda ctx, batch: "done", [torch.ones(2, 3)]):
        pass


def indivisible_global_batch() -> None:
    repl = rp.Replicator()
    repl.prepare_input(lambda ctx: [torch.ones(ctx.per_replica_batch_size(10), 3)])


def unequal_batches() -> None:
    repl, model, optimizer = tiny_setup()
    rows = 4 if repl.replica_id == 0 else 3
    for _ in repl.run(lambda ctx, batch: None, [torch.ones(rows, 3)]):
        pass


def model_on_wrong_device() -> None:
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(3, 1, device="meta")
        repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def wrap_outside_scope() -> None:
    repl = rp.Replicator()
    model = torch.nn.Linear(3, 1)
    repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def step_inside_no_sync() -> None:
    repl, model, optimizer = tiny_setup()
    with repl.no_sync():
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()


def expect_everywhere(run: Callable[..., Any], fn, kind: str, *fragments: str, replicas: int = 2) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run(fn, replicas, timeout_s=60, collective_timeout_s=30)
    errors = caught.value.errors
    assert [e.rank for e in errors] == list(range(replicas)), f"not every replica raised: {caught.value}"
    for error in errors:
        assert error.kind == kind, error
        for fragment in fragments:
            assert fragment in error.message, f"{fragment!r} missing from: {error.message}"


def test_collective_called_by_some_replicas_names_the_culprit(run_failing_fast: Callable[..., Any]) -> None:
    expect_everywhere(run_failing_fast, collective_on_replica_zero_only, "ReplicaMismatchError",
                      "replica(s) 0: ctx.all_sum", "test_bad_input.py", "gradient sync")


def test_optimizers_stepped_in_different_orders(run_failing_fast: Callable[..., Any]) -> None:
    # Replica 0 opens optimizer 0's gradient sync while replica 1 opens optimizer 1's: both must
    # raise, naming both, before any bucket of one is summed with the other's.
    expect_everywhere(run_failing_fast, optimizers_stepped_in_different_orders, "ReplicaMismatchError",
                      "replica(s) 0: gradient sync of", "replica(s) 1: gradient sync of")


def test_unreducible_output(run_failing_fast: Callable[..., Any]) -> None:
    expect_everywhere(run_failing_fast, returns_a_string, "ReplicatorUsageError", "step_fn returned a str")


def test_indivisible_global_batch(run_failing_fast: Callable[..., Any]) -> None:
    expect_everywhere(run_failing_fast, indivisible_global_batch, "ReplicatorUsageError", "global batch size 10",
                      "multiple of 4", replicas=4)


def test_unequal_batch_sizes(run_failing_fast: Callable[..., Any]) -> None:
    expect_everywhere(run_failing_fast, unequal_batches, "ReplicaMismatchError", "replica 0: 4, replica 1: 3",
                      "drop_last", 'uneven_batches="weighted"')


def test_model_on_wrong_device(run_failing_fast: Callable[..., Any]) -> None:
    # A meta model is the one wrong device scope() cannot fix: the message says how to give it values.
    expect_everywhere(run_failing_fast, model_on_wrong_device, "ReplicatorUsageError", "Linear.weight is on meta",
                      "model.to_empty(device=repl.device)")


def test_wrap_optimizer_outside_scope(run_failing_fast: Callable[..., Any]) -> None:
    expect_everywhere(run_failing_fast, wrap_outside_scope, "ReplicatorUsageError", "outside repl.scope()")


def test_step_inside_no_sync(run_failing_fast: Callable[..., Any]) -> None:
    expect_everywhere(run_failing_fast, step_inside_no_sync, "ReplicatorUsageError", "inside repl.no_sync()")


def one_replica_stalls(gave_up: str) -> None:
    repl, model, optimizer = tiny_setup()

    def step_fn(ctx, batch):
        if ctx.replica_id == 1 and ctx.step == 1:
            wait_for(gave_up)  # stuck until replica 0 has given up on it, however long the timeout took
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        optimizer.step()

    try:
        for _ in repl.run(step_fn, [torch.ones(2, 3)] * 3):
            pass
    finally:
        if repl.replica_id == 0:
            announce(gave_up)


def test_a_stalled_replica_is_named_instead_of_hanging(tmp_path: Path) -> None:
    # A hang would end in run_replicas' TimeoutError after 120 s, not in this ReplicaFailure: no clock decides.
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(one_replica_stalls, 2, str(tmp_path / "gave up"), timeout_s=120, env={"REPLICATOR_TIMEOUT": "3"})
    first = next(e for e in caught.value.errors if e.rank == 0)
    assert first.kind == "ReplicatorError"
    assert "rank(s) [1] never arrived" in first.message
