"""The flat reducer: one all-reduce over the whole replica group, and its blocking twin for compressed reducers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from replicator.sync.bucket import Bucket, PendingReduction
from replicator.topology import ProcessGroups, group_of_mine

__all__ = ["FlatReducer", "FlatSum"]


class FlatReducer:
    """One all-reduce over the whole replica group (ring or tree, as the backend picks)."""

    name = "flat"

    def reduce(self, buffer: torch.Tensor, group: dist.ProcessGroup,
               bucket: Bucket | None = None) -> PendingReduction:
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        assert work is not None
        return work


class FlatSum:
    """One blocking all-reduce over a private copy of the replica group (a Summation)."""

    name = "flat"

    def __init__(self, groups: ProcessGroups, timeout_s: float) -> None:
        self.size = groups.mesh.num_replicas
        # The reducer's own copy: a worker thread's collectives must never share a group with the caller's
        # thread, whose collectives (ctx.all_sum, say) would interleave differently on each replica.
        self.group = group_of_mine(groups.mesh.replica_partition, timeout_s)

    def sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
