"""precision="bf16"/"fp16": 2 replicas train as one process under the same autocast (and torch.amp.GradScaler)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_replicas

from _numerics import assert_within, gamma, momentum_sgd_bound

GLOBAL_BATCH = 16
STEPS = 9
# 2**30 overflows fp16 at once (its largest power of two is 2**15), in one process and in the replicas alike:
# that step is skipped on both and the scale backs off to 2**10, then doubles after every two finite updates.
# (Near fp16's limit the verdicts may part: one process sums each weight gradient over 16 samples in fp16,
# where each replica sums 8, so one process can overflow where the replicas do not. Replicas always agree.)
SCALE = rp.Precision("fp16", init_scale=2.0**30, backoff_factor=2.0**-20, growth_interval=2)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# How far the replicas' parameters may end from one process's: each replica's weight-gradient matmuls sum 8
# samples where one process sums 16, so they may take other kernels (and other ones on another CPU). Under
# autocast those kernels accumulate in fp32 and round the result once to fp16 (bf16): the fp32 sums differ by
# gamma_16(fp32) ~ 1e-6 relative, far below one fp16 (bf16) rounding, so each applied gradient element differs by at
# most 2 roundings (one per side) of its size: 2 * (gamma_1(low) + gamma_16(fp32)). momentum_sgd_bound carries that
# through every later momentum step (and the scheduler's learning rates) to the final parameters: about 2.8e-4 (fp16)
# and 2.5e-3 (bf16) at most here. A scale applied or divided out wrongly (by 2**k) or an update skipped on one side
# only is off by 1e-2 or more.
BATCH_SUM = 16


def relative_gradient_error(name: str) -> float:
    return 2 * (gamma(1, DTYPES[name]) + gamma(BATCH_SUM, torch.float32))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 8, generator=generator) * 3, torch.randint(0, 4, (GLOBAL_BATCH,),
                                                                                generator=generator)


def reference(name: str) -> dict[str, Any]:
    """One process on the whole batch, torch's recipe: autocast, GradScaler, unscale_ before clipping."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.95)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE.init_scale, backoff_factor=SCALE.backoff_factor,
                                  growth_interval=SCALE.growth_interval, enabled=name == "fp16")
    skipped, scales, gradients, learning_rates = [], [], [], []
    for step in range(STEPS):
        x, y = global_batch(step)
        with torch.autocast("cpu", dtype=DTYPES[name]):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        before, learning_rate = scaler.get_scale(), scheduler.get_last_lr()[0]
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.append(step)  # GradScaler skipped the update: so must a wrapped scheduler
        else:
            scheduler.step()
            gradients.append([p.grad.detach().clone() for p in model.parameters()])
            learning_rates.append(learning_rate)
        scales.append(scaler.get_scale())
    bounds = momentum_sgd_bound(gradients, learning_rates, 0.9, relative_gradient_error(name))
    return {"params": [p.detach().clone() for p in model.parameters()], "skipped": skipped, "scales": scales,
            "lr": scheduler.get_last_lr(), "bounds": bounds}


def replicated(name: str, two_backwards: bool = False, steps: int = STEPS, checkpoint_dir: str | None = None,
               precision: rp.Precision | None = None) -> dict[str, Any]:
    """The same training on this replica's half of each batch; step_fn as in fp32."""
    repl = rp.Replicator(precision=precision or (SCALE if name == "fp16" else name))
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scheduler = repl.wrap_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.95))
    share = GLOBAL_BATCH // repl.num_replicas
    rows = slice(repl.replica_id * share, (repl.replica_id + 1) * share)

    def step_fn(ctx: rp.ReplicaContext, step: int) -> torch.Tensor:
        x, y = (t[rows] for t in global_batch(step))
        optimizer.zero_grad()
        if two_backwards:  # two passes before step(): the second adds to averages of the first
            half = share // 2
            loss = F.cross_entropy(model(x[:half]), y[:half]) / 2
            loss.backward()
            second = F.cross_entropy(model(x[half:]), y[half:]) / 2
            second.backward()
            loss = loss + second
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        with torch.no_grad():
            assert model[0](x).dtype == DTYPES[name], "step_fn runs under autocast"
        repl.clip_grad_norm_(model.parameters(), 1e3)  # an overflow's infinite norm does not raise under fp16
        optimizer.step()
        scheduler.step()
        return ctx.all_mean(loss.detach())

    scales = []
    for _ in repl.run(step_fn, list(range(STEPS)), steps=steps, checkpoint_dir=checkpoint_dir,
                      checkpoint_every=5 if checkpoint_dir else None):
        if repl.precision.loss_scale is not None:
            scales.append(repl.precision.loss_scale.value)
    return {"params": [p.detach().clone() for p in model.parameters()], "skipped": repl.last_run["skipped_steps"],
            "scales": scales, "lr": scheduler.get_last_lr(), "last_run": repl.last_run}


def all_cases() -> dict[str, dict[str, Any]]:
    return {"fp16": replicated("fp16"), "bf16": replicated("bf16"), "fp16 two backwards": replicated("fp16", True)}


def assert_same_training(case: str, got: dict[str, Any], want: dict[str, Any], replica: int) -> None:
    for index, (mine, theirs, bound) in enumerate(zip(got["params"], want["params"], want["bounds"], strict=True)):
        assert_within(mine, theirs, bound, f"{case}: replica {replica} parameter {index}")
    # The learning rate is 0.1 * 0.95**k, the same float operations on both sides: equal bit for bit.
    assert got["lr"] == want["lr"], f"{case}: the scheduler stepped {got['lr']} vs {want['lr']}"


@pytest.mark.numerics  # fp16/bf16 GEMMs on 8 rows against 16
def test_bf16_and_fp16_replicas_train_as_one_process_with_the_same_autocast_and_grad_scaler() -> None:
    results = run_replicas(all_cases, 2, timeout_s=180)
    expected = {"fp16": reference("fp16"), "bf16": reference("bf16")}
    assert expected["fp16"]["skipped"] == [0] and expected["fp16"]["scales"][-1] == 2.0**14
    for replica, result in enumerate(results):
        for case, got in result.items():
            want = expected[case.split()[0]]
            assert_same_training(case, got, want, replica)
            if case.startswith("fp16"):
                assert got["skipped"] == want["skipped"], f"{case}: replica {replica} skipped {got['skipped']}"
                assert got["scales"] == want["scales"], f"{case}: replica {replica}'s loss scale {got['scales']}"
                assert got["last_run"]["loss_scale"] == want["scales"][-1]
            assert got["last_run"]["precision"] == case.split()[0]
    assert results[0]["fp16"]["params"][0].equal(results[1]["fp16"]["params"][0]), "replicas must stay identical"


def checkpointed(directory: str, steps: int, precision: rp.Precision) -> dict[str, Any]:
    return replicated("fp16", steps=steps, checkpoint_dir=directory, precision=precision)


def test_a_checkpoint_keeps_the_loss_scale() -> None:
    want = reference("fp16")
    with tempfile.TemporaryDirectory() as directory:
        first = run_replicas(checkpointed, 2, directory, 6, SCALE, timeout_s=180)  # ends at step 6: saves it
        assert first[0]["scales"] == want["scales"][:6]
        # A fresh job with another initial scale resumes at step 6 with the scale saved there.
        results = run_replicas(checkpointed, 2, directory, STEPS, rp.Precision("fp16"), timeout_s=180)
    for replica, got in enumerate(results):
        assert_same_training("fp16 resumed", got, want, replica)
        assert got["scales"] == want["scales"][6:], f"replica {replica}'s loss scale went {got['scales']}"


def test_precision_is_checked_and_its_state_is_gradscalers() -> None:
    with pytest.raises(rp.ReplicatorUsageError, match="fp8"):
        rp.Precision.of("fp8")
    with pytest.raises(rp.ReplicatorUsageError, match="backoff_factor"):
        rp.Precision.of(rp.Precision("fp16", backoff_factor=2.0))
    from replicator.sync.precision import LossScale, check_autocast

    # Where torch cannot autocast to a dtype it only warns and runs in fp32 (CPU fp16 on older releases):
    # refused instead. float64 takes that path on every release.
    with pytest.raises(rp.ReplicatorUsageError, match="cannot autocast"):
        check_autocast("cpu", torch.float64)
    check_autocast("cpu", torch.float16)  # this torch can

    scale = LossScale(rp.Precision("fp16", init_scale=8.0), torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(scale.state_dict())  # the same format either way
    assert scaler.get_scale() == 8.0 and scaler.state_dict() == scale.state_dict()


def pipeline_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)  # every process builds the same whole model; each keeps its stage
    return [torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)]


def pipeline_run(schedule: str) -> dict[str, Any]:
    repl = rp.Replicator(stages=2, chunks=2, schedule=schedule, precision=SCALE)
    with repl.scope():
        pipe = repl.pipeline(pipeline_layers(), balance=[2, 3])
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9))

    def step_fn(ctx: rp.ReplicaContext, step: int) -> torch.Tensor:
        x, y = global_batch(step)
        optimizer.zero_grad()
        loss = pipe.train_step(x, y, F.cross_entropy)
        optimizer.step()
        return loss

    for _ in repl.run(step_fn, list(range(STEPS))):
        pass
    return {"stage": repl.stage_id, "params": [p.detach().clone() for p in pipe.parameters()],
            "skipped": repl.last_run["skipped_steps"], "scale": repl.last_run["loss_scale"]}


def pipeline_stage() -> dict[str, Any]:
    """Two stages of one replica, fp16: each schedule's stages scale their own losses and agree on every skip."""
    return {schedule: pipeline_run(schedule) for schedule in ("1f1b", "zero_bubble")}


@pytest.mark.numerics  # fp16 GEMMs on micro-batches of 8 against 16
def test_fp16_pipeline_stages_train_as_one_process_with_grad_scaler() -> None:
    model = torch.nn.Sequential(*pipeline_layers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE.init_scale, backoff_factor=SCALE.backoff_factor,
                                  growth_interval=SCALE.growth_interval)
    skipped, gradients = [], []
    for step in range(STEPS):
        x, y = global_batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += [step] if scaler.get_scale() < before else []
        if scaler.get_scale() >= before:  # applied: step() unscaled the gradients in place
            gradients.append([p.grad.detach().clone() for p in model.parameters()])
    # The stages run 2 micro-batches of 8 where one process runs 16 at once: as in the data-parallel case above.
    bounds = momentum_sgd_bound(gradients, [0.1] * len(gradients), 0.9, relative_gradient_error("fp16"))
    stage_bounds = [bounds[:2], bounds[2:]]
    stage_params = [list(model[:2].parameters()), list(model[2:].parameters())]
    for process in run_replicas(pipeline_stage, 2, timeout_s=180):
        for schedule, got in process.items():
            assert got["skipped"] == skipped == [0], f"{schedule}: stage {got['stage']} skipped {got['skipped']}"
            assert got["scale"] == scaler.get_scale()
            for mine, theirs, bound in zip(got["params"], stage_params[got["stage"]], stage_bounds[got["stage"]],
                                           strict=True):
                assert_within(mine, theirs.detach(), bound, f"{schedule}: stage {got['stage']}")
