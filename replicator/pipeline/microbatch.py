"""Split a mini-batch into micro-batches along dim 0, and join micro-batch outputs back.

A batch is a tensor or a (nested) tuple, list or dict of them. Every tensor with at least
one dimension is split along dim 0 and all of them must agree on its size; 0-dim tensors
and values that are not tensors are handed unchanged to every micro-batch. A batch of B
samples always gives exactly `chunks` micro-batches, the first B % chunks of them one
sample larger than the rest, so every stage of a pipeline knows how many to expect.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

__all__ = ["batch_size", "microbatch_sizes", "scatter", "gather", "iter_tensors"]


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a (nested) tuple, list or dict, depth first, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)


def batch_size(value: Any) -> int | None:
    """The dim-0 size shared by every batched tensor in `value`; None if it holds none.

    Raises ValueError when two tensors disagree: splitting them would pair the wrong samples.
    """
    sizes = {t.shape[0] for t in iter_tensors(value) if t.dim() > 0}
    if len(sizes) > 1:
        shapes = [tuple(t.shape) for t in iter_tensors(value) if t.dim() > 0]
        raise ValueError(
            f"the tensors of one batch disagree on the batch size (dim 0): shapes {shapes}; every tensor that "
            "is split into micro-batches needs the same dim-0 size (wrap per-batch constants in a non-tensor or a 0-dim tensor)"
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


def _rebuild(like: Any, items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    return type(like)(items)


def _narrow(value: Any, start: int, length: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value.narrow(0, start, length) if value.dim() > 0 else value
    if isinstance(value, (tuple, list)):
        return _rebuild(value, [_narrow(item, start, length) for item in value])
    if isinstance(value, dict):
        return type(value)((key, _narrow(item, start, length)) for key, item in value.items())
    return value


def scatter(value: Any, chunks: int) -> list[Any]:
    """Split `value` into exactly `chunks` micro-batches (views, no copies)."""
    size = batch_size(value)
    if size is None:
        raise ValueError(
            f"cannot split a {type(value).__name__} into micro-batches: it holds no tensor with a batch dimension"
        )
    sizes = microbatch_sizes(size, chunks)
    starts = [sum(sizes[:i]) for i in range(chunks)]
    return [_narrow(value, start, length) for start, length in zip(starts, sizes)]


def gather(values: Sequence[Any]) -> Any:
    """Join micro-batch outputs: tensors are concatenated along dim 0, structures item by item.

    Values that are not tensors must be equal in every micro-batch and are returned once.
    """
    if not values:
        raise ValueError("gather() needs at least one micro-batch output")
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise TypeError("cannot join micro-batch outputs: a tensor in one micro-batch is not a tensor in another")
        if first.dim() == 0:
            raise ValueError(
                "cannot join 0-dim tensors from micro-batches along the batch dimension; return per-sample values "
                "(shape (batch, ...)) from the last stage"
            )
        return torch.cat(list(values), dim=0)
    if isinstance(first, (tuple, list)):
        if any(type(v) is not type(first) or len(v) != len(first) for v in values):
            raise TypeError("cannot join micro-batch outputs whose structure differs between micro-batches")
        return _rebuild(first, [gather([v[k] for v in values]) for k in range(len(first))])
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or list(v.keys()) != list(first.keys()) for v in values):
            raise TypeError("cannot join micro-batch outputs: dicts with different keys in different micro-batches")
        return type(first)((key, gather([v[key] for v in values])) for key in first)
    try:
        same = all(v is first or bool(v == first) for v in values)
    except Exception:  # objects whose == is not a plain truth value
        same = False
    if not same:
        raise ValueError(
            f"cannot join micro-batch outputs: the non-tensor value {first!r} differs between micro-batches"
        )
    return first
