"""Reduce-scatter and all-gather over one group: native where fast, a point-to-point ring on Gloo (internal)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_", "all_gather_"]

# torch 2.13 renamed these (the old names warn); the project supports torch >= 2.4.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _uses_ring(group: dist.ProcessGroup) -> bool:
    # Gloo has reduce_scatter, but it measured ~2x slower than Gloo's own all-reduce of the
    # whole tensor (torch 2.13, loopback), which defeats its purpose; a ring of send/recv
    # moves the bandwidth-optimal (size-1)/size of the tensor and ran faster than that all-reduce.
    return dist.get_backend(group) == "gloo"


def _chunks(tensor: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    if tensor.dim() != 1 or tensor.numel() % size:
        raise ValueError(
            f"ring collectives need a flat tensor whose length divides by {size}, got {tuple(tensor.shape)}")
    return tensor.chunk(size)


def _pass_right(outgoing: torch.Tensor, right: int, incoming: torch.Tensor, left: int,
                group: dist.ProcessGroup) -> None:
    """One ring step: send `outgoing` to the right neighbour while `incoming` arrives from the left."""
    requests = [dist.isend(outgoing, dst=right, group=group), dist.irecv(incoming, src=left, group=group)]
    for request in requests:
        assert request is not None  # None only on a rank outside the group, which never gets here
        request.wait()


def reduce_scatter_(tensor: torch.Tensor, ranks: list[int], index: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum `tensor` over the group and return the view of chunk `index` (this member's), which
    then holds that chunk's sum. The other chunks are left with partial sums.

    `ranks` are the group's world ranks in ring order; `index` is this rank's place in it.
    Blocking.
    """
    size = len(ranks)
    chunks = _chunks(tensor, size)
    if size == 1:
        return chunks[0]
    if not _uses_ring(group):
        out = torch.empty_like(chunks[index])
        _reduce_scatter_single(out, tensor, op=dist.ReduceOp.SUM, group=group)
        return chunks[index].copy_(out)
    right, left = ranks[(index + 1) % size], ranks[(index - 1) % size]
    incoming = torch.empty_like(chunks[0])
    # Step t passes on the partial sum of chunk index-t-1 and folds the left neighbour's
    # partial sum into chunk index-t-2; after size-1 steps chunk `index` has every term.
    for step in range(size - 1):
        _pass_right(chunks[(index - step - 1) % size], right, incoming, left, group)
        chunks[(index - step - 2) % size].add_(incoming)
    return chunks[index]


def all_gather_(tensor: torch.Tensor, ranks: list[int], index: int, group: dist.ProcessGroup) -> None:
    """Each member holds its chunk `index` of `tensor`; afterwards every member holds all chunks. Blocking."""
    size = len(ranks)
    chunks = _chunks(tensor, size)
    if size == 1:
        return
    if not _uses_ring(group):
        _all_gather_single(tensor, chunks[index].clone(), group=group)
        return
    right, left = ranks[(index + 1) % size], ranks[(index - 1) % size]
    for step in range(size - 1):
        _pass_right(chunks[(index - step) % size], right, chunks[(index - step - 1) % size], left, group)
