"""The replicated input pipeline: one input_fn call per replica, samplers told the epoch, loaders sharded or skipped."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from replicator._tree import to_device
from replicator.context import InputContext
from replicator.errors import ReplicatorUsageError

__all__ = ["ReplicatedInput", "set_epoch", "shard_loader", "skips_without_reading", "resume_iterator", "generators"]


class ReplicatedInput:
    """What `Replicator.prepare_input` returns: hand it to `run` (or iterate it yourself).

    `run(..., epochs=E)` iterates `source` (what input_fn returned) once per epoch, tells its
    sampler the epoch and keeps the position for checkpoints. Iterated by hand, each new
    iteration is the next epoch, with the sampler told so.
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
        self.epoch = 0  # the next epoch a hand-made iteration reads

    def __iter__(self) -> Iterator[Any]:
        set_epoch(self.source, self.epoch)
        self.epoch += 1
        for batch in self.source:
            yield to_device(batch, self.device)


def _epoch_aware(source: Any) -> list[Any]:
    """The objects of `source` that shuffle by epoch: itself, its dataset, its sampler and batch sampler."""
    batch_sampler = getattr(source, "batch_sampler", None)
    candidates = [source, getattr(source, "dataset", None), getattr(source, "sampler", None), batch_sampler,
                  getattr(batch_sampler, "sampler", None)]
    found: dict[int, Any] = {}
    for candidate in candidates:
        if candidate is not None and callable(getattr(candidate, "set_epoch", None)):
            found.setdefault(id(candidate), candidate)
    return list(found.values())


def set_epoch(source: Any, epoch: int) -> None:
    """Tell every `set_epoch` of `source` (a DistributedSampler, an IterableDataset that shuffles) the epoch.

    Shuffling then differs between epochs and agrees between replicas, as DDP's recipe asks
    the user to do by hand.
    """
    for target in _epoch_aware(source):
        target.set_epoch(epoch)


def generators(source: Any) -> dict[str, torch.Generator]:
    """The torch.Generators that an epoch of `source` draws from besides the global one, by role."""
    found: dict[str, torch.Generator] = {}
    for role, owner in (("loader", source), ("sampler", getattr(source, "sampler", None)),
                        ("batch_sampler", getattr(getattr(source, "batch_sampler", None), "sampler", None))):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found.values()):
            found[role] = generator
    return found


def _loader_settings(loader: DataLoader) -> dict[str, Any]:
    """A DataLoader's settings besides its dataset and index sampling, to build a sibling with other sampling."""
    settings: dict[str, Any] = dict(
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers:
        settings["prefetch_factor"] = loader.prefetch_factor
    if loader.pin_memory_device:
        settings["pin_memory_device"] = loader.pin_memory_device
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    return settings


def _plain_map_loader(source: Any) -> bool:
    """A torch DataLoader itself (not a subclass, whose own iteration we would lose) over a map-style dataset."""
    return type(source) is DataLoader and not isinstance(source.dataset, IterableDataset)


def skips_without_reading(source: Any) -> bool:
    """True when `resume_iterator` can start `source` mid-epoch without reading the batches before."""
    return _plain_map_loader(source) or isinstance(source, (list, tuple))


class _Skipping(Iterator[Any]):
    """An index sampler's iterator that first drops `count` entries: indices only, no sample is read."""

    def __init__(self, inner: Iterator[Any], count: int) -> None:
        self.inner, self.count = inner, count

    def skip(self) -> None:
        for _ in range(self.count):
            if next(self.inner, _END) is _END:
                break
        self.count = 0

    def __next__(self) -> Any:
        self.skip()
        return next(self.inner)


class _SkipFirst(Sampler[Any]):
    """`inner` without its first `count` entries (for a DataLoader's sampler or batch sampler)."""

    def __init__(self, inner: Any, count: int) -> None:
        self.inner, self.count = inner, count
        self.iterator: _Skipping | None = None

    def __iter__(self) -> Iterator[Any]:
        self.iterator = _Skipping(iter(self.inner), self.count)
        return self.iterator

    def __len__(self) -> int:
        return max(len(self.inner) - self.count, 0)


def resume_iterator(source: Iterable[Any], skip: int) -> tuple[Iterator[Any], Callable[[], None]]:
    """An iterator over `source` from its batch `skip` on, and what moves the skipping ahead of the first fetch.

    A DataLoader over a map-style dataset skips index lists only (as accelerate's
    `skip_first_batches`), in a one-epoch sibling loader with the same settings; a list is
    sliced; anything else is read through. Calling the second value before the first `next`
    makes the sampler draw its order then, as it did when the epoch began (an epoch's draws
    from the generators come before any sample is loaded).
    """
    if skip and _plain_map_loader(source):
        loader: DataLoader = source  # type: ignore[assignment]
        settings = {**_loader_settings(loader), "persistent_workers": False}  # workers for this epoch only
        if loader.batch_sampler is not None:
            skipping = _SkipFirst(loader.batch_sampler, skip)
            sibling = DataLoader(loader.dataset, batch_sampler=skipping, **settings)
        else:  # batch_size=None: every sample is a batch
            skipping = _SkipFirst(loader.sampler, skip)
            sibling = DataLoader(loader.dataset, batch_size=None, sampler=skipping, **settings)
        return iter(sibling), lambda: skipping.iterator.skip() if skipping.iterator is not None else None
    if skip and isinstance(source, (list, tuple)):
        return iter(source[skip:]), lambda: None
    iterator = iter(source)

    def read_through() -> None:
        for _ in itertools.islice(iterator, skip):
            pass

    return iterator, read_through


def shard_loader(loader: DataLoader, context: InputContext) -> tuple[DataLoader, str]:
    """A DataLoader handed straight to run() on N replicas, split so each replica reads its own 1/N.

    Each replica keeps the loader's batch size (the global batch is N times it, as with
    DDP and accelerate) and draws from a DistributedSampler (seed 0, drop_last, shuffled when
    the loader shuffled). Returns the sharded loader and a line saying what was done. A
    loader that is already sharded is returned as it is; one whose split cannot be known
    (an IterableDataset, a custom sampler) is refused with the fix.
    """
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    if context.num_input_pipelines == 1 or any(isinstance(s, DistributedSampler) for s in samplers):
        return loader, ""
    fix = ("build it inside repl.prepare_input(input_fn), where ctx.sampler(dataset) or ctx.input_pipeline_id / "
           "ctx.num_input_pipelines give each replica its own part")
    where = f"raised on replica {context.replica_id}"
    if isinstance(loader.dataset, IterableDataset):
        raise ReplicatorUsageError(
            f"run() got a DataLoader over an IterableDataset on {context.num_replicas} replicas ({where}): every "
            f"replica would train on the same data, and replicator cannot split a stream it only reads; {fix}"
        )
    sampler = loader.sampler
    known = (type(sampler) is SequentialSampler
             or (type(sampler) is RandomSampler and not sampler.replacement
                 and sampler.num_samples == len(sampler.data_source)))
    plain_batches = loader.batch_sampler is None or type(loader.batch_sampler) is BatchSampler
    if type(loader) is not DataLoader or not known or not plain_batches:
        what = type(loader).__name__ if type(loader) is not DataLoader else (
            type(sampler).__name__ if not known else type(loader.batch_sampler).__name__)
        raise ReplicatorUsageError(
            f"run() got a DataLoader with a {what} on {context.num_replicas} replicas ({where}): every replica "
            f"would train on the same data, and replicator cannot tell how to split it; {fix}"
        )
    shuffle = isinstance(sampler, RandomSampler)
    shard: DistributedSampler[Any] = DistributedSampler(
        loader.dataset, num_replicas=context.num_input_pipelines, rank=context.input_pipeline_id,
        shuffle=shuffle, seed=0, drop_last=True,
    )
    batch = loader.batch_size
    sharded = DataLoader(loader.dataset, batch_size=batch, sampler=shard, drop_last=loader.drop_last,
                         **_loader_settings(loader))
    reads = f"batches of {batch}, {batch * context.num_replicas} samples per step in all" if batch else "its items"
    note = (f"replicator: run() split the DataLoader across {context.num_replicas} replicas (DistributedSampler, "
            f"shuffle={shuffle}, seed=0, drop_last=True): each replica reads {reads}, from its own {len(shard)} "
            "samples. To choose the split yourself, use repl.prepare_input(input_fn) with ctx.sampler(dataset, ...)")
    return sharded, note


_END = object()
