"""mode="diloco": equal to synchronous training at H = 1, to a one-process simulation of DiLoCo at H = 4,
identical inside a sync group, its traffic counted, and bad input refused on every process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

from _numerics import assert_within, bound, largest, training_bound

GLOBAL_BATCH = 8
# The longest sum behind one gradient element in a step: the batch's 8 rows (cut in shards and groups), the
# widest fan-in (16), plus the loss's mean, the inner update and the outer average and update.
LENGTH = GLOBAL_BATCH + 16 + 6
INNER_LR, INNER_MOMENTUM = 0.1, 0.9


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


# 6*16 + 16 + 16*3 + 3 = 163 parameters in 4 tensors: one bucket of 163 values and 4 presence slots.
BUCKET_NUMEL = 163 + 4


def inner_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=INNER_LR, momentum=INNER_MOMENTUM)


def plain_average(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def rows(step: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, labels = global_batch(step)
    return inputs[first : first + count], labels[first : first + count]


def train_diloco(steps: int, outer_every: int, sync_group_size: int, outer: str, reducer: str = "auto") -> dict:
    """One replica of a DiLoCo job: the user's code is synchronous mode's, but for the constructor's arguments."""
    outer_optimizer = plain_average if outer == "average" else None
    repl = rp.Replicator(mode="diloco", outer_every=outer_every, sync_group_size=sync_group_size,
                         outer_optimizer=outer_optimizer, reducer=reducer)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(inner_optimizer(model.parameters()))
    share = GLOBAL_BATCH // repl.num_replicas
    batches = [rows(step, repl.replica_id * share, share) for step in range(steps)]

    def step_fn(ctx: rp.ReplicaContext, batch) -> torch.Tensor:
        inputs, labels = batch
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    mid_round = None
    for step, _ in repl.run(step_fn, batches, steps=steps):
        if step == 1:  # inside the first round when outer_every > 2: groups apart, replicas of a group alike
            mid_round = [p.detach().clone() for p in model.parameters()]
    return {"params": [p.detach().clone() for p in model.parameters()], "mid_round": mid_round,
            "last_run": {k: v for k, v in repl.last_run.items() if k != "per_replica"}}


def simulate_diloco(steps: int, outer_every: int, groups: int, outer: str) -> list[torch.Tensor]:
    """DiLoCo by hand in one process: `groups` models trained apart on their shards, the pseudo-gradient
    (start - now) averaged, an outer optimizer stepping the start, every model continuing from it."""
    models = [make_model() for _ in range(groups)]
    inners = [inner_optimizer(m.parameters()) for m in models]
    start = [torch.nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    outer_optimizer = plain_average(start) if outer == "average" else torch.optim.SGD(start, lr=0.7, momentum=0.9,
                                                                                       nesterov=True)
    share = GLOBAL_BATCH // groups
    since = 0
    for step in range(steps):
        for number, (model, inner) in enumerate(zip(models, inners)):
            inputs, labels = rows(step, number * share, share)
            loss = F.cross_entropy(model(inputs), labels)
            inner.zero_grad()
            loss.backward()
            inner.step()
        since += 1
        if since == outer_every or step == steps - 1:  # run() also closes a round cut short
            for position, anchor in enumerate(start):
                now = [list(m.parameters())[position].detach() for m in models]
                anchor.grad = sum(anchor.detach() - p for p in now) / groups
            outer_optimizer.step()
            with torch.no_grad():
                for model in models:
                    for param, anchor in zip(model.parameters(), start):
                        param.copy_(anchor)
            since = 0
    return [p.detach().clone() for p in models[0].parameters()]


def train_synchronously(steps: int) -> list[torch.Tensor]:
    model = make_model()
    optimizer = inner_optimizer(model.parameters())
    for step in range(steps):
        inputs, labels = global_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor], steps: int) -> None:
    """The same training as `expected` with its batches cut otherwise (replicas of a group, averages of groups)."""
    tolerance = training_bound(torch.float32, expected, LENGTH, steps)
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_within(a, e, tolerance, f"parameter {index}")


@pytest.mark.numerics  # shards of 4 rows against 8
def test_outer_every_one_with_plain_averaging_is_synchronous_training() -> None:
    results = run_replicas(train_diloco, 2, 4, 1, 1, "average")
    expected = train_synchronously(4)
    for result in results:
        assert_close(result["params"], expected, 4)
        assert result["last_run"]["outer_steps"] == 4


def test_two_groups_apart_for_four_steps_equal_a_one_process_simulation() -> None:
    # 10 steps: outer steps after 4 and 8, and run() closes the cut-short third round.
    results = run_replicas(train_diloco, 2, 10, 4, 1, "nesterov")
    expected = simulate_diloco(10, 4, 2, "nesterov")
    steps = 10
    for result in results:
        assert_close(result["params"], expected, steps)
    assert not torch.equal(results[0]["mid_round"][0], results[1]["mid_round"][0])  # apart inside a round
    run = results[0]["last_run"]
    assert (run["mode"], run["sync_groups"], run["sync_group_size"], run["outer_steps"]) == ("diloco", 2, 1, 3)
    round_bytes = BUCKET_NUMEL * 4  # fp32 pseudo-gradient and presence slots, once per outer step
    assert run["synchronous_bytes_per_step"] == round_bytes  # the same bucket every step
    assert run["inner_bytes_per_step"] == 0  # groups of one replica: no gradient traffic at all
    assert run["bytes_per_step"] == pytest.approx(round_bytes * 3 / 10)
    assert run["bytes_reduction"] == pytest.approx(10 / 3)


def test_groups_of_two_stay_identical_inside_and_train_as_their_union() -> None:
    results = run_replicas(train_diloco, 4, 6, 4, 2, "nesterov", timeout_s=180)
    expected = simulate_diloco(6, 4, 2, "nesterov")  # each group trains on its two replicas' rows
    steps = 6
    for result in results:
        assert_close(result["params"], expected, steps)
    for first, second in ((0, 1), (2, 3)):
        for a, b in zip(results[first]["mid_round"], results[second]["mid_round"]):
            assert torch.equal(a, b)
    assert not torch.equal(results[0]["mid_round"][0], results[2]["mid_round"][0])
    run = results[0]["last_run"]
    assert (run["sync_groups"], run["sync_group_size"], run["outer_steps"]) == (2, 2, 2)
    assert run["inner_bytes_per_step"] == BUCKET_NUMEL * 4
    assert run["bytes_per_step"] == pytest.approx(BUCKET_NUMEL * 4 * (1 + 2 / 6))


def test_the_pseudo_gradient_travels_through_a_compressing_reducer() -> None:
    results = run_replicas(train_diloco, 2, 8, 4, 1, "nesterov", "bf16")
    expected = simulate_diloco(8, 4, 2, "nesterov")
    for result in results:
        # bf16 keeps 8 bits of the mean pseudo-gradient: each of the 2 rounds rounds it once, on the replicas' side
        # only, by at most its size (the parameters' motion in a round, below their largest |value|), and the outer
        # Nesterov step (lr 0.7, momentum 0.9) applies it with weight up to 0.7 x (1 + 0.9 + 0.9) < 2.
        tolerance = 2 * float(bound(torch.bfloat16, largest(expected), 1, steps=2, sides=1))
        for index, (a, e) in enumerate(zip(result["params"], expected, strict=True)):
            assert_within(a, e, tolerance, f"bf16: parameter {index}")
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)  # but every replica got the same mean, bit for bit
    run = results[0]["last_run"]
    assert run["bytes_per_step"] == pytest.approx(BUCKET_NUMEL * 2 * 2 / 8)  # 2 bytes a value, 2 rounds in 8 steps
    assert run["synchronous_bytes_per_step"] == BUCKET_NUMEL * 2
    assert run["bytes_reduction"] == pytest.approx(4.0)


def bad_replicator(case: str) -> None:
    if case == "outer_every":
        rp.Replicator(mode="diloco", outer_every=0)
    elif case == "groups":
        rp.Replicator(mode="diloco", outer_every=4, sync_group_size=2)  # 3 replicas
    elif case == "stages":
        rp.Replicator(mode="diloco", outer_every=4, stages=2)
    elif case == "sync_mode":
        rp.Replicator(outer_every=4)
    elif case == "mode":
        rp.Replicator(mode="local_sgd", outer_every=4)
    elif case == "checkpoint":
        repl = rp.Replicator(mode="diloco", outer_every=2)
        with repl.scope():
            model = torch.nn.Linear(3, 1)
            optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        def step_fn(ctx: rp.ReplicaContext, inputs: torch.Tensor) -> None:
            optimizer.zero_grad()
            model(inputs).sum().backward()
            optimizer.step()

        for _ in repl.run(step_fn, [torch.ones(1, 3)] * 2, steps=2):
            repl.save("unused-checkpoint")  # after step 0: in the middle of a round of 2, where groups differ


@pytest.mark.parametrize(("case", "world", "expected"), [
    ("outer_every", 2, "outer_every=H, a whole number of inner steps >= 1"),
    ("groups", 3, "sync_group_size=2 does not divide the 3 replicas"),
    ("stages", 2, "mode='diloco' with stages=2 is not supported yet"),
    ("checkpoint", 2, "mode='diloco' saves checkpoints on outer steps only"),
    ("sync_mode", 2, "outer_every only apply to mode='diloco'"),
    ("mode", 2, "unknown mode='local_sgd'"),
])
def test_bad_input_raises_on_every_process(run_failing_fast, case: str, world: int, expected: str) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(bad_replicator, world, case)
    assert sorted(error.rank for error in failure.value.errors) == list(range(world))
    for error in failure.value.errors:
        assert error.kind == "ReplicatorUsageError" and expected in error.message, error.message
