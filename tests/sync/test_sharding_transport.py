"""shard="gradients" on the shared-memory reducer moves nothing it need not: buckets load into rows it lends, each
replica's slice is summed straight into the tensor that keeps it, the parameters are gathered in place.

Bit for bit what the full sum (shard=None) gives: the same additions over the same rows, only written elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_replicas

REPLICAS = 3  # uneven slices
STEPS = 3


def scatter_into_slices_and_gather_into_parts(replicas: int) -> dict[str, Any]:
    """Inside a replica on one node: the reducer's scatter into `out`, and its all-gather into parts."""
    from replicator.sync.bucket import assign_buckets
    from replicator.sync.reducers import make_reducer
    from replicator.topology import build_process_groups, discover

    groups = build_process_groups(discover())
    reducer: Any = make_reducer("shm", groups)
    rank = dist.get_rank()
    rows = [reducer.lend(120, torch.float32, torch.device("cpu")) for _ in range(2)]
    found: dict[str, Any] = {}
    for numel in (2, 11, 100):  # fewer elements than replicas; uneven slices; most of a row
        for where in ("staged", "lent"):
            (bucket,) = assign_buckets([torch.nn.Parameter(torch.zeros(numel))], 1 << 30, 1 << 30)
            if where == "lent":  # the first columns of a lent row, as shard="gradients" loads a bucket
                bucket.release_buffer()
                bucket.ensure_buffer(rows[0][: numel + 1])
            values = torch.arange(numel + 1, dtype=torch.float32) * (rank + 1) / 7  # roundings in the sums
            bucket.buffer.copy_(values)
            total = numel + 1
            mine = slice(total * rank // replicas, total * (rank + 1) // replicas)
            out = torch.full((max(0, min(mine.stop, numel) - min(mine.start, numel)),), float("nan"))
            reducer.scatter(bucket.buffer, groups.replica, bucket, out).wait()
            whole = values.clone()  # the full sum of the same rows, as shard=None reduces
            reducer.reduce(whole, groups.replica).wait()
            found[f"{where} {numel}"] = (values, bucket.buffer.clone(), out, whole)
    truth = [torch.arange(n, dtype=torch.float32) + 1000 * k for k, n in enumerate((0, 51, 2, 64))]
    for name, via in (("alternating rows", [rows[0], rows[1], rows[0], rows[1]]),
                      ("one row", [rows[0]] * 4), ("staged", [None] * 4)):
        buckets, parts_of = [], []
        for whole, row in zip(truth, via):
            numel = whole.numel()
            mine = slice(numel * rank // replicas, numel * (rank + 1) // replicas)
            known = torch.full((numel,), -1.0)
            known[mine] = whole[mine]
            cuts = [0, numel // 3, numel // 2 + 1, numel]  # parts that cross the replicas' slices
            parts = [(known[a:b], a) for a, b in zip(cuts, cuts[1:]) if a < b]
            buckets.append((parts, [numel * k // replicas for k in range(replicas + 1)], row))
            parts_of.append(known)
        reducer.all_gather_into(buckets).wait()
        found[f"gather {name}"] = all(torch.equal(got, whole) for got, whole in zip(parts_of, truth))
    reducer.close()
    return found


@pytest.mark.parametrize("replicas", [2, 3, 4])  # the slice summed by one addition (2), by sum(dim=0) (3, 4)
def test_shared_memory_reducer_scatters_into_a_slice_and_gathers_into_parts(replicas: int) -> None:
    results = run_replicas(scatter_into_slices_and_gather_into_parts, replicas, replicas, timeout_s=240)
    for rank, found in enumerate(results):
        for name in ("alternating rows", "one row", "staged"):
            assert found[f"gather {name}"], (rank, name)
        for numel in (2, 11, 100):
            total = numel + 1
            mine = slice(total * rank // replicas, total * (rank + 1) // replicas)
            for where in ("staged", "lent"):
                before, after, out, whole = found[f"{where} {numel}"]
                # The slice's sum, short of the presence slot, went to `out`, in the bits of the full sum.
                assert torch.equal(out, whole[mine.start : min(mine.stop, numel)]), (rank, where, numel)
                assert torch.equal(after[numel:], whole[numel:])  # the presence slot, summed for everyone
                assert torch.equal(after[:numel], before[:numel])  # the gradients themselves, left as loaded


class Layers(torch.nn.Module):
    """Four layers, one bucket each at the cap below; `backwards` runs them in reverse of how they were built, so
    their gradients come in the reverse of the buckets' order."""

    def __init__(self, backwards: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.backwards = backwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers) if self.backwards else self.layers:
            x = torch.tanh(layer(x))
        return x


def train_layers(backwards: bool) -> dict[str, Any]:
    """Inside a replica: the same model trained with shard=None and shard="gradients"; where the buckets lay."""
    unsharded, _ = train_once(None, backwards)
    sharded, found = train_once("gradients", backwards)
    found["bit_equal"] = all(torch.equal(a, b) for a, b in zip(unsharded, sharded))
    return found


def train_once(shard: str | None, backwards: bool) -> tuple[list[torch.Tensor], dict[str, Any]]:
    found: dict[str, Any] = {"private": 0, "lent": 0}
    repl = rp.Replicator(shard=shard, bucket_cap_mb=0.0002)  # ~50 elements: one layer a bucket
    with repl.scope():
        torch.manual_seed(0)
        model = Layers(backwards)
        optimizer = repl.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1))
    synchronizer = repl.optimizers.wrapped[0].synchronizer

    def where_buckets_lie(param: torch.Tensor) -> None:  # after the synchronizer's own hook: registered later
        rows = synchronizer.transport.rows
        for bucket in synchronizer.buckets:
            if bucket.buffer.numel():
                start, row = bucket.buffer.data_ptr(), rows[bucket.index]
                inside = row.data_ptr() <= start < row.data_ptr() + row.numel() * row.element_size()
                found["lent" if inside else "private"] += 1

    if shard is not None:
        found["rows"] = len({row.data_ptr() for row in synchronizer.transport.rows.values()})
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(where_buckets_lie)

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    generator = torch.Generator().manual_seed(7)
    batches = [(torch.randn(4 * REPLICAS, 8, generator=generator), torch.randn(4 * REPLICAS, 8, generator=generator))
               for _ in range(STEPS)]
    mine = slice(4 * repl.replica_id, 4 * (repl.replica_id + 1))
    for _ in repl.run(step_fn, [(x[mine], y[mine]) for x, y in batches], record=False):
        pass
    if shard is not None:
        found["buckets"] = len(synchronizer.buckets)
        found["staged"] = len(synchronizer.reducer.summation._staging)  # the reducer's staging segments
    repl.close()
    return [p.detach().clone() for p in model.parameters()], found


def test_gradients_level_sums_buckets_in_lent_rows_bit_for_bit() -> None:
    """In bucket order every bucket loads into a lent row; in reverse order the early ones load into tensors of
    their own and move into their row when they launch. Either way no replica stages a bucket (each sums in the
    rows its peers wrote), and the parameters are bit for bit shard=None's."""
    for backwards in (False, True):
        for rank, found in enumerate(run_replicas(train_layers, REPLICAS, backwards, timeout_s=300)):
            assert found["buckets"] == 4 and found["rows"] == 2, found
            assert found["bit_equal"], (rank, backwards)
            assert found["staged"] == 0, (rank, backwards, found)
            assert found["lent"] > 0 and (found["private"] > 0) == backwards, (rank, backwards, found)
