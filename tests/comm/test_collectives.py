"""ReplicaContext's collectives against hand-computed values, forward and backward."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.comm import collectives
from replicator.testing import run_replicas


def collective_results() -> dict[str, torch.Tensor]:
    repl = rp.Replicator()
    ctx, r, n = repl.context, repl.replica_id, repl.num_replicas
    mine = torch.tensor([r + 1.0, 10.0 * (r + 1)])
    out = {
        "sum": ctx.all_sum(mine),
        "mean": ctx.all_mean(mine),
        "max": ctx.all_max(mine),
        "min": ctx.all_min(mine),
        "gather": ctx.all_gather(mine.view(1, 2)),
        "broadcast": ctx.broadcast(mine, source=n - 1),
        "reduce_scatter": ctx.reduce_scatter(torch.arange(2.0 * n) * (r + 1)),
        # Past the size that travels over a LocalLink: the backend's path, in the same run.
        "large_sum": ctx.all_sum(torch.full((collectives.LINK_BYTES // 4 + 1,), r + 1.0)),
        "largest_linked_sum": ctx.all_sum(torch.full((collectives.LINK_BYTES // 4,), r + 1.0)),
        "gather_8k": ctx.all_gather(torch.full((1, 2048), r + 1.0)),
        "empty_sum": ctx.all_sum(torch.empty(0, 3)),
        "integer_sum": ctx.all_sum(torch.tensor([r, 2**40 + r])),
        "linked": repl.job.data_link is not None,
    }
    # Gradients of the total loss Σ_r L_r with L_r = (r+1)·Σ collective(x_r).
    weight = r + 1.0
    for name in ("sum", "mean", "max", "gather", "broadcast", "reduce_scatter"):
        x = (torch.arange(2.0 * n) + 1 if name == "reduce_scatter" else mine.clone()).requires_grad_(True)
        op = {"sum": ctx.all_sum, "mean": ctx.all_mean, "max": ctx.all_max, "gather": ctx.all_gather,
              "broadcast": lambda t: ctx.broadcast(t, source=0), "reduce_scatter": ctx.reduce_scatter}[name]
        (weight * op(x).sum()).backward()
        out[f"grad_{name}"] = x.grad.clone()
    return out


@pytest.mark.parametrize("n, link", [(2, "1"), (4, "1"), (2, "0")], ids=["2-link", "4-link", "2-gloo"])
def test_collectives_forward_and_backward(n: int, link: str) -> None:
    results = run_replicas(collective_results, n, env={"REPLICATOR_LOCAL_LINK": link})
    values = torch.stack([torch.tensor([r + 1.0, 10.0 * (r + 1)]) for r in range(n)])
    total_weight = n * (n + 1) / 2  # Σ_r (r+1)
    for r, got in enumerate(results):
        assert got["linked"] == (link == "1")
        assert torch.equal(got["large_sum"], torch.full_like(got["large_sum"], total_weight))
        assert torch.equal(got["largest_linked_sum"], torch.full_like(got["largest_linked_sum"], total_weight))
        assert torch.equal(got["gather_8k"], torch.arange(1.0, n + 1).view(n, 1).expand(n, 2048))
        assert got["empty_sum"].shape == (0, 3)
        assert torch.equal(got["integer_sum"], torch.tensor([n * (n - 1) // 2, n * 2**40 + n * (n - 1) // 2]))
        assert torch.equal(got["sum"], values.sum(0))
        # Bit for bit, here and in the gradients below: the values and weights are small integers and n a power of
        # 2, so every sum and every division by n is exact in float32, in any order.
        assert torch.equal(got["mean"], values.mean(0))
        assert torch.equal(got["max"], values[-1])
        assert torch.equal(got["min"], values[0])
        assert torch.equal(got["gather"], values)
        assert torch.equal(got["broadcast"], values[-1])
        full = sum(torch.arange(2.0 * n) * (q + 1) for q in range(n))
        assert torch.equal(got["reduce_scatter"], full[2 * r : 2 * r + 2])
        # d/dx_r Σ_q w_q Σ sum(x) = Σ_q w_q for every element; the mean divides by n.
        assert torch.equal(got["grad_sum"], torch.full((2,), total_weight))
        assert torch.equal(got["grad_mean"], torch.full((2,), total_weight / n))
        assert torch.equal(got["grad_gather"], torch.full((2,), total_weight))
        # Only the replica holding the maximum (the last) receives the max's gradient.
        assert torch.equal(got["grad_max"], torch.full((2,), total_weight if r == n - 1 else 0.0))
        # Broadcast from 0: replica 0 collects everyone's gradient, the others none.
        assert torch.equal(got["grad_broadcast"], torch.full((2,), total_weight if r == 0 else 0.0))
        # Reduce-scatter: each output slice q is weighted by w_q, and every replica's input feeds it.
        expected = torch.cat([torch.full((2,), q + 1.0) for q in range(n)])
        assert torch.equal(got["grad_reduce_scatter"], expected)


def _gathers_of_different_lengths() -> str:
    repl = rp.Replicator()
    try:
        collectives.all_gather(torch.ones(repl.replica_id + 1), repl.groups.replica)
    except RuntimeError as error:
        return str(error)
    raise AssertionError("tensors of different sizes were gathered")


def test_tensors_of_different_sizes_raise_on_every_replica() -> None:
    for message in run_replicas(_gathers_of_different_lengths, 2):
        assert "different sizes" in message and "same shape and dtype" in message, message


def test_single_replica_collectives_are_identity() -> None:
    repl = rp.Replicator()
    x = torch.tensor([3.0, -1.0])
    ctx = repl.context
    for op in (ctx.all_sum, ctx.all_mean, ctx.all_max, ctx.all_min, ctx.all_gather, ctx.broadcast, ctx.reduce_scatter):
        assert torch.equal(op(x), x)
