"""Hierarchical (PowerAI DDL) all-reduce: reduce-scatter up the levels, all-reduce at the top, all-gather down."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from replicator.sync.reducers._ring import all_gather_, reduce_scatter_
from replicator.topology import ProcessGroups, group_of_mine

__all__ = ["HierarchicalSum", "DEFAULT_CHUNK_BYTES", "replicas_per_node", "plan_levels", "level_groups"]


# Small enough that the first chunk's trip across nodes starts early, large enough that
# per-message latency stays a small share (1, 2 and 8 MiB measured alike on the 2 x 2 cluster).
DEFAULT_CHUNK_BYTES = 2 << 20


def replicas_per_node(members: Sequence[int], local_world_size: int) -> int:
    """How many of one replica group's `members` (world ranks, in replica order) share a node.

    Hierarchy needs every node to hold the same number of them, in consecutive places of the
    group, so that a level boundary can fall on the node boundary. Raises ValueError if not.
    """
    nodes = [rank // local_world_size for rank in members]
    per_node = 1
    while per_node < len(nodes) and nodes[per_node] == nodes[0]:
        per_node += 1
    blocks = [nodes[i : i + per_node] for i in range(0, len(nodes), per_node)]
    even = (all(len(block) == per_node and len(set(block)) == 1 for block in blocks)
            and len({b[0] for b in blocks}) == len(blocks))
    if not even:
        raise ValueError(
            f"a hierarchical reducer needs every node to hold the same number of replicas of a stage; the replicas "
            f"at ranks {list(members)} sit on nodes {nodes} (local world size {local_world_size}); use reducer='flat' "
            "or launch a number of processes per node that the stage count divides (or that divides it)"
        )
    return per_node


def plan_levels(partition: Sequence[Sequence[int]], local_world_size: int, levels: Sequence[int] | None,
                spec: str) -> tuple[int, ...]:
    """The level sizes, innermost first, for every stage's replica group in `partition`.

    Without `levels`: (replicas per node, nodes). With them: their product must be the
    replica count and some leading levels must multiply to the replicas per node, so no
    level straddles a node boundary. Validated identically on every rank, before any group
    exists, so a bad request raises everywhere instead of hanging.
    """
    replicas = len(partition[0])
    per_node = {replicas_per_node(members, local_world_size) for members in partition}
    if len(per_node) != 1:
        raise ValueError(
            f"reducer {spec!r}: stages hold different numbers of replicas per node ({sorted(per_node)}); use 'flat'")
    (inner,) = per_node
    if levels is None:
        return (inner, replicas // inner)
    levels = tuple(levels)
    if any(size < 1 for size in levels):
        raise ValueError(f"reducer {spec!r}: level sizes must be positive integers, got {levels}")
    shape = "x".join(map(str, levels))
    if math.prod(levels) != replicas:
        raise ValueError(
            f"reducer {spec!r}: levels {shape} multiply to {math.prod(levels)} but this job has {replicas} replicas "
            f"per stage ({inner} per node); give levels, innermost first, whose product is {replicas}, "
            f"e.g. 'hierarchical:{inner}x{replicas // inner}'"
        )
    prefixes = {math.prod(levels[:k]) for k in range(len(levels) + 1)}
    if inner not in prefixes:
        raise ValueError(
            f"reducer {spec!r}: levels {shape} do not split at the node boundary: each node holds {inner} replicas "
            f"(local world size {local_world_size}), so the innermost levels must multiply to {inner}, "
            f"e.g. 'hierarchical:{inner}x{replicas // inner}'"
        )
    return levels


def level_groups(members: Sequence[int], levels: Sequence[int], level: int) -> list[list[int]]:
    """The groups of `level`: members whose places differ only in that level's digit.

    A member's place in its replica group is read as a mixed-radix number, innermost level
    fastest, so consecutive places (one node) share every digit but the innermost.
    """
    stride = math.prod(levels[:level])
    size = levels[level]
    bases = [p for p in range(len(members)) if (p // stride) % size == 0]
    return [[members[base + j * stride] for j in range(size)] for base in bases]


class HierarchicalSum:
    """A blocking, lossless sum over the replica group, level by level.

    Level 0 (inside a node) reduce-scatters, so each local rank owns 1/L of the buffer;
    each further level reduce-scatters that shard again; the top level all-reduces the
    remaining shard (with two levels: each local rank sends only its 1/L across nodes,
    all local ranks in parallel); then the shards are all-gathered back down, chunk by
    chunk so the levels overlap (`chunk_bytes`). Every rank ends with identical bits (each
    element is summed once, by its owner), equal to a flat all-reduce up to fp32 round-off
    (the order of the additions differs).
    """

    def __init__(self, groups: ProcessGroups, levels: Sequence[int], timeout_s: float,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.levels = tuple(levels)
        self.chunk_bytes = chunk_bytes
        self.name = "hierarchical:" + "x".join(map(str, self.levels))
        self.size = math.prod(self.levels)
        me = groups.mesh.rank
        self._mine: list[tuple[dist.ProcessGroup, list[int], int]] = []
        for level, size in enumerate(self.levels):
            if size == 1:
                continue
            # Every rank creates every group, in the same order: level, then stage, then group.
            level_partition = [ranks for members in groups.mesh.replica_partition
                               for ranks in level_groups(members, self.levels, level)]
            group = group_of_mine(level_partition, timeout_s)
            ranks = next(ranks for ranks in level_partition if me in ranks)
            assert group is not None
            self._mine.append((group, ranks, ranks.index(me)))

    def sum_(self, tensor: torch.Tensor) -> None:
        if not self._mine:
            return
        *scatter, (top, _, _) = self._mine
        shards = math.prod(len(ranks) for _, ranks, _ in scatter)
        flat = tensor.view(-1)
        length = flat.numel()
        padded = -(-length // shards) * shards
        # Zero padding makes every level's split even, whatever the bucket's length.
        work = flat if padded == length else torch.cat([flat, flat.new_zeros(padded - length)])
        # Pipelined over chunks: while one chunk's shard crosses the top level (asynchronously,
        # on its own group), the next chunk is reduce-scattered and the previous one gathered,
        # so the work inside the node hides under the slow link instead of adding to it.
        step = max(shards, self.chunk_bytes // work.element_size() // shards * shards)
        crossing: tuple[dist.Work, list[torch.Tensor]] | None = None
        for start in range(0, padded, step):
            views = [work[start : start + step]]
            for group, ranks, index in scatter:
                views.append(reduce_scatter_(views[-1], ranks, index, group))
            handle = dist.all_reduce(views[-1], op=dist.ReduceOp.SUM, group=top, async_op=True)
            if crossing is not None:
                _gather(*crossing, scatter)
            crossing = (handle, views)
        if crossing is not None:
            _gather(*crossing, scatter)
        if work is not flat:
            flat.copy_(work[:length])


def _gather(handle: dist.Work, views: list[torch.Tensor],
            scatter: list[tuple[dist.ProcessGroup, list[int], int]]) -> None:
    """Wait for a chunk's top-level sum, then all-gather it back down the levels."""
    handle.wait()
    for (group, ranks, index), whole in zip(reversed(scatter), reversed(views[:-1])):
        all_gather_(whole, ranks, index, group)
