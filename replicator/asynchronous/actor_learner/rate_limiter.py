"""Internal: the samples-per-insert rate limiter of one replay shard (Reverb's SampleToInsertRatio)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RateLimiter"]


@dataclass
class RateLimiter:
    """Keeps `samples ≈ samples_per_insert × (inserts − min_size)` within ± `error_buffer`.

    Sampling waits until `min_size` items are in and while one more batch would fall below the
    band; inserting is allowed while one more item stays inside it (actors wait otherwise).
    The band is never narrower than one insert plus one batch, so one side can always move: a
    learner and its actors never wait on each other at once. `samples_per_insert=None` limits
    nothing beyond `min_size` (actors never wait).
    """

    min_size: int
    samples_per_insert: float | None
    error_buffer: float
    batch_size: int
    inserts: int = 0
    samples: int = 0
    outside: int = 0  # commits and samples that left the band (always 0: counted so that a test can show it)

    @classmethod
    def of(cls, min_size: int, samples_per_insert: float | None, tolerance: float, batch_size: int) -> RateLimiter:
        """A shard's limiter: `tolerance` is relative to the ratio, measured over the replay's first `min_size` items
        (Acme's recipe: error_buffer = tolerance × samples_per_insert × min_size)."""
        if samples_per_insert is None:
            return cls(min_size, None, math.inf, batch_size)
        # One insert and one batch must fit in the band (twice the buffer), or both sides could wait at once.
        floor = (samples_per_insert + batch_size) / 2
        return cls(min_size, samples_per_insert, max(tolerance * samples_per_insert * min_size, floor), batch_size)

    @property
    def _offset(self) -> float:
        assert self.samples_per_insert is not None
        return self.samples_per_insert * self.min_size

    def _diff(self, inserts: int, samples: int) -> float:
        assert self.samples_per_insert is not None
        return self.samples_per_insert * inserts - samples

    def can_sample(self, count: int) -> bool:
        if self.inserts < self.min_size:
            return False
        if self.samples_per_insert is None:
            return True
        return self._diff(self.inserts, self.samples + count) >= self._offset - self.error_buffer

    def can_insert(self, count: int = 1) -> bool:
        if self.samples_per_insert is None:
            return True
        return self._diff(self.inserts + count, self.samples) <= self._offset + self.error_buffer

    def insert_room(self) -> int:
        """How many items may be committed now, one after another, with the band kept (a large number when the
        ratio is off)."""
        if self.samples_per_insert is None:
            return 1 << 62
        room = max(int((self._offset + self.error_buffer + self.samples) / self.samples_per_insert) - self.inserts, 0)
        while room and not self.can_insert(room):  # the division may round up past the band
            room -= 1
        return room

    def committed(self, count: int) -> None:
        """`count` items went in (the caller checked can_insert, or the replay was overrun: see ReplayShard)."""
        self.inserts += count
        if self.samples_per_insert is not None and self._diff(self.inserts, self.samples) > self._offset + \
                self.error_buffer:
            self.outside += 1

    def sampled(self, count: int) -> None:
        """`count` items were drawn (the caller checked can_sample)."""
        self.samples += count
        if self.inserts < self.min_size or (self.samples_per_insert is not None and self._diff(
                self.inserts, self.samples) < self._offset - self.error_buffer):
            self.outside += 1

    def realised(self) -> float | None:
        """Samples per item inserted since the replay could first be sampled (None before that)."""
        past = self.inserts - self.min_size
        return self.samples / past if past > 0 else None
