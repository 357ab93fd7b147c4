"""Python values between replicas (configs, metrics, strings) as tagged JSON: nothing a peer sends is unpickled.

torch.distributed's *_object collectives pickle, so a peer (or whoever can reach the job's
ports) could run code in every process that receives. Here a value travels as JSON in which
every container carries its type ({"list": [...]}, {"tuple": [...]}, {"dict": [[key, value],
...]}, {"bytes": base64}), so that tuples, non-string keys and bytes come back as they left,
and decoding is a walk over data that builds nothing but those types and plain scalars.
What has no such encoding (a tensor, an arbitrary object) is refused with its path in the
value, on every replica at once.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm import collectives
from replicator.errors import ReplicatorUsageError

__all__ = ["encode", "decode", "all_gather_values", "broadcast_value", "UnencodableError"]

Group = dist.ProcessGroup | None

_CONTAINERS = ("list", "tuple", "dict", "bytes")


class UnencodableError(ReplicatorUsageError, TypeError):
    """A value holds something that cannot travel between replicas safely."""


def encode(value: Any) -> bytes:
    """`value` as tagged JSON (ASCII); UnencodableError naming the first part that cannot be encoded."""
    try:
        return json.dumps(_tagged(value, "value"), separators=(",", ":"), allow_nan=True).encode("ascii")
    except RecursionError:
        raise UnencodableError("the value is nested too deeply to encode (or contains itself)") from None


def _tagged(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        return {"list": [_tagged(item, f"{path}[{at}]") for at, item in enumerate(value)]}
    if isinstance(value, tuple):
        return {"tuple": [_tagged(item, f"{path}[{at}]") for at, item in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[_tagged(key, f"{path} key {key!r}"), _tagged(item, f"{path}[{key!r}]")]
                         for key, item in value.items()]}
    hint = ("use .item() or .tolist(), or a tensor collective (ctx.all_gather, ctx.broadcast)"
            if isinstance(value, torch.Tensor) or hasattr(value, "tolist")
            else "convert it to None, bool, int, float, str, bytes, or lists, tuples and dicts of those")
    raise UnencodableError(f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which cannot travel "
                           f"between replicas (replicator sends values as JSON and never unpickles): {hint}")


def decode(payload: bytes) -> Any:
    """The value `encode` made `payload` from; ValueError for anything else. Builds only plain types."""
    return _untagged(json.loads(payload.decode("ascii")))


def _untagged(node: Any) -> Any:
    if isinstance(node, dict):
        if len(node) != 1 or next(iter(node)) not in _CONTAINERS:
            raise ValueError(f"not a value encoded by replicator: an object with keys {sorted(node)}")
        tag, body = next(iter(node.items()))
        if tag == "bytes":
            return base64.b64decode(body, validate=True)
        if not isinstance(body, list):
            raise ValueError(f"not a value encoded by replicator: a {tag} whose body is not a list")
        if tag == "dict":
            return {_untagged(key): _untagged(item) for key, item in body}
        items = [_untagged(item) for item in body]
        return items if tag == "list" else tuple(items)
    if isinstance(node, list):
        raise ValueError("not a value encoded by replicator: an untagged list")
    return node


def _encoded(value: Any) -> tuple[bytes, bool]:
    """(the encoding, True), or (why it cannot be encoded, False): a failure is shared, not raised alone."""
    try:
        return encode(value), True
    except UnencodableError as error:
        return str(error).encode("utf-8"), False


def all_gather_values(value: Any, group: Group = None) -> list[Any]:
    """Every replica's `value`, in replica order, on every replica."""
    payload, encoded = _encoded(value)
    status = collectives.all_gather(torch.tensor([[len(payload), int(encoded)]], dtype=torch.int64), group).tolist()
    lengths = [length for length, _ in status]
    received = collectives.all_gather(torch.frombuffer(bytearray(payload), dtype=torch.uint8), group, lengths)
    chunks, start = [], 0
    for length in lengths:
        chunks.append(received[start : start + length].numpy().tobytes())
        start += length
    failed = [replica for replica, (_, ok) in enumerate(status) if not ok]
    if failed:
        reasons = "; ".join(f"replica {replica}: {chunks[replica].decode('utf-8', errors='replace')}"
                            for replica in failed)
        raise UnencodableError(f"all_gather_object: the value of replica(s) {failed} cannot be encoded ({reasons})")
    return [decode(chunk) for chunk in chunks]


def broadcast_value(value: Any, source: int = 0, group: Group = None) -> Any:
    """Replica `source`'s `value` on every replica (the others' `value` is not looked at)."""
    me = 0 if group is None else dist.get_rank(group)
    payload, encoded = _encoded(value) if me == source else (b"", True)
    header = collectives.broadcast(torch.tensor([len(payload), int(encoded)], dtype=torch.int64), source, group)
    length, encoded = int(header[0]), bool(header[1])
    mine = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if me == source
            else torch.zeros(length, dtype=torch.uint8))
    chunk = collectives.broadcast(mine, source, group).numpy().tobytes()
    if not encoded:
        raise UnencodableError(f"broadcast_object: the value of replica {source} cannot be encoded "
                               f"({chunk.decode('utf-8', errors='replace')})")
    return decode(chunk)
