"""Numerical health: NaN losses raise or skip alike, diverged parameters are caught, trails name stragglers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator import health
from replicator.testing import ReplicaFailure, run_replicas

from _events import announce, wait_for
from _numerics import assert_within, training_bound

STEPS = 4
BAD_STEP = 2


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, 8, 5, generator=generator), torch.randn(STEPS, 8, 2, generator=generator)


def _poisoned(step: int, rows: slice, bad: int = BAD_STEP) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step`, this replica's rows; the last row of the global batch is NaN at step `bad`."""
    x, y = _data()
    batch = x[step].clone()
    if step == bad:
        batch[-1, 0] = float("nan")
    return batch[rows], y[step][rows]


def _train(nonfinite: str, bad: int = BAD_STEP, as_if_on_a_gpu: bool = False,
           ran: list[int] | None = None) -> dict[str, Any]:
    if as_if_on_a_gpu:  # every output judged a step late, as outputs still on their way from a GPU are
        health.OutputCheck.waits_for_a_device = property(lambda self: True)  # type: ignore[assignment]
    repl = rp.Replicator(nonfinite=nonfinite)
    with repl.scope():
        torch.manual_seed(repl.replica_id)  # scope() makes them equal anyway
        model = torch.nn.Linear(5, 2)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    share = 8 // repl.num_replicas
    rows = slice(repl.replica_id * share, (repl.replica_id + 1) * share)

    def step_fn(ctx: rp.ReplicaContext, step: int) -> torch.Tensor:
        if ran is not None:
            ran.append(step)
        x, y = _poisoned(step, rows, bad)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in repl.run(step_fn, list(range(STEPS)), progress=False):
        pass
    return {"params": [p.detach().clone() for p in model.parameters()], "skipped": repl.skipped_steps}


def _single_process_skipping(bad: int) -> list[torch.Tensor]:
    """One process, full batch, leaving out update `bad` — what nonfinite='skip' must equal."""
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(5, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(0)
    model.load_state_dict(torch.nn.Linear(5, 2).state_dict())
    for step in range(STEPS):
        if step == bad:
            continue
        x, y = _poisoned(step, slice(None))
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_nan_loss_raises_on_every_replica_naming_the_replica_and_step(run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_train, 2, "raise")
    errors = caught.value.errors
    assert [e.rank for e in errors] == [0, 1]
    for error in errors:
        assert error.kind == "NonFiniteError", error
        assert f"at step {BAD_STEP} on replica(s) [1]" in error.message, error.message  # the NaN row is replica 1's


@pytest.mark.parametrize("bad", [BAD_STEP, STEPS - 1])
def test_an_output_judged_a_step_late_still_raises_on_every_replica_naming_its_step(
        run_failing_fast: Callable[..., Any], bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_train, 2, "raise", bad, True)
    errors = caught.value.errors
    assert [e.rank for e in errors] == [0, 1]
    for error in errors:
        assert error.kind == "NonFiniteError", error
        assert f"at step {bad} on replica(s) [1]" in error.message, error.message
    # One replica: the step after the bad one runs (the host did not wait), then the error comes.
    monkeypatch.setattr(health.OutputCheck, "waits_for_a_device", property(lambda self: True))
    ran: list[int] = []
    with pytest.raises(rp.NonFiniteError, match=f"at step {bad} on replica"):
        _train("raise", bad, ran=ran)
    assert ran == list(range(min(bad + 2, STEPS)))


def test_skip_drops_the_update_on_every_replica_like_one_process_would(run_failing_fast: Callable[..., Any]) -> None:
    results = run_failing_fast(_train, 2, "skip")
    torch.manual_seed(0)
    expected = _single_process_skipping(BAD_STEP)
    for result in results:
        assert result["skipped"] == [BAD_STEP]
        # Each update's gradient sums the 8 rows of a batch (4 per replica) through a fan-in of 5, over STEPS updates.
        tolerance = training_bound(torch.float32, expected, 8 + 5 + 3, STEPS)
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert torch.isfinite(got).all()
            assert_within(got, want, tolerance, f"parameter {index}")


def test_one_replica_raises_too() -> None:
    with pytest.raises(rp.NonFiniteError, match=f"at step {BAD_STEP} on replica"):
        _train("raise")


def _diverged_after_scope() -> None:
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if repl.replica_id == 2:
        with torch.no_grad():
            model[1].bias.add_(1.0)  # e.g. a checkpoint loaded on one replica only
    for _ in repl.run(lambda ctx, batch: None, [torch.ones(1)] * 2, progress=False):
        pass


def test_replicas_with_different_parameters_are_refused(run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_diverged_after_scope, 3)
    assert [e.rank for e in caught.value.errors] == [0, 1, 2]
    for error in caught.value.errors:
        assert error.kind == "ReplicaMismatchError"
        assert "replica 2 differs from replica 0 in Sequential.1.bias" in error.message, error.message
        assert "replica 1 differs" not in error.message


def _stalls_after_a_collective(gave_up: str) -> None:
    repl = rp.Replicator()  # debug mode comes from REPLICATOR_DEBUG=1
    with repl.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> None:
        loss = model(batch).pow(2).mean()
        ctx.all_mean(loss.detach())
        if ctx.replica_id == 1 and ctx.step == 1:
            wait_for(gave_up)  # stuck until replica 0 has given up on it, however long the timeout took
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    try:
        for _ in repl.run(step_fn, [torch.ones(2, 3)] * 3, progress=False):
            pass
    finally:
        if repl.replica_id == 0:
            announce(gave_up)


def test_debug_mode_names_where_the_straggler_last_was(tmp_path: Path) -> None:
    # A hang would end in run_replicas' TimeoutError, not in this ReplicaFailure: no clock decides.
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(_stalls_after_a_collective, 2, str(tmp_path / "gave up"), timeout_s=120,
                     env={"REPLICATOR_TIMEOUT": "3", "REPLICATOR_DEBUG": "1"})
    first = next(e for e in caught.value.errors if e.rank == 0)
    assert "rank(s) [1] never arrived" in first.message, first.message
    assert "rank 1's last collective (debug trail)" in first.message and "ctx.all_mean" in first.message, first.message
    assert "test_health.py" in first.message and "in step_fn" in first.message, first.message
    assert "REPLICATOR_DEBUG=1 fingerprints" not in first.message  # it is set: say what it shows instead
    assert {e.rank for e in caught.value.errors} == {0, 1}  # the straggler fails too, once it comes back
