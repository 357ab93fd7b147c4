"""Buffers across replicas: BatchNorm running statistics averaged, as TF-Replicator reads them.

Gradients keep parameters identical; buffers that a forward pass updates from its own data
(BatchNorm's running mean and variance) drift apart, each replica's seeing only its shard.
Averaging them is what a mirrored, read-synchronized variable gives in TensorFlow: the mean
of the replicas' estimates. Integer buffers (BatchNorm's `num_batches_tracked`) count steps
that every replica took alike, so they take replica 0's values, never a rounded mean.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from replicator.agreement import Agreement

__all__ = ["average_buffers"]


def average_buffers(modules: Iterable[torch.nn.Module], group: dist.ProcessGroup | None, agreement: Agreement) -> None:
    """Average floating-point buffers over `group` and give integer ones replica 0's values.

    One collective per (dtype, device): an all-reduce, or for integers a broadcast. Every
    replica must call it at the same point.
    """
    buffers = list({id(b): b for module in modules for b in module.buffers()}.values())
    if group is None or not buffers:
        return
    numel = sum(b.numel() for b in buffers)
    # Different models (or buffer sets) would feed mismatched sizes to the collective: fail together instead.
    agreement.require_same(f"average {len(buffers)} buffers of {numel} elements")
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in buffers:
        by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    size = dist.get_world_size(group)
    first = dist.get_global_rank(group, 0)
    for (dtype, _), members in by_kind.items():
        flat = torch.cat([b.detach().reshape(-1) for b in members])
        if dtype.is_floating_point or dtype.is_complex:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat /= size
        else:
            dist.broadcast(flat, src=first, group=group)
        with torch.no_grad():
            for buffer, part in zip(members, flat.split([b.numel() for b in members])):
                buffer.copy_(part.view_as(buffer))
