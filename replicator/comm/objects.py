"""Python values between replicas (configs, metrics, strings), sent as `replicator.codec`'s tagged JSON.

torch.distributed's *_object collectives pickle, so a peer (or whoever can reach the job's
ports) could run code in every process that receives. Here a value travels as tagged JSON, and
what has no such encoding (a tensor, an arbitrary object) is refused with its path in the
value, on every replica at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from replicator.codec import UnencodableError, decode, encode
from replicator.comm import collectives

__all__ = ["encode", "decode", "all_gather_values", "broadcast_value", "UnencodableError"]

Group = dist.ProcessGroup | None


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
