"""Pipelines as exact as the unsplit model: the scenarios of torchgpipe's and torch pipelining's tests.

In-place changes of stage inputs, a layer used twice, dropout streams, gradient clipping,
token-mean losses over padding, timed balance, stages without parameters, and a failure on
one replica of a 2 x 2 job. Through the public API (rp.Replicator, repl.pipeline,
pipe.train_step) in real processes; one launch per world size, read by several tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replicator as rp
from replicator.pipeline import PipelineError
from replicator.testing import run_replicas

from _numerics import small_model_bound

STEPS = 3
# Pipelines against one process on the same batches cut into micro-batches: STEPS steps of a small model.
ATOL = small_model_bound(STEPS)
# The schedules that run on virtual stages or split backwards, each checked in the same jobs:
# (schedule, virtual stages). With V = 2 the two stages hold four pieces, one layer each.
OTHER_SCHEDULES = [("interleaved", 2), ("zero_bubble", 1)]


# -- layers of the scenarios ---------------------------------------------------------------


class SplitMask(nn.Module):
    """(activation, mask): the mask wants no gradient, like torchgpipe's test_inplace's `bar`."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x.detach() > 0).float()


class AddToMaskInPlace(nn.Module):
    """Changes its input that wants no gradient in place: not idempotent, so a repeat shows."""

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        foo, bar = inputs
        bar.add_(1)
        return foo * bar


class ScaleInPlace(nn.Module):
    """Scales its (first-stage) input in place, as a normalising layer written with `mul_` would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


def mask_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 8), SplitMask(), AddToMaskInPlace(), nn.Linear(8, 3)]


def scaling_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [ScaleInPlace(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)]


def mlp_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]


def shared_layers() -> nn.Sequential:
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), shared, nn.Tanh(), shared, nn.Linear(8, 3))


def parameterless_last_stage() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.LogSoftmax(dim=1)]


def token_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Embedding(10, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 10)]


def batch(step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(size, 4, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def padded_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of 2 to 8 tokens padded to 8; the padding's targets are ignore_index (-100)."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 10, (8, 8), generator=generator)
    targets = torch.randint(0, 10, (8, 8), generator=generator)
    lengths = torch.randint(2, 9, (8,), generator=generator)
    targets[torch.arange(8)[None, :] >= lengths[:, None]] = -100
    return tokens, targets


def token_mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100)


def token_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")


def reference(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
              loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
              clip: float | None = None) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, the unsplit model, plain SGD: final state, losses and (with `clip`) gradient norms."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x.clone()), y)  # clone: a layer may change its input in place
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def stage_difference(pipe: Any, state: dict[str, torch.Tensor]) -> float:
    return max((float((v - state[k]).abs().max()) for k, v in pipe.module.state_dict().items()), default=0.0)


# -- 2 processes: two stages of one replica ------------------------------------------------


def train_like_one_process(repl: rp.Replicator, layers: Any, balance: Any,
                           batches: list[tuple[torch.Tensor, torch.Tensor]],
                           loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
                           clip: float | None = None) -> dict[str, Any]:
    """Train a pipeline of `layers` with the documented recipe; compare with the unsplit model."""
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=balance)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    losses, norms = [], []
    for x, y in batches:
        optimizer.zero_grad()
        losses.append(float(pipe.train_step(x, y, loss_fn)))
        if clip is not None:
            norm = repl.clip_grad_norm_(pipe.parameters(), clip)
            assert norm is not None
            norms.append(float(norm))
        optimizer.step()
    unsplit = layers()
    model = unsplit if isinstance(unsplit, nn.Sequential) else nn.Sequential(*unsplit)
    state, expected_losses, expected_norms = reference(model, batches, loss_fn, clip)
    return {
        "param_diff": stage_difference(pipe, state),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, expected_losses, strict=True)),
        "norm_diff": max((abs(a - b) for a, b in zip(norms, expected_norms, strict=True)), default=0.0),
    }


def dropout_masks(repl: rp.Replicator) -> torch.Tensor | None:
    """Which of 1024 ones survive two p = 0.5 dropouts, one per stage (the last stage's view)."""
    # With virtual stages, pieces 0 and 1 (stages 0 and 1) drop; the second chunks pass through.
    layers = [nn.Dropout(0.5), nn.Dropout(0.5)] + [nn.Identity(), nn.Identity()] * (repl.virtual_stages - 1)
    with repl.scope():
        torch.manual_seed(0)  # the same seed on every process, as the docs say
        pipe = repl.pipeline(layers, balance=[1] * len(layers))
    output = pipe.train().eval_step(torch.ones(16, 64))
    return None if output is None else output != 0


def recompute_replays_masks(chunks: int, schedule: str = "gpipe", virtual_stages: int = 1) -> float:
    """Dropout between layers: re-materializing every micro-batch trains exactly as keeping the activations.

    A split backward (zero bubble) re-materializes twice, once per pass: both replay the forward's masks.
    """
    params = []
    for recompute in ("always", "never"):
        repl = rp.Replicator(stages=2, chunks=chunks, recompute=recompute, schedule=schedule,
                             virtual_stages=virtual_stages)
        with repl.scope():
            torch.manual_seed(0)
            pipe = repl.pipeline([nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5),
                                  nn.Linear(16, 3)], balance=[2, 3] if virtual_stages == 1 else [1, 1, 1, 2])
            optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.5))
        for step in range(STEPS):
            optimizer.zero_grad()
            pipe.train_step(*batch(step), F.cross_entropy)
            optimizer.step()
        params.append([p.detach().clone() for p in pipe.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*params, strict=True))


def profiling_keeps_gradients(repl: rp.Replicator) -> bool:
    layers = mlp_layers()
    for layer in layers:
        for param in layer.parameters():
            param.grad = torch.full_like(param, 7.0)
    with repl.scope():
        repl.pipeline(layers, balance="time", sample=batch(0)[0])
    return all(torch.equal(p.grad, torch.full_like(p, 7.0)) for layer in layers for p in layer.parameters()
               if p.grad is not None)


def shared_across_stages(repl: rp.Replicator) -> str:
    try:
        with repl.scope():
            repl.pipeline(shared_layers(), balance=[3, 3])
    except ValueError as error:
        return str(error)
    return "no error"


def dropout_checks(repl: rp.Replicator, replay_schedule: str = "gpipe") -> dict[str, Any]:
    masks, again = dropout_masks(repl), dropout_masks(repl)  # every stage takes part; the last one sees the output
    replayed = recompute_replays_masks(4, replay_schedule, repl.virtual_stages)
    if masks is None or again is None:
        return {"recompute_replays_masks": replayed}
    return {"survivors": float(masks.float().mean()), "reproducible": torch.equal(masks, again),
            "recompute_replays_masks": replayed}


def two_stage_worker() -> dict[str, Any]:
    repl = rp.Replicator(stages=2, chunks=4, schedule="1f1b")  # recompute="except_last", the default
    batches = [batch(step) for step in range(STEPS)]
    padded = [padded_batch(step) for step in range(STEPS)]
    checks: dict[str, Callable[[], Any]] = {
        "inplace_mask": lambda: train_like_one_process(repl, mask_layers, [2, 2], batches),
        "inplace_first_stage": lambda: train_like_one_process(repl, scaling_layers, [2, 2], batches),
        "shared": lambda: train_like_one_process(repl, shared_layers, [2, 4], batches),
        "shared_across_stages": lambda: shared_across_stages(repl),
        "clip": lambda: train_like_one_process(repl, mlp_layers, [2, 3], batches, clip=0.05),
        "no_parameters": lambda: train_like_one_process(repl, parameterless_last_stage, [3, 1], batches,
                                                        loss_fn=F.nll_loss, clip=0.05),
        "padding": lambda: padding_check(repl, padded),
        "dropout": lambda: dropout_checks(repl),
        "profiling_keeps_gradients": lambda: profiling_keeps_gradients(repl),
    }
    for schedule, virtual_stages in OTHER_SCHEDULES:
        checks.update(other_schedule_checks(schedule, virtual_stages, batches, padded))
    results: dict[str, Any] = {"stage": repl.stage_id}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as error:  # one scenario's failure must not hide the others'
            results[name] = f"{type(error).__name__}: {error}"
    return results


def other_schedule_checks(schedule: str, virtual_stages: int, batches: list[tuple[torch.Tensor, torch.Tensor]],
                          padded: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Callable[[], Any]]:
    """Items 1, 3, 5 and 8 of the exactness checks under `schedule`, named "<check> <schedule>"."""
    repl = rp.Replicator(stages=2, chunks=4, schedule=schedule, virtual_stages=virtual_stages)
    halves = [2, 2] if virtual_stages == 1 else [1, 1, 1, 1]  # every model here has four layers
    return {
        f"inplace_mask {schedule}": lambda: train_like_one_process(repl, mask_layers, halves, batches),
        f"no_parameters {schedule}": lambda: train_like_one_process(
            repl, parameterless_last_stage, [3, 1] if virtual_stages == 1 else halves, batches, loss_fn=F.nll_loss,
            clip=0.05),
        f"padding {schedule}": lambda: padding_check(repl, padded, halves),
        f"dropout {schedule}": lambda: dropout_checks(repl, schedule),
    }


def padding_check(repl: rp.Replicator, padded: list[tuple[torch.Tensor, torch.Tensor]],
                  balance: list[int] | None = None) -> dict[str, Any]:
    """Token-mean cross-entropy over padded sequences: sum per micro-batch, divide by the batch's real tokens."""
    with repl.scope():
        pipe = repl.pipeline(token_layers(), balance=balance or [2, 2])
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    losses = []
    for tokens, targets in padded:
        optimizer.zero_grad()
        count = (targets != -100).sum()
        losses.append(float(pipe.train_step(tokens, targets, token_sum, reduction="sum", normalizer=count)))
        optimizer.step()
    state, expected, _ = reference(nn.Sequential(*token_layers()), padded, token_mean)
    tokens, targets = padded[0]
    try:
        pipe.train_step(tokens, targets, token_sum, normalizer=(targets != -100).sum())  # reduction="mean"
        misuse = "no error"
    except PipelineError as error:
        misuse = str(error)
    return {
        "param_diff": stage_difference(pipe, state),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, expected, strict=True)),
        "misuse": misuse,
    }


@pytest.fixture(scope="module")
def two_stages() -> list[dict[str, Any]]:
    return run_replicas(two_stage_worker, 2, timeout_s=240, env={"REPLICATOR_TIMEOUT": "60"})


def _exact(results: list[dict[str, Any]], key: str) -> None:
    for result in results:
        diffs = result[key]
        assert isinstance(diffs, dict), diffs
        assert max(v for k, v in diffs.items() if k.endswith("diff")) < ATOL, (result["stage"], diffs)


OTHER_NAMES = [name for name, _ in OTHER_SCHEDULES]


def test_an_in_place_change_of_an_input_without_gradient_is_not_recomputed_twice(
        two_stages: list[dict[str, Any]]) -> None:
    # torchgpipe's test_inplace_incorrect_grad (a strict xfail there): stage 1 adds 1 to an
    # input that wants no gradient; recomputation added it again, training on `bar + 2`.
    _exact(two_stages, "inplace_mask")


@pytest.mark.parametrize("schedule", OTHER_NAMES)
def test_virtual_and_split_schedules_recompute_in_place_changes_once(two_stages: list[dict[str, Any]],
                                                                     schedule: str) -> None:
    # The same scenario through interleaved chunks (piece 2 on stage 0 changes the mask in place)
    # and zero bubble, whose split backward re-materializes once per pass.
    _exact(two_stages, f"inplace_mask {schedule}")


def test_the_first_stage_may_change_its_micro_batch_in_place(two_stages: list[dict[str, Any]]) -> None:
    # Micro-batches were views of one batch: changing one in place made autograd reject the others.
    _exact(two_stages, "inplace_first_stage")


def test_a_layer_used_twice_stays_in_its_stage(two_stages: list[dict[str, Any]]) -> None:
    _exact(two_stages, "shared")
    for result in two_stages:
        assert "shared by stages 0 and 1" in result["shared_across_stages"], result["shared_across_stages"]
        assert "Keep a layer used twice" in result["shared_across_stages"]


def test_clipping_uses_the_whole_models_norm(two_stages: list[dict[str, Any]]) -> None:
    _exact(two_stages, "clip")
    assert all(r["clip"]["norm_diff"] < ATOL for r in two_stages)


@pytest.mark.parametrize("schedule", [*OTHER_NAMES, ""])
def test_a_stage_without_parameters_follows_the_recipe(two_stages: list[dict[str, Any]], schedule: str) -> None:
    _exact(two_stages, f"no_parameters {schedule}".strip())  # interleaved: stage 1 holds Tanh and LogSoftmax


@pytest.mark.parametrize("schedule", [*OTHER_NAMES, ""])
def test_token_mean_losses_over_padding_match_the_unsplit_batch(two_stages: list[dict[str, Any]],
                                                                schedule: str) -> None:
    key = f"padding {schedule}".strip()
    _exact(two_stages, key)
    for result in two_stages:
        assert 'pass reduction="sum"' in result[key]["misuse"], result[key]["misuse"]


@pytest.mark.parametrize("schedule", [*OTHER_NAMES, ""])
def test_stages_draw_independent_reproducible_dropout_masks(two_stages: list[dict[str, Any]], schedule: str) -> None:
    key = f"dropout {schedule}".strip()
    last = two_stages[-1][key]
    assert isinstance(last, dict), last
    # Two independent p = 0.5 dropouts keep a quarter (one shared stream: a half); 1024 draws.
    assert 0.2 < last["survivors"] < 0.3, last
    assert last["reproducible"] is True
    assert all(r[key]["recompute_replays_masks"] < ATOL for r in two_stages)


def test_timed_balance_leaves_gradients_as_they_were(two_stages: list[dict[str, Any]]) -> None:
    assert [r["profiling_keeps_gradients"] for r in two_stages] == [True, True]


# -- 4 processes: two replicas of two stages -----------------------------------------------


def per_sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")  # not a scalar: the step fails


FAILING_REPLICAS = [{1}, {0, 1}, set(), set()]  # per step: the replicas whose loss_fn is wrong


def train_through_failures(repl: rp.Replicator, balance: list[int]) -> dict[str, Any]:
    """FAILING_REPLICAS' steps, logging failures and going on; the result against one process's training."""
    with repl.scope():
        pipe = repl.pipeline(mlp_layers(), balance=balance)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    mine = slice(8 * repl.replica_id, 8 * (repl.replica_id + 1))
    errors: list[str | None] = []
    for step, failing in enumerate(FAILING_REPLICAS):
        x, y = batch(step)
        optimizer.zero_grad()
        try:
            pipe.train_step(x[mine], y[mine], per_sample_loss if repl.replica_id in failing else F.cross_entropy)
            optimizer.step()
            errors.append(None)
        except Exception as error:  # a researcher's loop that logs the failure and goes on
            errors.append(f"{type(error).__name__}: {error}")
    state, _, _ = reference(nn.Sequential(*mlp_layers()), [batch(s) for s, f in enumerate(FAILING_REPLICAS) if not f])
    return {"errors": errors, "param_diff": stage_difference(pipe, state)}


def replicated_worker() -> dict[str, Any]:
    repl = rp.Replicator(stages=2, chunks=2)
    results = {"stage": repl.stage_id, "replica": repl.replica_id, **train_through_failures(repl, [2, 3]),
               "masks": dropout_masks(repl), "no_parameters": replicated_stage_without_parameters(repl)}
    for schedule, virtual_stages in OTHER_SCHEDULES:
        other = rp.Replicator(stages=2, chunks=2, schedule=schedule, virtual_stages=virtual_stages)
        results[schedule] = train_through_failures(other, [2, 3] if virtual_stages == 1 else [1, 1, 1, 2])
    return results


def replicated_stage_without_parameters(repl: rp.Replicator) -> float:
    """The recipe on a last stage without parameters, with replicas and clipping: as one process would train."""
    with repl.scope():
        pipe = repl.pipeline(parameterless_last_stage(), balance=[3, 1])
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    mine = slice(8 * repl.replica_id, 8 * (repl.replica_id + 1))
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        pipe.train_step(x[mine], y[mine], F.nll_loss)
        repl.clip_grad_norm_(pipe.parameters(), 0.05)
        optimizer.step()
    state, _, _ = reference(nn.Sequential(*parameterless_last_stage()), [batch(s) for s in range(STEPS)],
                            F.nll_loss, clip=0.05)
    return stage_difference(pipe, state)


@pytest.fixture(scope="module")
def two_by_two() -> list[dict[str, Any]]:
    return run_replicas(replicated_worker, 4, timeout_s=240, env={"REPLICATOR_TIMEOUT": "30"})


@pytest.mark.parametrize("schedule", ["", *OTHER_NAMES])
def test_a_failure_on_one_replica_leaves_the_replicas_in_step(two_by_two: list[dict[str, Any]],
                                                              schedule: str) -> None:
    runs = [r[schedule] if schedule else r for r in two_by_two]
    for run in runs:
        # Every process raised the same error for the failed steps and went on to train as one process would.
        assert run["errors"][2:] == [None, None]
        assert run["errors"][:2] == runs[0]["errors"][:2]
        assert run["param_diff"] < ATOL, run
    mixed, alike = runs[0]["errors"][:2]
    assert mixed.startswith("PipelineError: pipeline step failed on replica(s) 1: stage 1 of 2 failed: ValueError: "
                            "loss_fn must return a scalar"), mixed
    assert "succeeded on replica(s) 0" in mixed and "dropped this step's gradient averaging" in mixed
    assert "failed on every replica alike" in alike and "loss_fn must return a scalar" in alike, alike


def test_replicated_stages_without_parameters_clip_and_train_like_one_process(
        two_by_two: list[dict[str, Any]]) -> None:
    assert all(r["no_parameters"] < ATOL for r in two_by_two), [r["no_parameters"] for r in two_by_two]


def test_replicas_draw_their_own_dropout_masks(two_by_two: list[dict[str, Any]]) -> None:
    masks = [r["masks"] for r in two_by_two if r["stage"] == 1]
    assert len(masks) == 2 and not torch.equal(masks[0], masks[1])
    assert all(0.2 < float(m.float().mean()) < 0.3 for m in masks)
