"""Pipelines x sharding: stages=2 with every shard level, bit for bit what shard=None gives, one reduction per step.

Why bit for bit against shard=None at the same stages and replicas: every level cuts the same
model into the same stages and micro-batches, so each stage's accumulated gradient is the same
arithmetic; the levels differ only in how the two replicas of a stage average it and who steps
it. "optimizer" and "gradients" reduce every bucket with the same reducer as shard=None (the
same additions in the same order) and apply the optimizer's element-wise update to slices of
the same average. "parameters" reduce-scatters with FSDP2, whose average over 2 replicas is
(a + b) / 2 where the synchronizer sums a / 2 + b / 2: equal in binary floating point (halving
is exact for these normal numbers), and the optimizer's update on a shard is the same
element-wise arithmetic.

Once per step: each level's reduction is counted by the collective it calls (a reducer of our
own for the synchronizer's buckets, FSDP2's custom all-gather and reduce-scatter hooks for its
units), never by time. Without the pipeline's care each micro-batch's backward would reduce
again (CHUNKS times per step), and FSDP2 would gather each unit in every micro-batch's forward.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import replicator as rp
from replicator._torch_names import fsdp_param_groups
from replicator.testing import run_replicas

GLOBAL_BATCH, CHUNKS, STEPS = 16, 2, 3
LEVELS = (None, "optimizer", "gradients", "parameters")
SGD_LR, MAX_NORM, EPS = 0.1, 0.05, torch.finfo(torch.float32).eps
ELEMENTS = 16 * 6 + 16 + 16 * 16 + 16 + 3 * 16 + 3  # the whole model's, which the clipping norm sums over


def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)  # every process builds the same whole model; each keeps its stage
    return [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


class CountingReducer:
    """The flat reducer (one all-reduce per bucket), counting the buckets it reduces."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def reduce(self, buffer: torch.Tensor, group: dist.ProcessGroup, bucket: Any = None) -> Any:
        self.calls += 1
        return dist.all_reduce(buffer, group=group, async_op=True)


class Counted:
    """A unit's collective (FSDP2's own, or one replicator plugged in), counted as it is called."""

    def __init__(self, inner: Any, counts: dict[str, int], key: str) -> None:
        self.inner, self.counts, self.key = inner, counts, key

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.counts[self.key] += 1
        return self.inner(*args, **kwargs)


def count_collectives(unit: FSDPModule, counts: dict[str, int]) -> None:
    """Wrap the unit's all-gather and reduce-scatter in counters (FSDP2 keeps them on its parameter group)."""
    group = fully_shard.state(unit)._fsdp_param_group  # type: ignore[attr-defined]
    unit.set_custom_all_gather(Counted(group._all_gather_comm, counts, "all_gather"))  # type: ignore[arg-type]
    unit.set_custom_reduce_scatter(Counted(group._reduce_scatter_comm, counts, "reduce_scatter"))  # type: ignore


def whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


SCHEDULES = {"gpipe": (1, [2, 3]), "1f1b": (1, [2, 3]), "zero_bubble": (1, [2, 3]),
             "interleaved": (2, [1, 2, 1, 1])}  # schedule: virtual stages, balance


def train(level: str | None, kind: str, schedule: str, clip: bool = False) -> dict[str, Any]:
    """Inside a replica: 3 steps of a 2-stage pipeline over 2 replicas at one shard level (clipped: by `MAX_NORM`)."""
    virtual_stages, balance = SCHEDULES[schedule]
    reducer = CountingReducer()
    # One parameter per bucket (a cap of one byte): the buckets reduced per step are the stage's parameters.
    repl = rp.Replicator(stages=2, chunks=CHUNKS, schedule=schedule, virtual_stages=virtual_stages, shard=level,
                         bucket_cap_mb=1e-6, reducer=reducer)
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=balance)
        optimizer = repl.wrap_optimizer(make_optimizer(kind, pipe.parameters()))
    counts = {"all_gather": 0, "reduce_scatter": 0}
    units = [m for m in pipe.module.modules() if isinstance(m, FSDPModule) and any(True for _ in m.parameters(False))]
    for unit in units:
        count_collectives(unit, counts)
    per_step: list[dict[str, int]] = []
    norms: list[float] = []
    sharded_in_forward: set[bool] = set()  # were any of the stage's parameters sharded while a layer ran?
    for layer in pipe.module.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_pre_hook(lambda module, args: sharded_in_forward.add(
                any(isinstance(p, DTensor) for p in pipe.module.parameters())))

    def step_fn(ctx: rp.ReplicaContext, data: Any) -> Any:
        before = {"buckets": reducer.calls, **counts}
        optimizer.zero_grad()
        loss = pipe.train_step(data[0], data[1], F.cross_entropy)
        if clip:
            norms.append(float(repl.clip_grad_norm_(pipe.parameters(), MAX_NORM)))
        optimizer.step()
        after = {"buckets": reducer.calls, **counts}
        per_step.append({key: after[key] - before[key] for key in after})
        return ctx.all_mean(loss)

    def input_fn(ctx: rp.InputContext):
        share = ctx.per_replica_batch_size(GLOBAL_BATCH)
        for step in range(STEPS):
            x, y = batch(step)
            mine = slice(ctx.replica_id * share, (ctx.replica_id + 1) * share)
            yield x[mine], y[mine]

    losses = [float(loss) for _, loss in repl.run(step_fn, repl.prepare_input(input_fn), record=False)]
    params = list(pipe.parameters())
    result = {"stage": repl.stage_id, "params": [whole(p) for p in params], "losses": losses, "norms": norms,
              "per_step": per_step, "trainable": len(params), "units": len(units),
              "sharded_in_forward": sharded_in_forward,
              "sharded_after": [isinstance(p, DTensor) for p in pipe.module.parameters()]}
    repl.close()
    return result


def train_levels(kind: str, schedule: str, clip: bool = False) -> dict[str | None, dict[str, Any]]:
    return {level: train(level, kind, schedule, clip) for level in LEVELS}


@pytest.mark.parametrize(("kind", "schedule"), [("sgd", "gpipe"), ("adamw", "1f1b"), ("adamw", "zero_bubble"),
                                                ("sgd", "interleaved")])
def test_every_shard_level_with_stages_is_shard_none_bit_for_bit_reduced_once_per_step(kind: str,
                                                                                      schedule: str) -> None:
    for rank, runs in enumerate(run_replicas(train_levels, 4, kind, schedule, timeout_s=240)):
        plain = runs[None]
        for level in LEVELS[1:]:
            run, where = runs[level], f"rank {rank} (stage {runs[level]['stage']}), shard={level!r}"
            assert run["losses"] == plain["losses"], where
            for index, (got, want) in enumerate(zip(run["params"], plain["params"], strict=True)):
                assert torch.equal(got, want), (where, index, float((got - want).abs().max()))
        for level in LEVELS[:3]:  # the synchronizer's buckets: each reduced once per step, not once per micro-batch
            assert runs[level]["per_step"] == [{"buckets": runs[level]["trainable"], "all_gather": 0,
                                                "reduce_scatter": 0}] * STEPS, (rank, level)
        zero3 = runs["parameters"]
        # FSDP2's units: each gathered once and reduce-scattered once per step (plain FSDP2 would gather in every
        # micro-batch's forward and reduce-scatter after every micro-batch's backward: CHUNKS times).
        assert zero3["units"] >= 1 and zero3["per_step"] == [
            {"buckets": 0, "all_gather": zero3["units"], "reduce_scatter": zero3["units"]}] * STEPS, rank
        assert zero3["sharded_in_forward"] == {False}, rank  # gathered through the step's micro-batches
        assert all(zero3["sharded_after"]), rank  # and resharded after it


def test_clipping_with_stages_clips_by_the_whole_models_norm_at_every_level() -> None:
    # shard=None: each stage's norm of its averaged gradients, combined over the stages. "optimizer" holds the same
    # averaged gradients: the same norm, bit for bit. "gradients" sums it from each replica's slices, "parameters"
    # from each replica's FSDP2 shards, then over the stages: the same sum of squares grouped otherwise, so the norm
    # and the clip factor may differ in their last bits, relative <= ELEMENTS * eps. A clipped SGD step with
    # momentum 0.9 moves a parameter by at most SGD_LR * 10 * MAX_NORM <= SGD_LR: STEPS steps, each off by at most
    # that relative error, bound the parameters' difference.
    atol = STEPS * SGD_LR * ELEMENTS * EPS
    for rank, runs in enumerate(run_replicas(train_levels, 4, "sgd", "gpipe", True, timeout_s=240)):
        plain = runs[None]
        assert all(norm > MAX_NORM for norm in plain["norms"]), plain["norms"]  # clipping is active
        assert runs["optimizer"]["norms"] == plain["norms"], rank
        assert all(torch.equal(g, w) for g, w in zip(runs["optimizer"]["params"], plain["params"], strict=True))
        for level in ("gradients", "parameters"):
            run, where = runs[level], f"rank {rank} (stage {runs[level]['stage']}), shard={level!r}"
            assert run["norms"] == pytest.approx(plain["norms"], rel=ELEMENTS * EPS, abs=0), where
            for got, want in zip(run["params"], plain["params"], strict=True):
                assert torch.allclose(got, want, rtol=0, atol=atol), (where, float((got - want).abs().max()))


def fail_once_then_train(level: str | None) -> tuple[int, list[str], list[torch.Tensor]]:
    """Inside a replica: 3 steps outside run(); at step 1 replica 1's loss is not a scalar, so that step fails."""
    repl = rp.Replicator(stages=2, chunks=CHUNKS, shard=level)
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=[2, 3])
        optimizer = repl.wrap_optimizer(make_optimizer("sgd", pipe.parameters()))
    outcomes = []
    share = GLOBAL_BATCH // repl.num_replicas
    for step in range(3):
        x, y = batch(step)
        mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
        failing = step == 1 and repl.replica_id == 1
        loss_fn = (lambda out, t: F.cross_entropy(out, t, reduction="none")) if failing else F.cross_entropy
        optimizer.zero_grad()
        try:
            pipe.train_step(x[mine], y[mine], loss_fn)
        except rp.pipeline.PipelineError as error:
            outcomes.append(type(error).__name__)
            continue
        optimizer.step()
        outcomes.append("stepped")
    result = repl.stage_id, outcomes, [whole(p) for p in pipe.parameters()]
    repl.close()
    return result


def fail_once_at_every_level() -> dict[str | None, tuple[int, list[str], list[torch.Tensor]]]:
    return {level: fail_once_then_train(level) for level in LEVELS}


def test_a_step_failing_on_one_replica_fails_on_all_and_the_next_step_starts_clean_at_every_level() -> None:
    # The failed step's gradients are dropped alike everywhere (the synchronizer's buckets, or FSDP2's gathered units
    # and their accumulated gradients, with no collective), so the next step is the same arithmetic as shard=None's.
    for rank, runs in enumerate(run_replicas(fail_once_at_every_level, 4, timeout_s=240)):
        _, _, plain = runs[None]
        for level, (stage, outcomes, params) in runs.items():
            assert outcomes == ["stepped", "PipelineError", "stepped"], (rank, level, outcomes)
            assert all(torch.equal(g, w) for g, w in zip(params, plain, strict=True)), (rank, stage, level)


def skip_and_evaluate(level: str | None) -> dict[str, Any]:
    """Inside a replica, the default reducer: at step 1 the last stage's loss makes one of its weights' gradient NaN
    (on replica 1 only, not through the activations: stage 0's gradients stay finite); then an evaluation step."""
    repl = rp.Replicator(stages=2, chunks=CHUNKS, schedule="1f1b", shard=level, nonfinite="skip")
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=[2, 3])
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", pipe.parameters()))

    def step_fn(ctx: rp.ReplicaContext, data: Any) -> Any:
        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(output, target)
            if ctx.step == 1 and ctx.replica_id == 1:  # the weight FSDP2 gathered for this step, if sharded
                loss = loss + float("nan") * pipe.module[2].weight.sum()
            return loss

        optimizer.zero_grad()
        pipe.train_step(data[0], data[1], loss_fn)
        optimizer.step()

    share = GLOBAL_BATCH // repl.num_replicas
    mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    for _ in repl.run(step_fn, [(x[mine], y[mine]) for x, y in map(batch, range(STEPS))], record=False):
        pass
    output = pipe.eval_step(batch(STEPS)[0][mine])
    result = {"stage": repl.stage_id, "skipped": list(repl.skipped_steps), "output": output,
              "params": [whole(p) for p in pipe.parameters()]}
    repl.close()
    return result


def skip_and_evaluate_at_every_level() -> dict[str | None, dict[str, Any]]:
    return {level: skip_and_evaluate(level) for level in LEVELS}


def test_a_nan_gradient_on_one_stage_skips_the_update_on_every_stage_at_every_level() -> None:
    # One process skips the whole model's update; so must both stages at every level, though only stage 1 saw the
    # NaN (in a slice of one replica, or a shard). The default reducer (shared memory: "gradients" stops each bucket
    # after its scatter) gives the same bits as shard=None, and so does an evaluation step afterwards.
    for rank, runs in enumerate(run_replicas(skip_and_evaluate_at_every_level, 4, timeout_s=240)):
        plain = runs[None]
        for level, run in runs.items():
            where = f"rank {rank} (stage {run['stage']}), shard={level!r}"
            assert run["skipped"] == [1], where
            assert all(torch.equal(g, w) for g, w in zip(run["params"], plain["params"], strict=True)), where
            if run["stage"] == 1:
                assert torch.equal(run["output"], plain["output"]), where


def stage_without_parameters(level: str | None) -> tuple[int, list[torch.Tensor]]:
    """Inside a replica: stage 0 is a ReLU alone (its optimizer gets the stage's empty placeholder parameter)."""
    repl = rp.Replicator(stages=2, chunks=CHUNKS, shard=level)
    with repl.scope():
        pipe = repl.pipeline([torch.nn.ReLU(), *layers()], balance=[1, 5])
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", pipe.parameters()))
    x, y = batch(0)
    share = GLOBAL_BATCH // repl.num_replicas
    mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    for _ in range(2):
        optimizer.zero_grad()
        pipe.train_step(x[mine], y[mine], F.cross_entropy)
        optimizer.step()
    result = repl.stage_id, [whole(p) for p in pipe.parameters()]
    repl.close()
    return result


def stage_without_parameters_at_every_level() -> dict[str | None, tuple[int, list[torch.Tensor]]]:
    return {level: stage_without_parameters(level) for level in LEVELS}


def test_a_stage_without_parameters_trains_at_every_level() -> None:
    # With "parameters" the empty stage has no FSDP2 unit: its micro-batches must not ask the synchronizer for
    # no_sync() (refused with "parameters"), and its placeholder has nothing to shard.
    for rank, runs in enumerate(run_replicas(stage_without_parameters_at_every_level, 4, timeout_s=240)):
        _, plain = runs[None]
        for level, (stage, params) in runs.items():
            assert all(torch.equal(g, w) for g, w in zip(params, plain, strict=True)), (rank, stage, level)


def train_around_a_checkpoint(level: str | None, path: str, save: bool) -> list[torch.Tensor]:
    """Inside a replica: 2 steps then save (`save`), or restore; then steps 2 and 3. The parameters at the end."""
    repl = rp.Replicator(stages=2, chunks=CHUNKS, shard=level)
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=[2, 3])
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", pipe.parameters()))

    def step_fn(ctx: rp.ReplicaContext, data: Any) -> None:
        optimizer.zero_grad()
        pipe.train_step(data[0], data[1], F.cross_entropy)
        optimizer.step()

    share = GLOBAL_BATCH // repl.num_replicas
    mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    batches = [(x[mine], y[mine]) for x, y in map(batch, range(4))]
    if save:
        for _ in repl.run(step_fn, batches[:2], record=False, progress=False):
            pass
        repl.save(path)
    else:
        repl.restore(path)
    for _ in repl.run(step_fn, batches[2:], steps=4, record=False, progress=False):
        pass
    params = [whole(p) for p in pipe.parameters()]
    repl.close()
    return params


def save_then_resume(saved_at: str | None, resumed_at: str | None, root: str) -> bool:
    """Inside a replica: is a run resumed at another shard level bit for bit the uninterrupted one?"""
    path = os.path.join(root, "checkpoint")
    uninterrupted = train_around_a_checkpoint(saved_at, path, save=True)
    resumed = train_around_a_checkpoint(resumed_at, path, save=False)
    return all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True))


@pytest.mark.parametrize(("saved_at", "resumed_at"), [("parameters", None), ("gradients", "parameters")])
def test_a_sharded_pipelines_checkpoint_resumes_bit_for_bit_at_another_level(saved_at: str, resumed_at: str | None,
                                                                            ) -> None:
    # Each stage's checkpoint holds its whole, layout-free state (gathered slices, or DTensor shards with their
    # global layout), so a run resumed at another shard level takes the same steps as the uninterrupted one.
    with tempfile.TemporaryDirectory() as root:
        assert run_replicas(save_then_resume, 4, saved_at, resumed_at, root, timeout_s=240) == [True] * 4


def accumulate_or_autocast(level: str | None, precision: str, accumulation: int) -> list[torch.Tensor]:
    """Inside a replica: 4 steps of the pipeline at one shard level, with an accumulation window or a precision."""
    repl = rp.Replicator(stages=2, chunks=CHUNKS, shard=level, precision=precision)
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=[2, 3])
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", pipe.parameters()))
    repl.accumulate(accumulation)

    def step_fn(ctx: rp.ReplicaContext, data: Any) -> None:
        optimizer.zero_grad()
        pipe.train_step(data[0], data[1], F.cross_entropy)
        optimizer.step()

    share = GLOBAL_BATCH // repl.num_replicas
    mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    for _ in repl.run(step_fn, [(x[mine], y[mine]) for x, y in map(batch, range(4))], record=False, progress=False):
        pass
    params = [whole(p) for p in pipe.parameters()]
    repl.close()
    return params


# (precision, accumulation): the levels that take it. "parameters" refuses accumulate(n > 1) and fp16, with or without
# stages (FSDP2 reduce-scatters every backward pass outside a pipeline; no sharded loss scale exists).
OPTIONS = {("fp32", 2): LEVELS[:3], ("fp16", 1): LEVELS[:3], ("bf16", 1): LEVELS}


def accumulate_or_autocast_at_every_level() -> dict[tuple[str, int, str | None], list[torch.Tensor]]:
    return {(precision, accumulation, level): accumulate_or_autocast(level, precision, accumulation)
            for (precision, accumulation), levels in OPTIONS.items() for level in levels}


def test_accumulation_and_precisions_with_stages_keep_every_level_bit_for_bit_shard_none() -> None:
    # accumulate(2): the stage's micro-batches and the window's steps all accumulate before the one reduction;
    # fp16: the loss scale's verdict spans the stages and replicas as without sharding; bf16: autocast alike.
    for rank, runs in enumerate(run_replicas(accumulate_or_autocast_at_every_level, 4, timeout_s=240)):
        for (precision, accumulation), levels in OPTIONS.items():
            plain = runs[(precision, accumulation, None)]
            for level in levels[1:]:
                got = runs[(precision, accumulation, level)]
                assert all(torch.equal(g, w) for g, w in zip(got, plain, strict=True)), (rank, precision, level)


def built_on_meta(level: str | None, meta: bool) -> list[torch.Tensor]:
    """Inside a replica: the model built on the meta device (or whole), cut into stages, 2 steps at one level."""
    repl = rp.Replicator(stages=2, chunks=CHUNKS, shard=level)
    with repl.scope():
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = layers()
        pipe = repl.pipeline(model, balance=[2, 3])  # this stage's layers get values: a whole build's
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", pipe.parameters()))
    share = GLOBAL_BATCH // repl.num_replicas
    mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    for step in range(2):
        x, y = batch(step)
        optimizer.zero_grad()
        pipe.train_step(x[mine], y[mine], F.cross_entropy)
        optimizer.step()
    params = [whole(p) for p in pipe.parameters()]
    repl.close()
    return params


def built_on_meta_or_whole() -> dict[tuple[str | None, bool], list[torch.Tensor]]:
    return {(level, meta): built_on_meta(level, meta) for level in (None, "parameters") for meta in (False, True)}


def test_a_model_built_on_meta_trains_in_sharded_stages_as_one_built_whole() -> None:
    # A model too big for one process: built on meta, each stage gives its own layers values, then shards them.
    for rank, runs in enumerate(run_replicas(built_on_meta_or_whole, 4, timeout_s=240)):
        for key, params in runs.items():
            assert all(torch.equal(g, w) for g, w in zip(params, runs[(None, False)], strict=True)), (rank, key)


def test_fsdp2_parameter_groups_are_read_as_each_supported_torch_holds_them() -> None:
    # torch 2.13 keeps a list (`_fsdp_param_groups`); torch 2.11 one group or None (`_fsdp_param_group`): on the
    # H200's torch 2.11 every sharded pipeline failed on the list's name. Both layouts, as plain objects.
    group = object()
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=[group, group])) == [group, group]
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
