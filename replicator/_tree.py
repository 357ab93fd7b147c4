"""Walks over nested batches and outputs (tuples, lists, dicts, namedtuples) on torch's pytree (internal)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__: list[str] = []


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree`, depth first, in order."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` with `fn` applied to each tensor; containers keep their types, other leaves stay."""
    return pytree.tree_map_only(torch.Tensor, fn, tree)


def leaves_with_paths(tree: Any, root: str) -> Iterator[tuple[str, Any]]:
    """Each leaf with where it sits, written as `root['key'][0]`, for error messages."""
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        yield root + pytree.keystr(path), leaf


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor in `tree` on `device` (copied without blocking the host); the rest unchanged."""
    return map_tensors(lambda t: t if t.device == device else t.to(device, non_blocking=True), tree)


def leading_size(batch: Any) -> int:
    """Dim 0 of the batch's first non-empty tensor (1 for a scalar), 0 when it holds none.

    The step loop's rule: what replicas compare to catch unequal shards. It reads one tensor
    only, unlike the pipeline's split, which needs every tensor to agree (see
    replicator.pipeline.microbatch.shared_batch_size).
    """
    for tensor in tensors(batch):
        size = int(tensor.shape[0]) if tensor.dim() > 0 else 1
        if size:
            return size
    return 0
