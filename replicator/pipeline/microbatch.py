"""Split a mini-batch into micro-batches along dim 0, and join micro-batch outputs back.

A batch is a tensor or a (nested) tuple, list, namedtuple or dict of them, walked with
torch's pytree. Every tensor with at least one dimension is split along dim 0 and all of
them must agree on its size; 0-dim tensors and values that are not tensors are handed
unchanged to every micro-batch. A batch of B samples always gives exactly `chunks`
micro-batches, the first B % chunks of them one sample larger than the rest, so every
stage of a pipeline knows how many to expect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from replicator._tree import flatten, leaves_with_paths, map_tensors

__all__ = ["shared_batch_size", "microbatch_sizes", "scatter", "unshared", "gather"]


def shared_batch_size(value: Any) -> int | None:
    """The dim-0 size shared by every batched tensor in `value`; None if it holds none.

    Raises ValueError when two tensors disagree: splitting them would pair the wrong samples.
    (The step loop's rule, replicator._tree.leading_size, reads only the first tensor.)
    """
    batched = [(path, leaf) for path, leaf in leaves_with_paths(value, "batch")
               if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    sizes = {leaf.shape[0] for _, leaf in batched}
    if len(sizes) > 1:
        shapes = ", ".join(f"{path}: {tuple(leaf.shape)}" for path, leaf in batched)
        raise ValueError(
            f"the tensors of one batch disagree on the batch size (dim 0): shapes {shapes}; every tensor that "
            "is split into micro-batches needs the same dim-0 size (wrap per-batch constants in a non-tensor or a "
            "0-dim tensor)"
        )
    return sizes.pop() if sizes else None


def microbatch_sizes(size: int, chunks: int) -> list[int]:
    """How many samples each of `chunks` micro-batches of a `size`-sample batch gets."""
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if size < chunks:
        raise ValueError(
            f"a batch of {size} sample(s) cannot be split into {chunks} micro-batches: use a batch of at least "
            f"{chunks} samples or fewer chunks"
        )
    base, extra = divmod(size, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


def scatter(value: Any, chunks: int) -> list[Any]:
    """Split `value` into exactly `chunks` micro-batches (views, no copies)."""
    size = shared_batch_size(value)
    if size is None:
        raise ValueError(
            f"cannot split a {type(value).__name__} into micro-batches: it holds no tensor with a batch dimension"
        )
    sizes = microbatch_sizes(size, chunks)
    starts = [sum(sizes[:i]) for i in range(chunks)]
    leaves, spec = flatten(value)
    return [
        pytree.tree_unflatten(
            [leaf.narrow(0, start, length) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf
             for leaf in leaves],
            spec,
        )
        for start, length in zip(starts, sizes)
    ]


def unshared(value: Any) -> Any:
    """`value` with every tensor that is a view of another copied into memory of its own.

    Micro-batches from `scatter` are views of one batch and share autograd's version counter:
    a layer that changed its micro-batch in place would make autograd reject the others'
    saved tensors. A copy costs one pass over the input batch, per step.
    """
    return map_tensors(lambda t: t.clone() if t._base is not None else t, value)


def gather(values: Sequence[Any]) -> Any:
    """Join micro-batch outputs: tensors are concatenated along dim 0, structures item by item.

    Values that are not tensors must be equal in every micro-batch and are returned once.
    """
    if not values:
        raise ValueError("gather() needs at least one micro-batch output")
    first_leaves, spec = flatten(values[0])
    columns: list[list[Any]] = [[leaf] for leaf in first_leaves]
    for index, value in enumerate(values[1:], start=1):
        leaves, other = flatten(value)
        if other != spec:
            raise TypeError(
                "cannot join micro-batch outputs whose structure differs between micro-batches: micro-batch 0 holds "
                f"{_paths(values[0])}, micro-batch {index} holds {_paths(value)}"
            )
        for column, leaf in zip(columns, leaves):
            column.append(leaf)
    joined = [_join(column, path) for column, path in zip(columns, _paths(values[0]))]
    return pytree.tree_unflatten(joined, spec)


def _paths(value: Any) -> list[str]:
    return [path for path, _ in leaves_with_paths(value, "output")]


def _join(column: list[Any], path: str) -> Any:
    """One leaf of the joined output from that leaf in every micro-batch."""
    first = column[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(v, torch.Tensor) for v in column):
            raise TypeError(
                f"cannot join micro-batch outputs: {path} is a tensor in one micro-batch and not a tensor in another"
            )
        if first.dim() == 0:
            raise ValueError(
                f"cannot join 0-dim tensors ({path}) from micro-batches along the batch dimension; return per-sample "
                "values (shape (batch, ...)) from the last stage"
            )
        return torch.cat(column, dim=0)
    try:
        same = all(v is first or bool(v == first) for v in column)
    except Exception:  # objects whose == is not a plain truth value
        same = False
    if not same:
        raise ValueError(
            f"cannot join micro-batch outputs: the non-tensor value {first!r} at {path} differs between micro-batches"
        )
    return first
