"""Python values as tagged JSON: the one codec for what replicas send each other and what checkpoints keep.

Nothing decoded here is ever unpickled. Every container carries its type ({"list": [...]},
{"tuple": [...]}, {"dict": [[key, value], ...]}, {"counter": [[key, count], ...]},
{"bytes": base64}), so tuples, non-string keys, Counters and bytes come back as they left, and
decoding is a walk over data that builds nothing but those types and plain scalars. What has no
such encoding (a tensor, a function, any other object) is refused with its path in the value.
"""

from __future__ import annotations

import base64
import collections
import json
from typing import Any

from replicator.errors import ReplicatorUsageError

__all__ = ["UnencodableError", "tagged", "untagged", "encode", "decode"]

_CONTAINERS = ("list", "tuple", "dict", "counter", "bytes")


class UnencodableError(ReplicatorUsageError, TypeError):
    """A value holds something that cannot be sent or stored safely."""


def tagged(value: Any, path: str = "value") -> Any:
    """`value` as a JSON-ready tree of tagged containers; UnencodableError naming the first part that cannot be."""
    try:
        return _tagged(value, path)
    except RecursionError:
        raise UnencodableError(f"{path} is nested too deeply to encode (or contains itself)") from None


def _tagged(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        return {"list": [_tagged(item, f"{path}[{at}]") for at, item in enumerate(value)]}
    if isinstance(value, tuple):
        return {"tuple": [_tagged(item, f"{path}[{at}]") for at, item in enumerate(value)]}
    if isinstance(value, dict):  # a Counter is a dict too: its own tag brings its type back
        pairs = [[_tagged(key, f"{path} key {key!r}"), _tagged(item, f"{path}[{key!r}]")]
                 for key, item in value.items()]
        return {"counter" if isinstance(value, collections.Counter) else "dict": pairs}
    hint = ("use .item() or .tolist(), or a tensor collective (ctx.all_gather, ctx.broadcast)"
            if hasattr(value, "tolist")
            else "convert it to None, bool, int, float, str, bytes, or lists, tuples and dicts of those")
    raise UnencodableError(f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which replicator cannot "
                           f"send or store: it keeps Python values as JSON values and never unpickles; {hint}")


def untagged(node: Any) -> Any:
    """The value `tagged` made `node` from; ValueError for anything else. Builds only plain types."""
    if isinstance(node, dict):
        if len(node) != 1 or next(iter(node)) not in _CONTAINERS:
            raise ValueError(f"not a value encoded by replicator: an object with keys {sorted(node)}")
        tag, body = next(iter(node.items()))
        if tag == "bytes":
            return base64.b64decode(body, validate=True)
        if not isinstance(body, list):
            raise ValueError(f"not a value encoded by replicator: a {tag} whose body is not a list")
        if tag in ("dict", "counter"):
            pairs = {_key(untagged(key)): untagged(item) for key, item in _pairs(body)}
            return collections.Counter(pairs) if tag == "counter" else pairs
        items = [untagged(item) for item in body]
        return items if tag == "list" else tuple(items)
    if isinstance(node, list):
        raise ValueError("not a value encoded by replicator: an untagged list")
    return node


def _pairs(body: list[Any]) -> list[list[Any]]:
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in body):
        raise ValueError("not a value encoded by replicator: a dict whose entries are not [key, value] pairs")
    return body


def _key(key: Any) -> Any:
    if isinstance(key, (list, dict, collections.Counter)):
        raise ValueError(f"not a value encoded by replicator: an unhashable dict key {key!r}")
    return key


def encode(value: Any, path: str = "value") -> bytes:
    """`value` as tagged JSON bytes (ASCII)."""
    return json.dumps(tagged(value, path), separators=(",", ":"), allow_nan=True).encode("ascii")


def decode(payload: bytes) -> Any:
    """The value `encode` made `payload` from; ValueError for anything else."""
    return untagged(json.loads(payload.decode("ascii")))
