"""Internal: a same-node leader–server pair's payloads in one shared segment: where each gradient and reply lives.

A group's leader and a server on one node share a segment (`comm.shared_segment`) instead of
sending the payloads over their Unix socket: for each optimizer, a gradient slot and a reply
slot, each the shard's flat buffers (one per dtype). Their frames carry only the header (and
the learning rates and presence, a few bytes). No lock is needed, because the protocol already
orders every access: the leader writes the gradient slot only before its push frame, and the
server reads it only between that frame and its reply; the server writes the reply slot only
while the leader waits for that reply, and the leader (whose parameters are views of the reply
slot) reads it only after the reply's header has arrived. Each frame is a socket message, so
the kernel orders the writes before it and the reads after it.
"""

from __future__ import annotations

import sys

import torch

from replicator import _env
from replicator.asynchronous.parameter_server.shards import Shard, ShardMap
from replicator.comm.shared_segment import SegmentError, SharedSegment, shared_memory_writable

__all__ = ["Slots", "SharedPayloads", "shared_payloads_wanted", "segment_size", "open_offer"]

_ALIGN = 64


def shared_payloads_wanted() -> str | None:
    """None when this process may put payloads in shared memory; else why not."""
    if not _env.ps_shared_memory():
        return f"{_env.PS_SHARED_MEMORY}=0"
    return shared_memory_writable()


class Slots:
    """One optimizer's shard in a segment: the gradient slot's flat buffers and the reply slot's."""

    def __init__(self, gradient: list[torch.Tensor], reply: list[torch.Tensor]) -> None:
        self.gradient, self.reply = gradient, reply


def _layout(shards: ShardMap, server: int) -> tuple[int, list[list[tuple[int, torch.dtype, int]]]]:
    """The segment's size and, per optimizer, (offset, dtype, elements) of each flat buffer: gradient, then reply."""
    at, places = 0, []
    for k in range(len(shards.optimizers)):
        shard = shards.shard(k, server)
        sizes = [(dtype, sum(p.numel() for p in shard.params if p.dtype == dtype)) for dtype in shard.dtypes]
        row = []
        for _ in ("gradient", "reply"):
            for dtype, numel in sizes:
                row.append((at, dtype, numel))
                at += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
        places.append(row)
    return at, places


def segment_size(shards: ShardMap, server: int) -> int:
    return _layout(shards, server)[0]


def _slots(segment: SharedSegment, shards: ShardMap, server: int) -> list[Slots]:
    _, places = _layout(shards, server)
    found = []
    for k, row in enumerate(places):
        flats = [segment.bytes[at : at + numel * dtype.itemsize].view(dtype) for at, dtype, numel in row]
        half = len(shards.shard(k, server).dtypes)
        found.append(Slots(flats[:half], flats[half:]))
    return found


class SharedPayloads:
    """A segment mapped by both ends and its slots, per optimizer (kept alive as long as its views are used)."""

    def __init__(self, segment: SharedSegment, shards: ShardMap, server: int) -> None:
        self.segment = segment
        self.slots = _slots(segment, shards, server)

    @classmethod
    def make(cls, shards: ShardMap, server: int) -> SharedPayloads:
        return cls(SharedSegment.create(segment_size(shards, server)), shards, server)

    def gradient_views(self, k: int, shard: Shard) -> list[torch.Tensor]:
        """The gradient slot of optimizer `k` shaped as the shard's parameters."""
        return shard.unpack(self.slots[k].gradient)


def open_offer(name: bytes, shards: ShardMap, server: int, peer: object) -> SharedPayloads | None:
    """A server's side of an offer: the leader's segment, mapped and unlinked; None (with a log line) if refused."""
    try:
        text = name.decode("ascii")
        segment = SharedSegment.open(text, segment_size(shards, server))
    except (UnicodeDecodeError, SegmentError) as error:
        print(f"replicator: parameter server {server}: refused the shared memory {peer} offered ({error}); its "
              "payloads go on the socket", file=sys.stderr, flush=True)
        return None
    segment.unlink()  # both ends have it mapped: nothing is left behind if either dies
    return SharedPayloads(segment, shards, server)
