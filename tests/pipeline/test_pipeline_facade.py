"""Replicator(stages=K, chunks=M): replicas × stages through the facade equal one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

from _numerics import assert_within, small_model_bound

GLOBAL_BATCH, STEPS, BALANCE = 16, 3, [2, 3]


def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)  # every process builds the same whole model; each keeps its stage
    return [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def replica_stage(schedule: str) -> tuple[int, list[torch.Tensor], list[float]]:
    repl = rp.Replicator(stages=2, chunks=2, schedule=schedule)
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=BALANCE)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9))

    def input_fn(ctx: rp.InputContext):
        share = ctx.per_replica_batch_size(GLOBAL_BATCH)
        for step in range(STEPS):
            x, y = batch(step)
            mine = slice(ctx.replica_id * share, (ctx.replica_id + 1) * share)
            yield x[mine], y[mine]

    def step_fn(ctx: rp.ReplicaContext, data):
        optimizer.zero_grad()
        loss = pipe.train_step(data[0], data[1], F.cross_entropy)
        optimizer.step()
        return ctx.all_mean(loss)

    losses = [float(loss) for _, loss in repl.run(step_fn, repl.prepare_input(input_fn))]
    return repl.stage_id, [p.detach().clone() for p in pipe.parameters()], losses


@pytest.mark.numerics  # micro-batches of 4 against 16 rows
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_replicas_by_two_stages_match_one_process(schedule: str) -> None:
    model = torch.nn.Sequential(*layers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expected_losses = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        expected_losses.append(float(loss.detach()))
    stage_params = [list(model[:2].parameters()), list(model[2:].parameters())]
    for stage, params, losses in run_replicas(replica_stage, 4, schedule, timeout_s=180):
        # The same global batches, cut into 2 replicas x 2 micro-batches: a small model's training bound.
        assert_within(torch.tensor(losses), torch.tensor(expected_losses), small_model_bound(STEPS), "losses")
        for index, (got, want) in enumerate(zip(params, stage_params[stage], strict=True)):
            assert_within(got, want.detach(), small_model_bound(STEPS), f"stage {stage} parameter {index}")


def wrong_stage_count() -> None:
    rp.Replicator(stages=3)


def test_stages_that_do_not_divide_the_world_fail_everywhere() -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(wrong_stage_count, 2, timeout_s=60)
    assert [e.rank for e in caught.value.errors] == [0, 1]
    assert all("stages=3 does not divide the world size 2" in e.message for e in caught.value.errors)


def one_replica_has_a_bad_loss() -> None:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=BALANCE)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    x, y = batch(0)
    # Replica 1's loss is per sample (reduction="none"): not a scalar.
    loss_fn = (lambda out, t: F.cross_entropy(out, t, reduction="none")) if repl.replica_id == 1 else F.cross_entropy
    optimizer.zero_grad()
    pipe.train_step(x[:8], y[:8], loss_fn)
    optimizer.step()


def test_a_pipeline_failure_on_one_replica_fails_every_replica() -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(one_replica_has_a_bad_loss, 4, timeout_s=90, env={"REPLICATOR_TIMEOUT": "60"})
    errors = caught.value.errors
    assert [e.rank for e in errors] == [0, 1, 2, 3], caught.value
    for error in errors:
        assert error.kind == "PipelineError", error
        assert "pipeline step failed on replica(s) 1: stage 1 of 2 failed: ValueError" in error.message, error
        assert "succeeded on replica(s) 0" in error.message, error


def stage_with_a_nan_gradient() -> tuple[int, list[int], list[torch.Tensor], list[torch.Tensor]]:
    repl = rp.Replicator(stages=2, chunks=2, nonfinite="skip")
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=BALANCE)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    poisoned = {"step": -1}
    if repl.stage_id == 1:  # a NaN in one weight's gradient of the last stage only, at step 1
        weight = next(pipe.parameters())
        weight.register_hook(lambda grad: grad * float("nan") if poisoned["step"] == 1 else grad)

    def step_fn(ctx: rp.ReplicaContext, data):
        poisoned["step"] = ctx.step
        optimizer.zero_grad()
        pipe.train_step(data[0], data[1], F.cross_entropy)
        optimizer.step()

    snapshots = []
    for _ in repl.run(step_fn, [batch(step) for step in range(3)]):
        snapshots.append([p.detach().clone() for p in pipe.parameters()])
    return repl.stage_id, repl.last_run["skipped_steps"], snapshots[0], snapshots[1]


def test_a_nan_gradient_on_one_stage_skips_the_update_on_every_stage() -> None:
    # One process skips the whole model's update when any gradient is NaN (nonfinite="skip"); so must every stage,
    # not only the one that held the NaN (stage 0 used to update alone and the model came apart).
    for stage, skipped, after_step_0, after_step_1 in run_replicas(stage_with_a_nan_gradient, 2, timeout_s=120):
        assert skipped == [1], (stage, skipped)
        for before, after in zip(after_step_0, after_step_1, strict=True):
            assert torch.equal(before, after), f"stage {stage} updated at the skipped step"
