"""precision="bf16" with shard="optimizer"/"gradients": the computation runs in bf16, the gradient reduction in fp32
(seen by the reducer itself), and the update is shard=None's bit for bit."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import replicator as rp
from replicator.sync.bucket import Bucket
from replicator.testing import run_replicas

STEPS = 3


class RecordingReducer:
    """One all-reduce, as the flat reducer, recording the dtype of every buffer it is handed."""

    name = "recording"

    def __init__(self) -> None:
        self.dtypes: set[str] = set()

    def reduce(self, buffer: torch.Tensor, group: dist.ProcessGroup, bucket: Bucket | None = None) -> Any:
        self.dtypes.add(str(buffer.dtype))
        return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)


def trained_in_bf16(shard: str | None) -> dict[str, Any]:
    """Inside a replica of 2: under precision="bf16" with a recording reducer, what ran in which dtype."""
    reducer = RecordingReducer()
    repl = rp.Replicator(shard=shard, precision="bf16", reducer=reducer)
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        optimizer = repl.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    computed: set[str] = set()

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        logits = model(inputs)
        computed.add(str(logits.dtype))
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    generators = [torch.Generator().manual_seed(10 * step + repl.replica_id) for step in range(STEPS)]
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for g in generators]
    for _ in repl.run(step_fn, batches, record=False):
        pass
    return {"params": [p.detach().clone() for p in model.parameters()], "reduced": sorted(reducer.dtypes),
            "computed": sorted(computed), "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def trained_at_every_level() -> dict[str, Any]:
    return {str(shard): trained_in_bf16(shard) for shard in (None, "optimizer", "gradients")}


def test_bf16_computes_in_bf16_and_reduces_in_fp32_at_every_sharded_level() -> None:
    for replica, found in enumerate(run_replicas(trained_at_every_level, 2, timeout_s=180)):
        for shard in ("None", "optimizer", "gradients"):
            where = f"shard={shard}, replica {replica}"
            assert found[shard]["computed"] == ["torch.bfloat16"], where  # autocast ran the model in bf16
            assert found[shard]["reduced"] == ["torch.float32"], where  # every bucket the reducer summed was fp32
            assert found[shard]["param_dtypes"] == ["torch.float32"], where
            for got, expected in zip(found[shard]["params"], found["None"]["params"], strict=True):
                assert torch.equal(got, expected), where
