"""Reducers: how one flat gradient bucket is summed across replicas. Pluggable."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from replicator.topology import ProcessGroups

__all__ = ["Reducer", "PendingReduction", "FlatReducer", "make_reducer"]


class PendingReduction(Protocol):
    """A reduction in flight; `wait()` returns once the buffer holds the sum."""

    def wait(self) -> object: ...


class Reducer(Protocol):
    """Sums `buffer` in place over `group`, asynchronously."""

    name: str

    def reduce(self, buffer: torch.Tensor, group: dist.ProcessGroup) -> PendingReduction: ...


class FlatReducer:
    """One all-reduce over the whole replica group (ring or tree, as the backend picks)."""

    name = "flat"

    def reduce(self, buffer: torch.Tensor, group: dist.ProcessGroup) -> PendingReduction:
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        assert work is not None
        return work


def make_reducer(spec: "str | Reducer", groups: ProcessGroups | None = None) -> Reducer:
    """A reducer from its name, or the reducer object itself.

    `groups` (the job's process groups) lets topology-aware reducers find the intra- and
    inter-node groups.
    """
    if not isinstance(spec, str):
        return spec
    if spec == "flat":
        return FlatReducer()
    raise ValueError(f"unknown reducer {spec!r}; available: 'flat' (or pass an object with a reduce() method)")
