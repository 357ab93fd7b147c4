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
    is copied out. The rows also carry the parameters' all-gather after the step (ShardedOptimizer). Two rows of the
    longest bucket stay mapped between steps, as DeepSpeed's two reduction buffers do; the buckets' own buffers are
    released as before.
    """

    def __init__(self, buckets: list[Bucket], reducer: object) -> None:
        self.scatter = getattr(reducer, "scatter", None)
        self.slice_for: Callable[[Bucket], torch.Tensor] | None = None  # where a scatter sums this replica's slice
        self.rows: dict[int, torch.Tensor] = {}  # bucket index -> the lent row it is loaded into (its first columns)
        self._holder: dict[int, Bucket] = {}  # a row's address -> the bucket loaded into it
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
                    bucket.release_buffer()  # the one wrapping built: the first backward loads into the row too

    def ensure_buffer(self, bucket: Bucket) -> None:
        """Give `bucket` a buffer to load into: its row, once the bucket loaded there before is settled (always so
        when gradients come in bucket order), else a private tensor, which the reducer stages."""
        if bucket.views:
            return
        row = self.rows.get(bucket.index)
        holder = self._holder.get(row.data_ptr()) if row is not None else None
        if row is not None and (holder is None or holder is bucket or not holder.views):
            self._holder[row.data_ptr()] = bucket
            bucket.ensure_buffer(row[: bucket.numel + len(bucket.params)])
        else:
            bucket.ensure_buffer()

    def start(self, bucket: Bucket, group: dist.ProcessGroup | None) -> PendingReduction | None:
        """Start `bucket`'s reduce-scatter, this replica's slice summed into `slice_for(bucket)`; None where the reducer
        cannot stop after the scatter (the caller reduces in full)."""
        if self.scatter is None:
            return None
        out = self.slice_for(bucket) if self.slice_for is not None else None
        pending: PendingReduction | None = self.scatter(bucket.buffer, group, bucket, out)
        if pending is not None and out is not None:
            self._summed_into[bucket.index] = out
        return pending

    def summed(self, bucket: Bucket) -> torch.Tensor | None:
        """The slice `bucket`'s scatter summed into, once (None: take it from the buffer)."""
        return self._summed_into.pop(bucket.index, None)

    def clear(self) -> None:
        """Forget the slices of a window that ended without settling them."""
        self._summed_into.clear()
