"""JSON for everything in a checkpoint that is not a tensor, so that loading one never unpickles (internal)."""

from __future__ import annotations

import collections
from typing import Any

from replicator.checkpoint.errors import CheckpointError

__all__: list[str] = []


def to_json(value: Any, where: str) -> Any:
    """Plain JSON, with tuples, Counters and non-string keys tagged so they come back as they were."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, collections.Counter):
        return {"__counter__": [[to_json(k, where), to_json(v, where)] for k, v in value.items()]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: to_json(v, f"{where}.{k}") for k, v in value.items()}
        return {"__items__": [[to_json(k, where), to_json(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise CheckpointError(
        f"{where} is a {type(value).__name__}; a checkpoint stores tensors and JSON values (numbers, strings, "
        "lists, dicts) only, so that loading it never runs pickled code"
    )


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v) for v in value["__tuple__"])
        if set(value) == {"__counter__"}:
            return collections.Counter({_hashable(from_json(k)): from_json(v) for k, v in value["__counter__"]})
        if set(value) == {"__items__"}:
            return {_hashable(from_json(k)): from_json(v) for k, v in value["__items__"]}
        return {k: from_json(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key

