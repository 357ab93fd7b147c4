"""Evaluation across replicas: a split without padding, and predictions gathered back into dataset order.

A DistributedSampler gives every replica the same number of samples by repeating some
(drop_last=False) or dropping some (drop_last=True), so gathered predictions count the
repeated samples twice or miss the dropped ones. Accelerate's gather_for_metrics infers
what to drop from global state (the dataset's length, "the end of the dataloader") and has
got it wrong for uneven batches and ends (accelerate #575, #1674). Here nothing is
inferred: `EvaluationSampler` gives each replica a contiguous share with no padding at all,
which concatenated in replica order is the dataset; and when the samples came from another
sampler, the gather takes its dataset indices along and puts every sample in its place,
once (ReplicaContext.gather_for_metrics).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["EvaluationSampler", "sampler_indices", "in_dataset_order"]


class EvaluationSampler(Sampler[int]):
    """Replica `replica_id`'s contiguous share of a dataset of `len(dataset)` samples, in order, without padding.

    Shares differ by at most one sample, and concatenated in replica order they are the
    dataset: gathering every replica's predictions (ctx.gather_for_metrics) gives one
    process's predictions, in dataset order, whatever the batch size.
    """

    def __init__(self, dataset: Sized | int, num_replicas: int, replica_id: int) -> None:
        size = dataset if isinstance(dataset, int) else len(dataset)
        self.start = replica_id * size // num_replicas
        self.stop = (replica_id + 1) * size // num_replicas

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def sampler_indices(sampler: Any) -> list[int]:
    """The dataset indices that `sampler` (a Sampler, a DataLoader or any iterable of indices) gives, in order.

    A DataLoader's are those of its batches, so that a batch sampler's drop_last counts.
    """
    if isinstance(sampler, DataLoader):
        if sampler.batch_sampler is not None:
            return [int(index) for batch in sampler.batch_sampler for index in batch]
        sampler = sampler.sampler
    return [int(index) for index in sampler]


def in_dataset_order(columns: list[torch.Tensor], indices: torch.Tensor) -> list[torch.Tensor]:
    """`columns`' rows sorted by their dataset `indices`, each index once: its first row in gathered order."""
    order = torch.argsort(indices, stable=True)
    ranked = indices[order]
    first = torch.ones_like(ranked, dtype=torch.bool)
    first[1:] = ranked[1:] != ranked[:-1]  # a padded sampler's repeats come after the original
    rows = order[first]
    return [column[rows.to(column.device)] for column in columns]
