"""The pipeline bubble: the idle share of each lane's time between the first start and the last end."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["idle_share"]


def idle_share(intervals: Iterable[tuple[Hashable, float, float, bool]]) -> float:
    """1 - computing time / (lanes x span), over (lane, start, end, is_compute) intervals; 0.0 for none.

    A lane is one stage (of one replica). The span runs from the earliest start to the
    latest end over all lanes, so a stage that starts late or ends early is idle meanwhile:
    that is the bubble GPipe's (K - 1) / (M + K - 1) describes.
    """
    rows = list(intervals)
    if not rows:
        return 0.0
    lanes = {lane for lane, _, _, _ in rows}
    span = max(end for _, _, end, _ in rows) - min(start for _, start, _, _ in rows)
    busy = sum(end - start for _, start, end, compute in rows if compute)
    return 1.0 - busy / (len(lanes) * span) if span > 0 else 0.0
