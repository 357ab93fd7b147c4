"""A call that only some replicas make fails within seconds on every replica, on every transport, naming it."""

from __future__ import annotations

import contextlib
import inspect
import io
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas
from replicator.testing.processes import RankError

# A hang would wait this long for its collectives, longer than the harness waits for the whole run (HARNESS_S): a
# library that waited for its timeout ends in run_replicas' TimeoutError, not the ReplicaFailure these tests
# expect, whatever the machine's load. No clock in the verdict: the harness's limit is only a hang guard.
COLLECTIVE_TIMEOUT_S = 900
HARNESS_S = 240
TRANSPORTS = [pytest.param("1", id="local-link"), pytest.param("0", id="gloo")]


def line_of(marker: str) -> str:
    """'test_one_sided.py:N' for the line of this file that carries `marker` (a comment)."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()  # type: ignore[arg-type]
    number = next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}"))
    return f"test_one_sided.py:{number}"


def fail(fn: Any, replicas: int, link: str, *args: Any) -> list[RankError]:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(fn, replicas, *args, timeout_s=HARNESS_S,
                     env={"REPLICATOR_TIMEOUT": str(COLLECTIVE_TIMEOUT_S), "REPLICATOR_LOCAL_LINK": link})
    return caught.value.errors


def tiny_setup() -> tuple[rp.Replicator, torch.nn.Module, torch.optim.Optimizer]:
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return repl, model, optimizer


def save_on_main_only(directory: str) -> None:
    repl, model, optimizer = tiny_setup()

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for step, _ in repl.run(step_fn, [torch.ones(2, 3)] * 6, progress=False):  # the loop
        if step == 2 and repl.is_main:
            repl.save(os.path.join(directory, "checkpoint"))  # save on main


@pytest.mark.parametrize("link", TRANSPORTS)
def test_save_on_the_main_replica_only_fails_fast_naming_save(link: str, tmp_path: Any) -> None:
    errors = fail(save_on_main_only, 2, link, str(tmp_path))
    assert [e.rank for e in errors] == [0, 1]
    for error in errors:
        assert error.kind == "ReplicaMismatchError", error
        assert "repl.save() must be called on every replica" in error.message, error.message
        assert f"replica(s) 0: repl.save() at step 3 at {line_of('save on main')}" in error.message, error.message
        assert f"replica(s) 1: run() at step 3, announcing step 4 at {line_of('the loop')}" in error.message


def barrier_after_training_on_main_only() -> None:
    repl, model, _ = tiny_setup()
    for _ in repl.run(lambda ctx, batch: model(batch).sum().detach(), [torch.ones(2, 3)] * 2, progress=False):
        pass
    if repl.is_main:
        repl.barrier()  # barrier on main
    repl.close()  # what the end of the script does on the others


@pytest.mark.parametrize("link", TRANSPORTS)
def test_a_verb_on_one_replica_after_training_names_the_replicas_that_left(link: str) -> None:
    errors = fail(barrier_after_training_on_main_only, 2, link)
    assert [e.rank for e in errors] == [0]  # replica 1 only leaves; it says why on its stderr
    assert "repl.barrier() must be called on every replica" in errors[0].message, errors[0].message
    assert f"replica(s) 0: repl.barrier() at step 2 at {line_of('barrier on main')}" in errors[0].message
    assert "replica(s) 1: the end of the job" in errors[0].message, errors[0].message


def collective_without_backward() -> None:
    repl, model, _ = tiny_setup()

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).pow(2).mean().detach()
        if ctx.replica_id == 0 and ctx.step == 1:
            ctx.all_sum(loss)  # one-sided
        return loss  # no gradient sync follows: only the next step's check can meet the stray call

    for _ in repl.run(step_fn, [torch.ones(2, 3)] * 4, progress=False):  # evaluation loop
        pass


@pytest.mark.parametrize("link", TRANSPORTS)
def test_a_ctx_collective_on_some_replicas_fails_fast_on_every_transport(link: str) -> None:
    errors = fail(collective_without_backward, 2, link)
    assert [e.rank for e in errors] == [0, 1]
    for error in errors:
        assert error.kind == "ReplicaMismatchError", error
        assert f"replica(s) 0: ctx.all_sum#1 shape=() dtype=torch.float32 device=cpu at {line_of('one-sided')}" \
            in error.message, error.message
        assert f"replica(s) 1: run() at step 2, announcing step 3 at {line_of('evaluation loop')}" in error.message


def stray_collective_before_a_shared_one() -> None:
    repl, model, optimizer = tiny_setup()

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).pow(2).mean()
        if ctx.replica_id == 0 and ctx.step == 1:
            ctx.all_mean(loss.detach())  # stray
        mean = ctx.all_mean(loss.detach())  # shared
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return mean

    for _ in repl.run(step_fn, [torch.ones(2, 3)] * 3, progress=False):
        pass


def test_a_stray_collective_is_blamed_on_its_own_line() -> None:
    # Same operation, shape and sequence number as replica 1's legitimate call: only the site tells them apart.
    errors = fail(stray_collective_before_a_shared_one, 2, "1")
    assert [e.rank for e in errors] == [0, 1]
    for error in errors:
        assert f"replica(s) 0: ctx.all_mean#2 shape=() dtype=torch.float32 device=cpu at {line_of('stray')}" \
            in error.message, error.message
        assert f"replica(s) 1: ctx.all_mean#2 shape=() dtype=torch.float32 device=cpu at {line_of('shared')}" \
            in error.message, error.message


def pipeline_with_a_stray_collective() -> None:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        torch.manual_seed(0)
        pipe = repl.pipeline([torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)], balance=[2, 1])
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, data: tuple[torch.Tensor, torch.Tensor]) -> Any:
        optimizer.zero_grad()
        loss = pipe.train_step(data[0], data[1], F.cross_entropy)
        optimizer.step()
        if ctx.replica_id == 0 and ctx.step == 1 and repl.stage_id == 1:
            ctx.all_sum(torch.ones(1))  # one stage, one replica
        return loss

    batch = (torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0]))
    for _ in repl.run(step_fn, [batch] * 4, progress=False):
        pass


@pytest.mark.parametrize("link", TRANSPORTS)
def test_a_ctx_collective_on_one_stage_of_one_replica_fails_fast(link: str) -> None:
    # Ranks 1 and 3 are stage 1 of replicas 0 and 1: they name the call. Stage 0 learns of it when
    # its partner in the pipeline leaves (the transport's error), also within seconds.
    errors = fail(pipeline_with_a_stray_collective, 4, link)
    assert [e.rank for e in errors] == [0, 1, 2, 3]
    for error in (e for e in errors if e.rank in (1, 3)):
        assert error.kind == "ReplicaMismatchError", error
        stray = line_of("one stage, one replica")
        assert f"replica(s) 0: ctx.all_sum#1 shape=(1,) dtype=torch.float32 device=cpu at {stray}" in error.message


def debug_mode_banner() -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rp.Replicator()
    return printed.getvalue()


def test_debug_mode_says_so_once_on_the_main_process() -> None:
    said = run_replicas(debug_mode_banner, 2, timeout_s=60, env={"REPLICATOR_DEBUG": "1"})
    assert "debug mode is on" in said[0] and "debug mode is on" not in said[1]
    quiet = run_replicas(debug_mode_banner, 2, timeout_s=60)
    assert "debug mode" not in quiet[0]
