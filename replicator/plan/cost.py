"""Alpha–beta cost of all-reduce: ring, recursive halving-doubling and multi-level (hierarchical)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replicator.plan._checks import raise_if

__all__ = [
    "Level",
    "ring_reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "rhd_reduce_scatter",
    "rhd_all_reduce",
    "flat_ring_all_reduce",
    "flat_rhd_all_reduce",
    "hierarchical_all_reduce",
    "ALGORITHMS",
    "all_reduce_time",
]


@dataclass(frozen=True)
class Level:
    """One tier of the machine: `size` members joined by links of one kind.

    `bandwidth` is bytes/s in one direction of one link at this tier (an NVLink
    pair, a node's network port); `latency` is the cost of one message step at this
    tier, wire and software together. `shared_by` is how many GPUs drive one such
    link at the same time when every GPU communicates at this tier: 1 inside a node,
    the GPUs per node for a node's network port.
    """

    size: int
    bandwidth: float
    latency: float
    shared_by: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        level = f"level {self.name or '?'}"
        raise_if(self.size < 1, f"{level}: size must be >= 1, got {self.size}")
        raise_if(self.bandwidth <= 0, f"{level}: bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        raise_if(self.latency < 0, f"{level}: latency must be >= 0 s, got {self.latency}")
        raise_if(self.shared_by < 1, f"{level}: shared_by must be >= 1, got {self.shared_by}")

    @property
    def per_gpu_bandwidth(self) -> float:
        """Bandwidth one GPU gets when all GPUs behind a link use it at once."""
        return self.bandwidth / self.shared_by


def _check(p: int, nbytes: float) -> None:
    if p < 1:
        raise ValueError(f"a collective needs at least 1 participant, got {p}")
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes}")


def _is_power_of_two(p: int) -> bool:
    return p >= 1 and p & (p - 1) == 0


def ring_reduce_scatter(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """(p-1) steps, each sending one 1/p chunk: (p-1)α + (p-1)/p · S/β."""
    _check(p, nbytes)
    return (p - 1) * alpha + (p - 1) / p * nbytes / beta


def ring_all_gather(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Mirror of reduce-scatter; `nbytes` is the gathered (full) size."""
    return ring_reduce_scatter(p, nbytes, alpha, beta)


def ring_all_reduce(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Reduce-scatter then all-gather: 2(p-1)α + 2(p-1)/p · S/β."""
    return ring_reduce_scatter(p, nbytes, alpha, beta) + ring_all_gather(p, nbytes, alpha, beta)


def rhd_reduce_scatter(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Recursive halving: log2(p) steps of S/2, S/4, ...: log2(p)α + (p-1)/p · S/β (p a power of two)."""
    _check(p, nbytes)
    if not _is_power_of_two(p):
        raise ValueError(
            f"recursive halving needs a power-of-two group, got {p}; use rhd_all_reduce, which folds the extras")
    return math.log2(p) * alpha + (p - 1) / p * nbytes / beta


def rhd_all_reduce(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Rabenseifner: halving reduce-scatter then doubling all-gather: 2·log2(p)α + 2(p-1)/p · S/β.

    When p is not a power of two the r = p - 2^⌊log2 p⌋ extra ranks first hand their
    whole vector to a partner and get the result back at the end: 2(α + S/β) more.
    """
    _check(p, nbytes)
    core = 1 << (p.bit_length() - 1)
    time = 2 * rhd_reduce_scatter(core, nbytes, alpha, beta)
    if core != p:
        time += 2 * (alpha + nbytes / beta)
    return time


def _active(levels: Sequence[Level]) -> list[Level]:
    return [level for level in levels if level.size > 1]


def _world(levels: Sequence[Level]) -> int:
    return math.prod(level.size for level in levels)


def flat_ring_all_reduce(levels: Sequence[Level], nbytes: float) -> float:
    """One ring over every GPU, ordered so it crosses each link once (as NCCL and Gloo do with contiguous ranks).

    All links carry a 1/n chunk per step, so each step costs the slowest tier's latency
    and the slowest link's transfer time; a port is not shared because only one ring
    edge leaves each node.
    """
    active = _active(levels)
    if not active:
        return 0.0
    alpha = max(level.latency for level in active)
    beta = min(level.bandwidth for level in active)
    return ring_all_reduce(_world(levels), nbytes, alpha, beta)


def flat_rhd_all_reduce(levels: Sequence[Level], nbytes: float) -> float:
    """Recursive halving-doubling over every GPU, partners at distance 1, 2, 4, ... in rank order.

    With contiguous ranks and power-of-two tiers the first steps stay inside a node
    and carry the large halves, the later steps cross the network with small pieces,
    and every GPU of a node is on the wire at once (the port is shared). That makes it
    a per-tier recursive halving, costed tier by tier. Otherwise (a tier that is not a
    power of two) we fall back to the topology-oblivious cost: slowest latency,
    slowest per-GPU bandwidth, plus the fold of the extra ranks.
    """
    active = _active(levels)
    if not active:
        return 0.0
    if all(_is_power_of_two(level.size) for level in active):
        return hierarchical_all_reduce(levels, nbytes, algorithm="rhd")
    alpha = max(level.latency for level in active)
    beta = min(level.per_gpu_bandwidth for level in active)
    return rhd_all_reduce(_world(levels), nbytes, alpha, beta)


def _level_reduce_scatter(level: Level, nbytes: float, algorithm: str) -> float:
    beta = level.per_gpu_bandwidth
    if algorithm == "ring":
        return ring_reduce_scatter(level.size, nbytes, level.latency, beta)
    if algorithm == "rhd":
        if _is_power_of_two(level.size):
            return rhd_reduce_scatter(level.size, nbytes, level.latency, beta)
        return ring_reduce_scatter(level.size, nbytes, level.latency, beta)
    if algorithm == "best":
        return min(_level_reduce_scatter(level, nbytes, "ring"), _level_reduce_scatter(level, nbytes, "rhd"))
    raise ValueError(f"unknown per-level algorithm {algorithm!r}; use 'ring', 'rhd' or 'best'")


def _level_all_reduce(level: Level, nbytes: float, algorithm: str) -> float:
    beta = level.per_gpu_bandwidth
    if algorithm == "ring":
        return ring_all_reduce(level.size, nbytes, level.latency, beta)
    if algorithm == "rhd":
        return rhd_all_reduce(level.size, nbytes, level.latency, beta)
    if algorithm == "best":
        return min(_level_all_reduce(level, nbytes, "ring"), _level_all_reduce(level, nbytes, "rhd"))
    raise ValueError(f"unknown per-level algorithm {algorithm!r}; use 'ring', 'rhd' or 'best'")


def hierarchical_all_reduce(levels: Sequence[Level], nbytes: float, algorithm: str = "ring") -> float:
    """Multi-level all-reduce (PowerAI DDL's X×Y×Z): reduce-scatter tier by tier from the inside out,
    all-reduce the remaining shard across the outermost tier, all-gather back from the outside in.

    Entering tier i each GPU holds S / (p_0 ··· p_{i-1}) bytes, and all GPUs work at
    once, so a tier's link is shared by its `shared_by` GPUs. The reduce-scatter and
    the all-gather of a tier cost the same, hence the factor 2.
    """
    active = _active(levels)
    if not active:
        return 0.0
    time = 0.0
    shard = float(nbytes)
    for level in active[:-1]:
        time += 2 * _level_reduce_scatter(level, shard, algorithm)
        shard /= level.size
    return time + _level_all_reduce(active[-1], shard, algorithm)


ALGORITHMS: dict[str, Callable[[Sequence[Level], float], float]] = {
    "ring": flat_ring_all_reduce,
    "rhd": flat_rhd_all_reduce,
    "hierarchical": hierarchical_all_reduce,
}


def all_reduce_time(algorithm: str, levels: Sequence[Level], nbytes: float) -> float:
    """Seconds to all-reduce `nbytes` over the GPUs described by `levels` with `algorithm`."""
    try:
        cost = ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; available: {', '.join(ALGORITHMS)}") from None
    return cost(levels, nbytes)
