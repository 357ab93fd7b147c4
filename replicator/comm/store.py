"""The job's key-value store (the launcher's rendezvous store, which every process reaches) and ranks' records in it."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from replicator import codec

__all__ = ["job_store", "RankRecords"]


def job_store() -> dist.Store:
    """The store of the job's default process group (torch keeps no public accessor for it)."""
    return dist.distributed_c10d._get_default_store()


class RankRecords:
    """One record per rank under a prefix of the store, as the codec's tagged JSON: each rank leaves its own, and
    whoever needs them reads the others' (never unpickled)."""

    def __init__(self, prefix: str, store: dist.Store | None = None) -> None:
        self.prefix = prefix
        self._store = store

    @property
    def store(self) -> dist.Store:
        return self._store if self._store is not None else job_store()

    def key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def put(self, rank: int, value: Any) -> None:
        self.store.set(self.key(rank), codec.encode(value).decode("ascii"))

    def remove(self, rank: int) -> None:
        self.store.delete_key(self.key(rank))

    def present(self, ranks: Iterable[int]) -> dict[int, Any]:
        """The records of those of `ranks` that left one (a rank that died or hung left none)."""
        store, found = self.store, {}
        for rank in ranks:
            if store.check([self.key(rank)]):
                found[rank] = codec.decode(store.get(self.key(rank)))
        return found

    def wait(self, ranks: Iterable[int], within_s: float, poll_s: float = 0.05) -> dict[int, Any]:
        """The records of `ranks` once all are there, or of those that are when `within_s` has passed."""
        ranks, store = list(ranks), self.store
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and not store.check([self.key(rank) for rank in ranks]):
            time.sleep(poll_s)
        return self.present(ranks)
