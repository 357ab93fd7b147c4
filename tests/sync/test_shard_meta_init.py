"""shard="parameters" with a model built on the meta device: a whole build's values, never the whole model in memory.

Why bit for bit: every replica replays the modules' reset_parameters() in the order building the
model ran them, from the same generator state, so each unit draws the numbers a whole build draws
for it; then replica 0's values are copied, as the scope copies a whole model, and the unit is
sharded as shard="parameters" shards a model built for real. Training from there is the same
arithmetic on the same shards.

Memory is counted from the tensors themselves: every tensor storage Python can reach (the
garbage collector's objects once it collected, a DTensor's local shard included, each storage once), sampled
while each layer initialises. An optimizer is wrapped over the meta parameters inside the block,
so a whole parameter it kept alive would be counted.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

WIDTH = 48
BLOCKS = 6
STEPS = 2


def live_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python, not counting the meta device's."""
    gc.collect()  # what is unreachable but not yet collected is not held
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:  # type(): isinstance warns on some objects
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class CountingLinear(torch.nn.Linear):
    """A Linear that samples the live tensor bytes each time it initialises (torch's own reset, then a census)."""

    census: list[int] | None = None

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if CountingLinear.census is not None:
            CountingLinear.census.append(live_bytes())


class Blocks(torch.nn.Module):
    """Net's blocks as direct children (each its own unit under the default policy)."""

    def __init__(self) -> None:
        super().__init__()
        for index in range(BLOCKS):
            self.add_module(f"block{index}",
                            torch.nn.Sequential(CountingLinear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.children():
            x = torch.tanh(block(x))
        return x


UNIT_BYTES = (WIDTH * WIDTH + WIDTH + 2 * WIDTH) * 4
WHOLE_BYTES = BLOCKS * UNIT_BYTES


def whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def nested_units(name: str, module: torch.nn.Module) -> bool:
    """A shard_policy with units inside units: each block, and each block's Linear (sharded before its block)."""
    return isinstance(module, (torch.nn.Sequential, torch.nn.Linear))


def build_and_train(on_meta: bool, seed_by_replica: bool, nested: bool) -> dict[str, Any]:
    """Inside a replica: build Blocks (on meta or for real) with shard="parameters", then two AdamW steps."""
    repl = rp.Replicator(shard="parameters")
    gc.collect()
    baseline = live_bytes()
    CountingLinear.census = [] if on_meta else None
    with repl.scope(shard_policy=nested_units if nested else None):
        # Seeded alike (the generator decides the values) or not (then replica 0's values are everyone's).
        torch.manual_seed(repl.replica_id if seed_by_replica else 0)
        if on_meta:
            with torch.device("meta"):
                model = Blocks()
        else:
            model = Blocks()
        optimizer = repl.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    census, CountingLinear.census = CountingLinear.census, None
    after_scope = torch.rand(4)  # where the generator stands: where a whole build leaves it
    initial = [whole(p) for p in model.parameters()]

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        F.mse_loss(model(batch), batch.flip(1)).backward()
        optimizer.step()

    generator = torch.Generator().manual_seed(7 + repl.replica_id)
    batches = [torch.randn(4, WIDTH, generator=generator) for _ in range(STEPS)]
    for _ in repl.run(step_fn, batches, record=False):
        pass
    result = {"initial": initial, "trained": [whole(p) for p in model.parameters()], "after_scope": after_scope,
              "sharded": all(isinstance(p, DTensor) for p in model.parameters()) if repl.num_replicas > 1 else None,
              "peak": max(census) - baseline if census else None, "replicas": repl.num_replicas}
    repl.close()
    return result


def both_builds(seed_by_replica: bool, nested: bool) -> dict[bool, dict[str, Any]]:
    return {on_meta: build_and_train(on_meta, seed_by_replica, nested) for on_meta in (True, False)}


def whole_build() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach().clone() for p in Blocks().parameters()]


@pytest.mark.parametrize(("replicas", "seed_by_replica", "nested"), [(1, False, False), (2, True, False),
                                                                     (3, False, True)])
def test_a_meta_model_is_built_unit_by_unit_with_a_whole_builds_values(replicas: int, seed_by_replica: bool,
                                                                        nested: bool) -> None:
    results = run_replicas(both_builds, replicas, seed_by_replica, nested, timeout_s=240)
    expected = whole_build()
    for replica, result in enumerate(results):
        meta, real = result[True], result[False]
        where = f"replica {replica} of {replicas}"
        assert meta["sharded"] in (None, True) and meta["sharded"] == real["sharded"], where
        # The values of a whole build (replica 0's, whatever this replica's seed), and the same training after.
        assert all(torch.equal(a, b) for a, b in zip(meta["initial"], expected, strict=True)), where
        assert all(torch.equal(a, b) for a, b in zip(meta["initial"], real["initial"], strict=True)), where
        assert all(torch.equal(a, b) for a, b in zip(meta["trained"], real["trained"], strict=True)), where
        assert torch.equal(meta["after_scope"], real["after_scope"]), where  # the generator where a build leaves it
        if replicas > 1:
            # Sampled while each layer initialised: the finished units' shards (1/N of each unit, plus at most one
            # row of each of its 4 tensors for FSDP2's padding) and the unit being built, whole.
            padding = BLOCKS * (WIDTH + 3) * 4
            assert meta["peak"] <= WHOLE_BYTES / replicas + padding + UNIT_BYTES, (where, meta["peak"])
            assert meta["peak"] < WHOLE_BYTES, where


class Unset(torch.nn.Module):
    """A parameter made with torch.ones in a module without reset_parameters(): on meta nothing sets it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(1))


class Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        with torch.device("cpu"):
            self.real = torch.nn.Linear(4, 4)


def meta_mistake(model_class: type[torch.nn.Module]) -> None:
    repl = rp.Replicator(shard="parameters")
    with repl.scope():
        with torch.device("meta"):
            model = model_class()
        repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(("model_class", "message"), [
    (Unset, "Unset.scale of Unset (built on the meta device) has no values once its modules' reset_parameters() ran"),
    (Mixed, "Mixed.real.weight, Mixed.real.bias of a model built partly on the meta device are not on it"),
])
def test_a_meta_model_that_cannot_be_replayed_is_refused_on_every_replica(model_class: type[torch.nn.Module],
                                                                           message: str) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(meta_mistake, 2, model_class, timeout_s=120)
    assert sorted(error.rank for error in caught.value.errors) == [0, 1]
    for error in caught.value.errors:
        assert message in error.message, error.message


def meta_on_one_replica() -> None:
    repl = rp.Replicator(shard="parameters")
    with repl.scope():
        with torch.device("meta" if repl.replica_id == 1 else "cpu"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_replicas_disagreeing_on_the_meta_device_are_told_so_on_every_replica() -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(meta_on_one_replica, 2, timeout_s=120)
    assert sorted(error.rank for error in caught.value.errors) == [0, 1]
    for error in caught.value.errors:  # no hang: the agreement before any value moves names both sides
        assert "replica(s) 1: checking that every replica's parameters and state have the same names and shapes at " \
               "the end of repl.scope() (a model on the meta device)" in error.message, error.message
