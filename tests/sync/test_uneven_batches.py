"""uneven_batches="weighted": replicas with unequal batches train as one process on the concatenated batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

from _numerics import assert_within, bound, training_bound

# Samples per replica, step by step (the last step an uneven tail), for 2 and 3 replicas.
SIZES = {2: [[5, 11], [9, 2], [1, 4]], 3: [[3, 7, 6], [8, 1, 5], [2, 2, 3]]}
# accumulate(2): samples per replica of each micro-step of two updates (2 replicas).
MICRO_SIZES = [[6, 2], [1, 7], [4, 4], [3, 9]]
TOKENS = 5  # positions per sequence in the token-weighted case
# The longest sum behind one gradient element: an update's samples (at most 16, x TOKENS positions), then the
# widest fan-in of the backward (8), plus the loss's normalization and the momentum update.
LENGTH = 16 * TOKENS + 8 + 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def samples(step: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of `count` sequences: inputs, labels and a mask of the positions that count."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(count, TOKENS, 4, generator=generator)
    y = torch.randint(0, 3, (count, TOKENS), generator=generator)
    mask = torch.rand(count, TOKENS, generator=generator) < 0.6
    mask[:, 0] = True  # at least one token per sequence
    return x, y, mask


def shards(step: int, sizes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    whole = samples(step, sum(sizes))
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return [tuple(t[bounds[r]:bounds[r + 1]] for t in whole) for r in range(len(sizes))]


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], tokens: bool) -> torch.Tensor:
    x, y, mask = batch
    if not tokens:  # one sample per sequence: its first position
        return F.cross_entropy(model(x[:, 0]), y[:, 0])
    per_token = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
    return (per_token * mask.flatten()).sum() / mask.sum()


def reference(sizes: list[list[int]], tokens: bool, micro_steps: int = 1) -> tuple[list[torch.Tensor], list[float]]:
    """One process: each update over the concatenation of all its micro-steps' batches of all replicas."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for update in range(len(sizes) // micro_steps):
        steps = range(update * micro_steps, (update + 1) * micro_steps)
        batch = tuple(torch.cat(parts) for parts in zip(*(samples(step, sum(sizes[step])) for step in steps)))
        optimizer.zero_grad()
        loss = loss_of(model, batch, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def replicated(reducer: str, sizes: list[list[int]], tokens: bool, micro_steps: int = 1):
    """In each replica: the same training with `uneven_batches`, the default sample count or the tokens."""
    repl = rp.Replicator(reducer=reducer, uneven_batches=(lambda batch: int(batch[2].sum())) if tokens else "weighted")
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    repl.accumulate(micro_steps)
    mine = [shards(step, step_sizes)[repl.replica_id] for step, step_sizes in enumerate(sizes)]

    def step_fn(ctx: rp.ReplicaContext, batch):
        optimizer.zero_grad()
        loss = loss_of(model, batch, tokens)
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())  # weighted: the loss over the global batch

    losses = [float(loss) for _, loss in repl.run(step_fn, mine)]
    return [p.detach().clone() for p in model.parameters()], losses


def all_cases() -> dict[str, tuple[list[torch.Tensor], list[float]]]:
    replicas = int(os.environ["WORLD_SIZE"])
    results = {}
    for reducer in ("auto", "flat"):
        results[f"{reducer} samples"] = replicated(reducer, SIZES[replicas], tokens=False)
    results["auto tokens"] = replicated("auto", SIZES[replicas], tokens=True)
    if replicas == 2:
        results["accumulate"] = replicated("auto", MICRO_SIZES, tokens=False, micro_steps=2)
    return results


def expected_cases(replicas: int) -> dict[str, tuple[list[torch.Tensor], list[float]]]:
    expected = {f"{reducer} samples": reference(SIZES[replicas], tokens=False) for reducer in ("auto", "flat")}
    expected["auto tokens"] = reference(SIZES[replicas], tokens=True)
    if replicas == 2:
        expected["accumulate"] = reference(MICRO_SIZES, tokens=False, micro_steps=2)
    return expected


@pytest.mark.numerics  # uneven shards against the concatenated batch
@pytest.mark.parametrize("replicas", [2, 3])
def test_weighted_uneven_batches_match_one_process_on_the_concatenated_batch(replicas: int) -> None:
    results = run_replicas(all_cases, replicas, timeout_s=180)
    for case, (want_params, want_losses) in expected_cases(replicas).items():
        steps = len(want_losses)
        tolerance = training_bound(torch.float32, want_params, LENGTH, steps)
        # A reported loss is a mean over the same tokens summed in another order, after `steps` updates' drift.
        loss_tolerance = bound(torch.float32, max(map(abs, want_losses)), LENGTH, steps=steps)
        for replica, result in enumerate(results):
            params, losses = result[case]
            for index, (got, want) in enumerate(zip(params, want_params, strict=True)):
                assert_within(got, want, tolerance, f"{case}: replica {replica} parameter {index}")
            if case != "accumulate":  # one loss per micro-step there, one per update in the reference
                assert_within(torch.tensor(losses), torch.tensor(want_losses), loss_tolerance,
                              f"{case}: replica {replica}'s losses")


def test_the_reference_weights_differ_from_an_even_average() -> None:
    """Guards the test above: weighting by samples changes the result, so an even average would fail it."""
    model = make_model().requires_grad_(False)
    parts = shards(0, SIZES[2][0])
    even = sum(loss_of(model, part, tokens=False) for part in parts) / 2
    weighted = loss_of(model, tuple(torch.cat(t) for t in zip(*parts)), tokens=False)
    assert abs(float(even) - float(weighted)) > 1e-3


def one_replica_weighs_accumulated_micro_steps() -> list[torch.Tensor]:
    return replicated("auto", [[sum(s)] for s in MICRO_SIZES], tokens=False, micro_steps=2)[0]


def test_one_replica_weighs_uneven_micro_steps_too() -> None:
    """`python train.py` and the launch agree: on one replica the micro-steps are weighted by samples as well."""
    [got] = run_replicas(one_replica_weighs_accumulated_micro_steps, 1, timeout_s=60)
    want = reference(MICRO_SIZES, tokens=False, micro_steps=2)[0]
    tolerance = training_bound(torch.float32, want, LENGTH, steps=len(MICRO_SIZES) // 2)
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_within(g, w, tolerance, f"parameter {index}")


def an_empty_batch_on_one_replica() -> None:
    repl = rp.Replicator(uneven_batches="weighted")
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    mine = [shards(step, [3, 0] if step == 1 else [3, 2])[repl.replica_id] for step in range(2)]

    def step_fn(ctx: rp.ReplicaContext, batch):
        optimizer.zero_grad()
        loss_of(model, batch, tokens=False).backward()
        optimizer.step()

    list(repl.run(step_fn, mine))


def test_an_empty_batch_raises_on_every_replica(run_failing_fast) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(an_empty_batch_on_one_replica, 2, timeout_s=60, collective_timeout_s=20)
    assert [e.rank for e in caught.value.errors] == [0, 1], caught.value
    for error in caught.value.errors:
        assert error.kind == "ReplicatorUsageError" and "replica 1: 0" in error.message, error
