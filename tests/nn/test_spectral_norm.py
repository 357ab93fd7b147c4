"""Spectral norm across replicas: power-iteration buffers equal everywhere and to one process, named when they part,
and a warning where gradient accumulation makes the iteration run more often than one large batch would."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.utils.parametrizations import spectral_norm

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

from _numerics import assert_within, training_bound

REPLICAS = 2
GLOBAL_BATCH = 8
STEPS = 3


def _critic() -> torch.nn.Module:
    """Both of torch's spectral norms: the parametrization (_u, _v) and the older hook (weight_u, weight_v)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(spectral_norm(torch.nn.Linear(4, 8)), torch.nn.LeakyReLU(0.1),
                               torch.nn.utils.spectral_norm(torch.nn.Linear(8, 1))).double()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _critic_trained(extra_call_on_replica: int | None = None) -> dict[str, torch.Tensor]:
    """Two critic calls per step (real and fake, as a GAN's discriminator step); `extra_call_on_replica` adds a
    third, training-mode call for logging on that replica only."""
    repl = rp.Replicator()
    with repl.scope():
        critic = _critic()
        optimizer = repl.wrap_optimizer(torch.optim.Adam(critic.parameters(), lr=0.05, betas=(0.0, 0.9)))
    share = GLOBAL_BATCH // repl.num_replicas
    rows = slice(repl.replica_id * share, (repl.replica_id + 1) * share)

    def step_fn(ctx: rp.ReplicaContext, step: int) -> torch.Tensor:
        x = _batch(step)[rows]
        loss = torch.relu(1 - critic(x)).mean() + torch.relu(1 + critic(-x)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if ctx.replica_id == extra_call_on_replica:
            critic(x)  # "just logging": but in train mode, another power iteration on this replica only
        return loss.detach()

    for _ in repl.run(step_fn, list(range(STEPS)), progress=False):
        pass
    return _state(critic)


def test_power_iteration_buffers_stay_equal_across_replicas_and_to_one_process() -> None:
    results = run_replicas(_critic_trained, REPLICAS)
    critic = _critic()
    optimizer = torch.optim.Adam(critic.parameters(), lr=0.05, betas=(0.0, 0.9))
    for step in range(STEPS):
        x = _batch(step)
        loss = torch.relu(1 - critic(x)).mean() + torch.relu(1 + critic(-x)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    expected = _state(critic)
    assert {"0.parametrizations.weight.0._u", "2.weight_v"} <= set(expected)
    # float64 training on the batch cut in shards: sums over GLOBAL_BATCH rows through fan-ins of 8, plus the power
    # iteration's norms (8 terms), STEPS steps.
    tolerance = training_bound(torch.float64, list(expected.values()), GLOBAL_BATCH + 8 + 8 + 4, STEPS)
    for got in results:
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert_within(got[name], tensor, tolerance, name)
    for name in expected:  # bit for bit between replicas: never averaged, only ever computed alike
        assert torch.equal(results[0][name], results[1][name]), name


def test_a_replica_calling_the_critic_once_more_is_named_with_the_rule(run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_critic_trained, REPLICAS, 0)
    errors = caught.value.errors
    assert [e.rank for e in errors] == [0, 1], caught.value
    for error in errors:
        assert error.kind == "ReplicaMismatchError", error
        assert "different values at the end of run()" in error.message
        # Only the power-iteration buffers part (the averaged gradients keep the weights equal; the last
        # layer's u has one element, always 1) ...
        assert "replica 1 differs from replica 0 in Sequential.0.parametrizations.weight.0._u, " in error.message
        assert "Sequential.2.weight_v" in error.message and ".original" not in error.message
        # ... and the advice is spectral norm's rule, not the usual one about building models in scope().
        assert "same number of times per step" in error.message and "eval()" in error.message
        assert "repl.scope()" not in error.message


def _warnings_of_accumulation() -> list[str]:
    repl = rp.Replicator()
    with repl.scope():
        critic = _critic()
        repl.wrap_optimizer(torch.optim.Adam(critic.parameters(), lr=0.05, betas=(0.0, 0.9)))
        plain = torch.nn.Linear(2, 2)
        repl.wrap_optimizer(torch.optim.SGD(plain.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repl.accumulate(1)  # no accumulation: nothing to say
        repl.accumulate(4)
        repl.accumulate(4)  # said once is enough
        repl.accumulate(1)
        with repl.no_sync():
            pass
    return [str(w.message) for w in caught]


def test_accumulation_with_spectral_norm_warns_once_on_the_main_replica() -> None:
    main, other = run_replicas(_warnings_of_accumulation, REPLICAS)
    assert other == []
    assert len(main) == 1, main
    assert main[0].startswith("accumulate(4) with spectral-normed modules (0, 2): their power iteration runs in every "
                              "micro-batch's forward, 4 times per update"), main[0]
    assert "BigGAN-PyTorch" in main[0]


def _warnings_of_no_sync() -> list[str]:
    repl = rp.Replicator()
    with repl.scope():
        critic = _critic()
        repl.wrap_optimizer(torch.optim.Adam(critic.parameters(), lr=0.05, betas=(0.0, 0.9)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with repl.no_sync():
                pass
    return [str(w.message) for w in caught]


def test_no_sync_accumulation_with_spectral_norm_warns_once() -> None:
    (messages,) = run_replicas(_warnings_of_no_sync, 1)
    assert len(messages) == 1 and messages[0].startswith("no_sync() accumulation with spectral-normed modules (0, 2)")
