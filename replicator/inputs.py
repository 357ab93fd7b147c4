"""The replicated input pipeline: one input_fn call per replica, batches moved to its device."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from replicator._tree import to_device
from replicator.context import InputContext

__all__ = ["ReplicatedInput"]


class ReplicatedInput:
    """What `Replicator.prepare_input` returns: iterate it (or hand it to `run`).

    Each new iteration is a new epoch: a sampler with `set_epoch` (such as
    DistributedSampler) is told the epoch so that shuffling differs between epochs but
    agrees between replicas. Checkpoints record the position (`state_dict`) and a restored
    run re-creates the epoch and skips what was consumed (`load_state_dict`).
    """

    def __init__(self, input_fn: Callable[[InputContext], Iterable[Any]], context: InputContext,
                 device: torch.device) -> None:
        self.context = context
        self.device = device
        self.source = input_fn(context)
        if not hasattr(self.source, "__iter__"):
            raise TypeError(
                f"input_fn must return an iterable of batches (a DataLoader, a list, a generator), "
                f"got {type(self.source).__name__}"
            )
        self.epoch = 0
        self._epoch_rng: torch.Tensor | None = None  # torch's generator as the current epoch began
        self._resume: tuple[int, torch.Tensor | None] | None = None

    def state_dict(self, batches: int) -> dict[str, Any]:
        """Where the input stands once `batches` batches of the current epoch are consumed (for checkpoints)."""
        state: dict[str, Any] = {"epoch": max(self.epoch - 1, 0), "batches": batches}
        if self._epoch_rng is not None:
            state["epoch_rng"] = self._epoch_rng
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration re-create epoch `state["epoch"]` and skip its first `state["batches"]` batches."""
        self.epoch = int(state["epoch"])
        self._resume = (int(state["batches"]), state.get("epoch_rng"))

    def __iter__(self) -> Iterator[Any]:
        # A DataLoader built with batch_sampler= hides the shuffling sampler one level down.
        batch_sampler = getattr(self.source, "batch_sampler", None)
        for sampler in (getattr(self.source, "sampler", None), getattr(batch_sampler, "sampler", None)):
            if sampler is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
        self.epoch += 1
        skip, epoch_rng = self._resume or (0, None)
        self._resume = None
        current = torch.get_rng_state()
        if epoch_rng is not None:
            # A shuffling DataLoader draws its order (and worker seeds) from torch's generator
            # when iterated: re-create the interrupted epoch from the state it began with.
            torch.set_rng_state(epoch_rng)
        self._epoch_rng = torch.get_rng_state()
        batches = iter(self.source)
        for _ in range(skip):  # batches the checkpointed run had already trained on
            if next(batches, _END) is _END:
                break
        if epoch_rng is not None:
            torch.set_rng_state(current)  # ...then the restored stream goes on where it was saved
        for batch in batches:
            yield to_device(batch, self.device)


_END = object()
