"""Buffers across replicas: BatchNorm running statistics averaged, as TF-Replicator reads them.

Gradients keep parameters identical; buffers that a forward pass updates from its own data
(BatchNorm's running mean and variance) drift apart, each replica's seeing only its shard.
Averaging them is what a mirrored, read-synchronized variable gives in TensorFlow: the mean
of the replicas' estimates. Integer buffers (BatchNorm's `num_batches_tracked`) count steps
that every replica took alike, so they take replica 0's values, never a rounded mean.
Spectral norm's power-iteration buffers are left alone: they must already be equal
(replicator.nn.spectral says why), and the guard that runs next names them if they are not.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from replicator.comm.agreement import Agreement
from replicator.nn.spectral import power_iteration_buffers

__all__ = ["average_buffers"]


def average_buffers(modules: Iterable[torch.nn.Module], group: dist.ProcessGroup | None, agreement: Agreement) -> None:
    """Average floating-point buffers over `group` and give integer ones replica 0's values.

    Every replica must call it at the same point. The mean is taken as replica 0's value plus
    the mean of the replicas' differences from it, in double precision: buffers that are
    already equal on every replica (masks, constant tables, CrossReplicaBatchNorm's
    statistics) come back bit for bit, and half-precision sums cannot overflow. Spectral norm's
    power-iteration vectors are skipped: an average would hide replicas that took different
    numbers of discriminator calls, and is no unit vector.
    """
    if group is None:
        return
    modules = list(modules)
    iterated = power_iteration_buffers(modules)
    buffers = list({id(b): b for module in modules for b in module.buffers() if id(b) not in iterated}.values())
    layout = ";".join(f"{b.dtype}{tuple(b.shape)}" for b in buffers)
    # Different models (or buffer sets) would pair mismatched collectives: fail together instead.
    shapes = zlib.crc32(layout.encode())
    agreement.require_same(f"averaging the model's {len(buffers)} buffers (dtypes and shapes hashed: {shapes})")
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in buffers:
        by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    size = dist.get_world_size(group)
    first = dist.get_global_rank(group, 0)
    for (dtype, _), members in by_kind.items():
        flat = torch.cat([b.detach().reshape(-1) for b in members])
        reference = flat.clone()
        dist.broadcast(reference, src=first, group=group)
        if dtype.is_floating_point or dtype.is_complex:
            wide = torch.complex128 if dtype.is_complex else torch.float64
            difference = flat.to(wide) - reference.to(wide)
            dist.all_reduce(difference, op=dist.ReduceOp.SUM, group=group)
            reference = (reference.to(wide) + difference / size).to(dtype)
        with torch.no_grad():
            for buffer, part in zip(members, reference.split([b.numel() for b in members])):
                buffer.copy_(part.view_as(buffer))
