"""Partition: explicit balance, parameter balance, time balance; clear errors."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from replicator.pipeline.partition import (
    balance_by_params,
    balance_by_time,
    partition,
    profile_times,
    resolve_balance,
    solve_balance,
)

from _events import SteppedClock

# The module itself: replicator.pipeline's `partition` attribute is the function of that name.
partition_module = importlib.import_module("replicator.pipeline.partition")


class Costly(nn.Module):
    """A layer whose cost is what it advances the profiler's injected clock by: no sleep, no load in the verdict."""

    def __init__(self, clock: SteppedClock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.seconds)
        return x * self.scale


def test_solve_balance_minimises_the_slowest_stage() -> None:
    assert solve_balance([1, 1, 1, 1], 2) == [2, 2]
    assert solve_balance([4, 1, 1, 1, 1], 2) == [1, 4]
    assert solve_balance([1, 2, 3, 4, 5, 6], 3) == [3, 2, 1]  # 6 | 9 | 6: no split has a bottleneck below 9
    costs = [5, 1, 1, 1, 5, 1]
    counts = solve_balance(costs, 3)
    starts = [sum(counts[:k]) for k in range(3)]
    assert max(sum(costs[s : s + c]) for s, c in zip(starts, counts)) == 6
    assert solve_balance([3], 1) == [1]


def test_partition_by_explicit_counts_keeps_layer_names() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    stages = partition(model, 3, [2, 2, 1])
    assert [len(s) for s in stages] == [2, 2, 1]
    assert list(stages[1].state_dict()) == ["2.weight", "2.bias"]
    assert stages[2][0] is model[4]  # the same module objects, not copies
    x = torch.randn(5, 2)
    y = x
    for stage in stages:
        y = stage(y)
    assert torch.equal(y, model(x))


def test_partition_by_params() -> None:
    layers = [nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.Linear(10, 10), nn.Linear(100, 100)]
    # 10100 | 0 | 1010 | 110 | 10100: the two big layers belong in different stages.
    counts = balance_by_params(layers, 2)
    assert counts[0] <= 4 and sum(counts) == 5
    assert sum(p.numel() for p in partition(layers, 2, "params")[1].parameters()) >= 10100


def test_partition_by_time_isolates_slow_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SteppedClock()
    monkeypatch.setattr(partition_module, "time", clock)  # the profiler reads only time.perf_counter
    layers = [Costly(clock, 0.03), Costly(clock, 0.0), Costly(clock, 0.0), Costly(clock, 0.03), Costly(clock, 0.0)]
    times = profile_times(layers, torch.randn(4, 3), repeat=1)
    assert times[0] >= 0.03 and times[3] >= 0.03 and times[1] < 1e-3
    counts = balance_by_time(layers, 2, torch.randn(4, 3), repeat=1)
    assert counts in ([1, 4], [2, 3], [3, 2])  # the two slow layers end up in different stages


def test_profiling_leaves_the_model_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 3)
    rng = torch.get_rng_state()
    profile_times(model, sample, repeat=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_clear_errors() -> None:
    layers = [nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(ValueError, match="cannot split 3 layer\\(s\\) into 4 stages"):
        partition(layers, 4)
    with pytest.raises(ValueError, match="covers 4 layers but the model has 3"):
        resolve_balance(layers, 2, [2, 2])
    with pytest.raises(ValueError, match="has 3 entries but the pipeline has 2 stages"):
        resolve_balance(layers, 2, [1, 1, 1])
    with pytest.raises(ValueError, match="no layers"):
        resolve_balance(layers, 2, [3, 0])
    with pytest.raises(ValueError, match='"params" or "time"'):
        resolve_balance(layers, 2, "flops")
    with pytest.raises(ValueError, match="sample"):
        resolve_balance(layers, 2, "time")
    with pytest.raises(TypeError, match="single Linear"):
        partition(nn.Linear(2, 2), 1)
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="shared by stages 0 and 1"):
        partition([shared, nn.ReLU(), shared], 2, [2, 1])
