"""shard="parameters" with repl.accumulate(n) and repl.no_sync(): FSDP2 reduce-scatters once per update, in the
backward pass that ends it, and the update is plain FSDP2's accumulation bit for bit (and shard=None's within
rounding)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import replicator as rp
from replicator.testing import run_replicas

REPLICAS, MICRO_STEPS, STEPS, ROWS, LR = 2, 2, 3, 4, 0.05
EPS = torch.finfo(torch.float32).eps
# Against shard=None: the same sums in another order (the micro-batches' rows, the replicas, the micro-steps), each
# update moving a parameter by at most lr with a direction rounded differently by ~32 ulps (tests/sync/
# test_shard_parameters.py's derivation).
ATOL = STEPS * LR * 32 * EPS


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def micro_batch(step: int, micro: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + replica)
    return torch.randn(ROWS, 6, generator=generator), torch.randn(ROWS, 3, generator=generator)


def whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def with_replicator(shard: str | None, form: str, reduce_scatters: list[int]) -> list[torch.Tensor]:
    repl = rp.Replicator(shard=shard)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    if form == "accumulate":
        repl.accumulate(MICRO_STEPS)

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(model(batch[0]), batch[1])

    def step_fn(ctx: rp.ReplicaContext, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        optimizer.zero_grad()
        if form == "accumulate":  # one micro-batch per call; zero_grad and step take effect every MICRO_STEPS calls
            loss_of(batches[0]).backward()
        else:  # every micro-batch in one call, all but the last backward inside no_sync
            with repl.no_sync():
                for batch in batches[:-1]:
                    (loss_of(batch) / MICRO_STEPS).backward()
            (loss_of(batches[-1]) / MICRO_STEPS).backward()
        if shard is not None:  # a sharded parameter has a (DTensor) gradient only once FSDP2 reduce-scattered it
            reduce_scatters.append(sum(1 for p in model.parameters() if isinstance(p.grad, DTensor)))
        optimizer.step()

    me = repl.replica_id
    if form == "accumulate":
        inputs = [[micro_batch(step, micro, me)] for step in range(STEPS) for micro in range(MICRO_STEPS)]
    else:
        inputs = [[micro_batch(step, micro, me) for micro in range(MICRO_STEPS)] for step in range(STEPS)]
    for _ in repl.run(step_fn, inputs, record=False):
        pass
    return [whole(p) for p in model.parameters()]  # not closed: the job's other Replicator shares its groups


def with_plain_fsdp2() -> list[torch.Tensor]:
    """torch's FSDP2 accumulation by hand, with replicator's units (every child holding parameters, then the root)."""
    model = make_model()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(MICRO_STEPS):
            model.set_requires_gradient_sync(micro == MICRO_STEPS - 1)  # type: ignore[operator]
            x, y = micro_batch(step, micro, dist.get_rank())
            F.mse_loss(model(x), y).backward()
        torch._foreach_div_([p.grad.to_local() for p in model.parameters()], float(MICRO_STEPS))
        optimizer.step()
    return [whole(p) for p in model.parameters()]


def job(form: str) -> dict[str, Any]:
    reduce_scatters: list[int] = []
    sharded = with_replicator("parameters", form, reduce_scatters)
    return {"sharded": sharded, "fsdp2": with_plain_fsdp2(), "unsharded": with_replicator(None, form, []),
            "sharded_grads_per_call": reduce_scatters}


@pytest.mark.parametrize("form", ["accumulate", "no_sync"])
def test_sharded_parameters_accumulate_as_plain_fsdp2_and_as_unsharded_training(form: str) -> None:
    for replica, found in enumerate(run_replicas(job, REPLICAS, form, timeout_s=240)):
        where = f"{form}, replica {replica}"
        for got, fsdp2, unsharded in zip(found["sharded"], found["fsdp2"], found["unsharded"], strict=True):
            assert torch.equal(got, fsdp2), where
            assert torch.allclose(got, unsharded, atol=ATOL, rtol=0), f"{where}: {(got - unsharded).abs().max()}"
        parameters = 6  # 3 Linear layers, a weight and a bias each
        if form == "accumulate":  # gradients sharded (reduce-scattered) only on an update's last micro-step
            assert found["sharded_grads_per_call"] == [0, parameters] * STEPS, where
        else:
            assert found["sharded_grads_per_call"] == [parameters] * STEPS, where


def forward_called_directly() -> str:
    """Inside a replica: step_fn calls model.forward(x) on a model sharded with shard="parameters"."""
    repl = rp.Replicator(shard="parameters")
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=LR))

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        optimizer.zero_grad()
        F.mse_loss(model.forward(batch[0]), batch[1]).backward()
        optimizer.step()

    try:
        for _ in repl.run(step_fn, [micro_batch(0, 0, repl.replica_id)], record=False):
            pass
    except rp.ReplicatorUsageError as error:
        return str(error)
    return "no error"


def test_calling_forward_directly_on_a_sharded_model_is_refused_on_every_replica() -> None:
    for found in run_replicas(forward_called_directly, REPLICAS, timeout_s=120):
        assert "Sequential.forward() was called directly on a model sharded with shard='parameters'" in found, found
        assert "`model(x)`, not `model.forward(x)`" in found
