"""Lossless, blocking sums over a reducer's private process groups, run on its worker thread (internal)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["Summation", "check_group"]


class Summation(Protocol):
    """Sums a tensor in place over the replicas of this stage; returns when done.

    A summation may also have `sum_after(tensor, arrival)`, which takes a completed agreement
    check as its first barrier (see SharedMemorySum); SummationReducer uses it when it exists,
    and calls its `close()`, if it has one, when the reducer closes.
    """

    name: str
    size: int  # how many replicas contribute to the sum

    def sum_(self, tensor: torch.Tensor) -> None: ...


def check_group(group: dist.ProcessGroup, size: int, name: str, checked: set[int]) -> None:
    """A reducer sums over its own copies of the replica groups; refuse a group of another size."""
    if id(group) in checked:
        return
    actual = dist.get_world_size(group)
    if actual != size:
        raise ValueError(
            f"reducer {name!r} was built for replica groups of {size} processes but was asked to reduce over a "
            f"group of {actual}; build it with make_reducer(spec, groups) from the same job's process groups"
        )
    checked.add(id(group))
