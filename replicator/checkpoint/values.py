"""A checkpoint's values that are not tensors, as `replicator.codec`'s tagged JSON; format 1's own tags still read."""

from __future__ import annotations

import collections
import json
from typing import Any

from replicator.checkpoint.errors import CheckpointError
from replicator.codec import UnencodableError, tagged, untagged

__all__: list[str] = []

TAGGED_SINCE = 2  # the checkpoint format from which values are the codec's; format 1 wrote the tags below


def to_json(value: Any, where: str) -> Any:
    """`value` as tagged JSON, or CheckpointError naming `where` (loading a checkpoint never runs pickled code)."""
    try:
        return tagged(value, where)
    except UnencodableError as error:
        raise CheckpointError(f"cannot save a checkpoint: {error}") from None


def plain_json(value: Any, where: str) -> Any:
    """`value` itself, checked to be JSON as it is (string keys, no tuples): for records read without decoding."""
    try:
        plain = json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        plain = False
    if not plain:
        raise CheckpointError(f"cannot save a checkpoint: {where} is not plain JSON (a tuple, a key not a string)")
    return value


def from_json(value: Any, checkpoint_format: int) -> Any:
    """The value `to_json` stored in a checkpoint of `checkpoint_format`."""
    return untagged(value) if checkpoint_format >= TAGGED_SINCE else _format_1(value)


def _format_1(value: Any) -> Any:
    """Format 1: plain JSON whose tuples, Counters and dicts with other than string keys were tagged with __x__."""
    if isinstance(value, list):
        return [_format_1(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_format_1(v) for v in value["__tuple__"])
        if set(value) == {"__counter__"}:
            return collections.Counter({_hashable(_format_1(k)): _format_1(v) for k, v in value["__counter__"]})
        if set(value) == {"__items__"}:
            return {_hashable(_format_1(k)): _format_1(v) for k, v in value["__items__"]}
        return {k: _format_1(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
