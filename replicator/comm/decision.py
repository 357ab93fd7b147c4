"""Joint yes/no decisions: a set-up step goes ahead only when every process of the group says yes."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["everyone_agrees"]


def everyone_agrees(yes: bool, group: dist.ProcessGroup | None) -> bool:
    """True on every member when all of them said yes, False on every member otherwise.

    One MIN all-reduce of a host integer: the group must be able to carry CPU tensors (Gloo).
    `group=None` is the default group, or this process alone when there is none.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return yes
    flag = torch.tensor([int(yes)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
