"""GlooPeer: the peer link's frames over torch.distributed point-to-point, where the job cannot use sockets.

The job decides together (`use_sockets`): sockets, unless some process sets
REPLICATOR_PEER_LINK=0 or cannot open a listening socket; then every pair that would have
had a socket link talks through a GlooPeer instead. The frames are the same (the 32-byte
header, the descriptors, the raw bytes) and so are the bounds and the checks; only the
carrier changes. What is lost is the any-source receive: a Gloo receive names its source,
so a process serving several GlooPeers must know whose frame comes next.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from replicator import _env
from replicator.comm.decision import everyone_agrees
from replicator.comm.frames import (
    HEADER,
    MAGIC,
    VERSION,
    Frame,
    FrameError,
    Limits,
    describe,
    parse_header,
    parse_specs,
)
from replicator.comm.peer_link import IntoFor, Landing, Peer, PeerDied, PeerLinkError, check_into

__all__ = ["GlooPeer", "GlooPair", "use_sockets"]

TAG = 97  # the peer link's frames, apart from every other point-to-point message of the job


def use_sockets(group: dist.ProcessGroup | None = None) -> bool:
    """True on every member of `group` when all can use socket links (collective), else False on all."""
    able = _env.peer_link()
    if able:
        try:
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
            socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        except OSError:
            able = False
    return everyone_agrees(able, group)


class GlooPeer:
    """One end of a pair of ranks that exchange frames over Gloo; both ends must know each other's rank."""

    transport = "gloo"

    def __init__(self, peer: Peer, group: dist.ProcessGroup | None = None, limits: Limits | None = None,
                 tag: int = TAG) -> None:
        """`tag`: keeps this pair's frames apart from other pairs' between the same two ranks in `group`."""
        self.peer, self.group, self.limits, self.tag = peer, group, limits or Limits(), tag
        self._header = torch.empty(HEADER.size, dtype=torch.uint8)
        self._landing = Landing()

    def send(self, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0, flags: int = 0) -> None:
        extension = describe(tensors, self.limits)
        payload = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        if payload > self.limits.max_payload:
            raise ValueError(f"a frame may carry at most {self.limits.max_payload} bytes of tensors, these are "
                             f"{payload}")
        header = HEADER.pack(MAGIC, VERSION, kind, flags, request, len(extension), payload)
        # Header and extension apart: a Gloo receive must be told its size, and the header tells the extension's.
        parts = [torch.frombuffer(bytearray(header), dtype=torch.uint8),
                 torch.frombuffer(bytearray(extension), dtype=torch.uint8)]
        parts += [_bytes_of(tensor) for tensor in tensors if tensor.numel()]
        try:
            for part in parts:  # Gloo carries bytes: every dtype goes bit for bit
                dist.send(part, dst=self.peer.rank, group=self.group, tag=self.tag)
        except RuntimeError as error:
            raise PeerDied(f"{self.peer} left the Gloo link (it exited or crashed): {error}", self.peer) from None

    def receive(self, into: Sequence[torch.Tensor] | IntoFor | None = None) -> Frame:
        """The next frame, as `PeerConnection.receive` gives it (`into`: tensors, or a function of kind and specs)."""
        try:
            self._recv(self._header)
            header = parse_header(self._header.numpy().tobytes(), self.limits)
            raw = torch.empty(header.extension, dtype=torch.uint8)
            self._recv(raw)
            specs = parse_specs(raw.numpy().tobytes(), header.payload, self.limits)
        except FrameError as error:
            raise PeerLinkError(f"{self.peer} broke the link's protocol: {error}", self.peer) from None
        if callable(into):
            into = into(header.kind, specs)
        mismatch = check_into(specs, into, self.peer) if into is not None else None
        tensors = list(into) if into is not None and mismatch is None else self._landing.views(specs)[0]
        for tensor in tensors:
            if tensor.numel():
                self._recv(_bytes_of(tensor))
        if mismatch is not None:
            raise ValueError(mismatch)
        return Frame(header.kind, header.flags, header.request, tensors)

    def _recv(self, tensor: torch.Tensor) -> None:
        if not tensor.numel():
            return
        try:
            dist.recv(tensor, src=self.peer.rank, group=self.group, tag=self.tag)
        except RuntimeError as error:
            raise PeerDied(f"{self.peer} left the Gloo link (it exited or crashed): {error}", self.peer) from None

    def close(self) -> None:
        """Nothing to close: the job's process group outlives the pair."""



class GlooPair:
    """One end of a link whose frames go out on one process group and come in on another: a group per way of
    waiting, since a Gloo group's timeout bounds a send as well as a receive, and a receive that timed out would
    break its pair for good."""

    transport = "gloo"

    def __init__(self, sending: GlooPeer, receiving: GlooPeer) -> None:
        self.sending, self.receiving, self.peer = sending, receiving, sending.peer

    def send(self, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0, flags: int = 0) -> None:
        self.sending.send(kind, tensors, request=request, flags=flags)

    def receive(self, into: Sequence[torch.Tensor] | IntoFor | None = None) -> Frame:
        return self.receiving.receive(into)

    def close(self) -> None:
        """Nothing to close: the process groups outlive the pair."""

def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"the peer link moves contiguous CPU tensors, got one on {tensor.device} "
                         f"(contiguous: {tensor.is_contiguous()}); call .contiguous().cpu() first")
    return tensor.reshape(-1).view(torch.uint8)
