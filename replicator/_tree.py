"""Walks over nested batches and outputs (tuples, lists, dicts, namedtuples) on torch's pytree (internal)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__: list[str] = []

_CONTAINERS = (dict, list, tuple)


def _opaque_container(value: Any) -> bool:
    """A subclass of dict, list or tuple (a `class Batch(dict)`) that pytree would take for one leaf."""
    return (isinstance(value, _CONTAINERS) and type(value) not in pytree.SUPPORTED_NODES
            and not hasattr(type(value), "_fields"))  # namedtuples are nodes, registered or not


def plain(tree: Any) -> Any:
    """`tree` with such containers turned into plain dicts, lists and tuples, so that every walk goes into them."""
    if not any(_opaque_container(leaf) for leaf in pytree.tree_leaves(tree)):
        return tree

    def opened(leaf: Any) -> Any:
        if not _opaque_container(leaf):
            return leaf
        base = next(kind for kind in _CONTAINERS if isinstance(leaf, kind))
        return plain(base(leaf))

    return pytree.tree_map(opened, tree)


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The leaves of `tree`, depth first, and its structure (for `pytree.tree_unflatten`)."""
    leaves, spec = pytree.tree_flatten(tree)
    if any(_opaque_container(leaf) for leaf in leaves):  # rare: flatten once more, opened
        return pytree.tree_flatten(plain(tree))
    return leaves, spec


def _single_value(tree: Any) -> bool:
    """`tree` is None or a plain number or string: a batch of indices, an output of None, walked every step
    without pytree (to_device alone cost ~25 µs a step on them)."""
    return tree is None or type(tree) in (int, float, bool, complex, str, bytes)


def _flat_tensors(tree: Any) -> bool:
    """`tree` is a plain tuple or list of tensors: the usual batch, which the step loop walks every step without
    pytree (its tree_map_only alone cost tens of µs a step)."""
    return type(tree) in (tuple, list) and all(isinstance(leaf, torch.Tensor) for leaf in tree)


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree`, depth first, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if _single_value(tree):
        return []
    if _flat_tensors(tree):
        return list(tree)
    return [leaf for leaf in flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` with `fn` applied to each tensor; containers keep their types, other leaves stay.

    Subclasses of dict, list and tuple that pytree does not know come back as their base type.
    """
    return pytree.tree_map_only(torch.Tensor, fn, plain(tree))


def leaves_with_paths(tree: Any, root: str) -> Iterator[tuple[str, Any]]:
    """Each leaf with where it sits, written as `root['key'][0]`, for error messages."""
    if _single_value(tree):  # pytree's answer (one leaf, at the root) without the walk
        yield root, tree
        return
    for path, leaf in pytree.tree_flatten_with_path(plain(tree))[0]:
        yield root + pytree.keystr(path), leaf


def named_leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Each leaf with its keys joined by "/" (`metrics/accuracy`, `0`): names for logs, as TensorBoard's tags.

    Dicts, lists, tuples and namedtuples are walked directly rather than through pytree: this runs at every
    step, and the outputs it names are small.
    """
    fields = getattr(type(tree), "_fields", None) if isinstance(tree, tuple) else None
    items: Iterator[tuple[Any, Any]]
    if isinstance(tree, dict):
        items = iter(tree.items())
    elif fields is not None:
        items = zip(fields, tree)
    elif isinstance(tree, (list, tuple)):
        items = iter(enumerate(tree))
    else:
        yield prefix, tree
        return
    for key, value in items:
        yield from named_leaves(value, f"{prefix}/{key}" if prefix else str(key))


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor in `tree` on `device` (copied without blocking the host); the rest unchanged."""
    if isinstance(tree, torch.Tensor):
        return tree if tree.device == device else tree.to(device, non_blocking=True)
    if _single_value(tree):
        return tree
    if _flat_tensors(tree) and all(leaf.device == device for leaf in tree):
        return type(tree)(tree)  # a new container, as the general path gives
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
