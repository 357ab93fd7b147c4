"""rp.nn batch norm where DDP users arrive with torch's habits: a model already converted to
nn.SyncBatchNorm, and evaluation on one replica while the others wait."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_replicas

from _numerics import assert_within, training_bound

REPLICAS = 2
GLOBAL_BATCH = 8
STEPS = 3


def _model() -> torch.nn.Sequential:
    """Float64 and non-default settings everywhere, so that a conversion losing any of them shows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6, eps=1e-3, momentum=0.3),
                                torch.nn.ReLU(), torch.nn.Linear(6, 3)).double()
    norm = model[1]
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        norm.num_batches_tracked.fill_(5)
        norm.bias.uniform_(-1, 1)
    norm.weight.requires_grad_(False)  # a frozen scale, as in fine-tuning
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(GLOBAL_BATCH, 4, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator))


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def sync_batchnorm_model_trained() -> dict[str, Any]:
    repl = rp.Replicator()
    with repl.scope():
        model = rp.nn.convert_batchnorm(torch.nn.SyncBatchNorm.convert_sync_batchnorm(_model()))
        optimizer = repl.wrap_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    norm = model[1]
    converted = {"type": type(norm).__name__, "eps": norm.eps, "momentum": norm.momentum, "affine": norm.affine,
                 "tracking": norm.track_running_stats, "dtype": norm.running_mean.dtype,
                 "trainable": [p.requires_grad for p in norm.parameters()], "state": _state(model)}

    def input_fn(ctx: rp.InputContext):
        share = ctx.per_replica_batch_size(GLOBAL_BATCH)
        for step in range(STEPS):
            x, y = _batch(step)
            mine = slice(ctx.input_pipeline_id * share, (ctx.input_pipeline_id + 1) * share)
            yield x[mine], y[mine]

    def step_fn(ctx: rp.ReplicaContext, batch):
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    for _ in repl.run(step_fn, repl.prepare_input(input_fn)):
        pass
    return {"converted": converted, "trained": _state(model)}


@pytest.mark.numerics  # float64 GEMMs and batch statistics on shards
def test_a_model_holding_sync_batchnorm_converts_and_trains_as_one_process() -> None:
    results = run_replicas(sync_batchnorm_model_trained, REPLICAS)
    model = _model()
    before = _state(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    for replica, got in enumerate(results):
        converted = got["converted"]
        assert converted["type"] == "CrossReplicaBatchNorm"
        assert (converted["eps"], converted["momentum"], converted["affine"], converted["tracking"]) == (
            1e-3, 0.3, True, True)
        assert converted["dtype"] == torch.float64 and converted["trainable"] == [False, True]
        assert all(torch.equal(a, b) for a, b in zip(converted["state"], before)), replica
        # float64 training on the batch cut in shards: the batch statistics' and gradients' sums over GLOBAL_BATCH
        # rows through fan-ins of 6 in another order, STEPS steps.
        want = _state(model)
        tolerance = training_bound(torch.float64, want, GLOBAL_BATCH + 6 + 6, STEPS)
        for index, (a, b) in enumerate(zip(got["trained"], want)):
            assert a.dtype == b.dtype, (replica, index)
            assert_within(a, b, tolerance, f"replica {replica} tensor {index}")


def one_replica_evaluates_alone() -> dict[str, torch.Tensor]:
    """Replica 0 evaluates (with and without running statistics) while replica 1 waits at a barrier."""
    repl = rp.Replicator()
    out = {}
    if repl.replica_id == 0:
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
        for tracking in (True, False):
            torch.manual_seed(1)
            plain = torch.nn.BatchNorm1d(3, track_running_stats=tracking)
            with torch.no_grad():
                plain.weight.uniform_(0.5, 2)
                if tracking:
                    plain.running_mean.uniform_(-1, 1)
            norm = rp.nn.convert_batchnorm(torch.nn.Sequential(plain))[0]
            norm.eval()
            out[f"tracking={tracking}"] = norm(x).detach()
            out[f"plain tracking={tracking}"] = plain.eval()(x).detach()
    repl.barrier()
    return out


def test_eval_mode_never_communicates(run_failing_fast: Any) -> None:
    results = run_failing_fast(one_replica_evaluates_alone, REPLICAS, collective_timeout_s=10)
    for tracking in (True, False):
        assert torch.equal(results[0][f"tracking={tracking}"], results[0][f"plain tracking={tracking}"])
