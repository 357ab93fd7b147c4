"""The replicated input pipeline: one input_fn call per replica, batches moved to its device."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from replicator.context import InputContext

__all__ = ["ReplicatedInput", "to_device", "batch_size_of"]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to `device`; leave the rest."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def batch_size_of(batch: Any) -> int:
    """Dimension 0 of the first tensor found in the batch, 0 when there is none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = batch_size_of(value)
        if size:
            return size
    return 0


class ReplicatedInput:
    """What `Replicator.prepare_input` returns: iterate it (or hand it to `run`).

    Each new iteration is a new epoch: a sampler with `set_epoch` (such as
    DistributedSampler) is told the epoch so that shuffling differs between epochs but
    agrees between replicas.
    """

    def __init__(self, input_fn: Callable[[InputContext], Iterable[Any]], context: InputContext, device: torch.device) -> None:
        self.context = context
        self.device = device
        self.source = input_fn(context)
        if not hasattr(self.source, "__iter__"):
            raise TypeError(
                f"input_fn must return an iterable of batches (a DataLoader, a list, a generator), "
                f"got {type(self.source).__name__}"
            )
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.source, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        self.epoch += 1
        for batch in self.source:
            yield to_device(batch, self.device)
