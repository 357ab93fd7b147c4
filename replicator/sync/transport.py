"""How shard="gradients"' buckets travel: in rows a reducer lends, each slice summed where it stays (internal)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from replicator.sync.bucket import Bucket, PendingReduction

__all__ = ["SlicedTransport"]


class SlicedTransport:
    """How one synchronizer's buckets travel under shard="gradients".

    Where the reducer lends rows of shared memory (`lend`: the shared-memory reducer on one node), each bucket is
    loaded straight into one of two such rows per dtype, taken in turns (bucket k + 1 fills one while bucket k is
    summed from the other), so no bucket is copied in; and where the reducer can stop after its scatter (`scatter`),
    it sums this replica's slice of the average straight into the tensor that keeps it (`slice_for`), so no slice
    is copied out. The rows also carry the parameters' all-gather after the step (ShardedOptimizer). They stay
    mapped between steps (a double buffer of the longest bucket per replica, where the reducer used to keep one
    staging row of it and the buckets two private buffers during backward); the buckets' own buffers are released
    as before.
    """

    def __init__(self, buckets: list[Bucket], reducer: object) -> None:
        self.scatter = getattr(reducer, "scatter", None)
        self.slice_for: Callable[[Bucket], torch.Tensor] | None = None  # where a scatter sums this replica's slice
        self.rows: dict[int, torch.Tensor] = {}  # bucket index -> the lent row it travels in (its first columns)
        # Each row carries its buckets in order: bucket k loads into it straight only on its turn (once the bucket
        # before it there is settled), else into a tensor of its own, copied into the row when k launches, by when
        # that one always is settled. So every replica sums every bucket in the same row, whatever order its
        # gradients came in: a replica staging a bucket its peers sum in place would read rows they never wrote.
        self._after: dict[int, int | None] = {}  # bucket index -> the next bucket in its row
        self._first: dict[int, int] = {}  # a row's address -> its first bucket
        self._turn: dict[int, int | None] = {}  # a row's address -> the bucket whose turn it is
        self._summed_into: dict[int, torch.Tensor] = {}  # bucket index -> the slice its scatter sums into
        lend: Callable[[int, torch.dtype, torch.device], torch.Tensor | None] | None = getattr(reducer, "lend", None)
        kinds: dict[tuple[torch.dtype, torch.device], list[Bucket]] = {}
        for bucket in buckets:
            kinds.setdefault((bucket.buffer.dtype, bucket.buffer.device), []).append(bucket)
        for (dtype, device), alike in kinds.items() if lend is not None else ():
            assert lend is not None
            longest = max(bucket.numel + len(bucket.params) for bucket in alike)
            rows = [lend(longest, dtype, device) for _ in range(min(2, len(alike)))]  # the same calls on every replica
            for turn, bucket in enumerate(alike):
                row = rows[turn % len(rows)]
                if row is not None:
                    self.rows[bucket.index] = row
                    self._first.setdefault(row.data_ptr(), bucket.index)
                    later = alike[turn + len(rows)] if turn + len(rows) < len(alike) else None
                    self._after[bucket.index] = later.index if later is not None else None
                    bucket.release_buffer()  # the one wrapping built: the first backward loads into the row too
        self.reset()

    def reset(self) -> None:
        """A new window: every row's turn goes back to its first bucket; slices not settled are forgotten."""
        self._turn = dict(self._first)
        self._summed_into.clear()

    def _row(self, bucket: Bucket) -> torch.Tensor | None:
        """`bucket`'s place in its row, if it has one."""
        row = self.rows.get(bucket.index)
        return None if row is None else row[: bucket.numel + len(bucket.params)]

    def ensure_buffer(self, bucket: Bucket) -> None:
        """Give `bucket` a buffer to load into: its row on its turn (always so when gradients come in bucket
        order), else a tensor of its own until it launches."""
        if bucket.views:
            return
        row = self._row(bucket)
        if row is not None and self._turn[row.data_ptr()] == bucket.index:
            bucket.ensure_buffer(row)
        else:
            bucket.ensure_buffer()

    def start(self, bucket: Bucket, group: dist.ProcessGroup | None) -> PendingReduction | None:
        """Start `bucket`'s reduce-scatter (in its row: moved there first if it loaded elsewhere), this replica's
        slice summed into `slice_for(bucket)`; None where the reducer cannot stop after the scatter (the caller
        reduces in full)."""
        if self.scatter is None:
            return None
        row = self._row(bucket)
        if row is not None and bucket.buffer.data_ptr() != row.data_ptr():
            # Its turn now: buckets launch in order, and the one before it in the row settled when the bucket between
            # them launched. Never the window's first (its row's first too), whose reduction may take the window's
            # check as proof that every row is loaded: a row loaded after the check started would be read early.
            assert self._turn[row.data_ptr()] == bucket.index and bucket.arrival is None
            loaded = bucket.buffer
            bucket.release_buffer()
            bucket.ensure_buffer(row)
            row.copy_(loaded)
        out = self.slice_for(bucket) if self.slice_for is not None else None
        pending: PendingReduction | None = self.scatter(bucket.buffer, group, bucket, out)
        if pending is not None and out is not None:
            self._summed_into[bucket.index] = out
        return pending

    def settle(self, bucket: Bucket) -> torch.Tensor | None:
        """`bucket` is reduced: its row passes to the next bucket there. The slice its scatter summed into, or None
        (take it from the buffer)."""
        row = self.rows.get(bucket.index)
        if row is not None:
            self._turn[row.data_ptr()] = self._after[bucket.index]
        return self._summed_into.pop(bucket.index, None)
