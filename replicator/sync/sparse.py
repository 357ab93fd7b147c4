"""Sparse gradients summed across replicas: indices and values all-gathered, then coalesced (internal)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__: list[str] = []

_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def sparse_parameters(modules: list[torch.nn.Module]) -> set[int]:
    """The ids of the weights whose gradients are sparse: those of Embedding and EmbeddingBag(sparse=True).

    Known from the modules, as DDP knows them, so every replica reaches the same answer
    without asking the others, even one whose batch never reached the embedding.
    """
    return {id(module.weight) for root in modules for module in root.modules()
            if isinstance(module, _SPARSE_MODULES) and module.sparse}


def sum_sparse(gradients: list[torch.Tensor | None], shapes: list[torch.Tensor],
               group: dist.ProcessGroup) -> list[torch.Tensor | None]:
    """Each replica's coalesced sparse gradients (None where it has none), summed over `group`.

    Every replica passes the same parameters (`shapes`: tensors shaped like them) in the same
    order; their gradients index rows (sparse_dim 1), as an embedding's do. One all-gather of
    the counts, then two (indices, values) per parameter that some replica has a gradient for,
    padded to the largest count because NCCL gathers equal sizes.
    The result is None where no replica had a gradient; otherwise coalesced, like what one
    process would hold after `coalesce()`.
    """
    if not shapes:
        return []
    device = shapes[0].device
    size = dist.get_world_size(group)
    # nnz + 1 for a gradient, 0 for none: an empty gradient is still a gradient.
    mine = torch.tensor([0 if g is None else g._nnz() + 1 for g in gradients], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine, group=group)
    counts = torch.stack(everyone).tolist()  # replicas x parameters
    summed: list[torch.Tensor | None] = []
    for index, (gradient, shape) in enumerate(zip(gradients, shapes)):
        present = [row[index] for row in counts]
        if not any(present):
            summed.append(None)
            continue
        longest = max(present) - 1
        indices = torch.zeros(1, longest, dtype=torch.int64, device=device)
        values = torch.zeros(longest, *shape.shape[1:], dtype=shape.dtype, device=device)
        if gradient is not None and gradient._nnz():
            indices[:, : gradient._nnz()] = gradient._indices()
            values[: gradient._nnz()] = gradient._values()
        all_indices = [torch.empty_like(indices) for _ in range(size)]
        all_values = [torch.empty_like(values) for _ in range(size)]
        if longest:
            dist.all_gather(all_indices, indices, group=group)
            dist.all_gather(all_values, values, group=group)
        nnz = [max(count - 1, 0) for count in present]
        merged = torch.sparse_coo_tensor(
            torch.cat([i[:, :n] for i, n in zip(all_indices, nnz)], dim=1),
            torch.cat([v[:n] for v, n in zip(all_values, nnz)]),
            shape.shape, device=device,
            check_invariants=True,  # rows come from other processes: an index out of range raises, not corrupts
        )
        summed.append(merged.coalesce())
    return summed
