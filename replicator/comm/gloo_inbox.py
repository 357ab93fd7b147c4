"""GlooInbox: a PeerServer's any-source receive over Gloo point-to-point, one receiving thread per peer.

Where the job cannot use sockets (`comm.gloo_peer.use_sockets` said no), a server still
serves every peer from one loop: each known peer has a thread blocked in a Gloo receive of
its next frame, and `receive()` takes whichever frame is whole first from one queue. A
thread receives nothing more from its peer until the caller has moved on from that peer's
last frame (its tensors are the caller's placement or a buffer the thread reuses). A peer
whose link fails (it exited: Gloo reports the closed connection) becomes a `PeerDied`, once.
Peers must be known in advance (a Gloo receive names its source); none can join later.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from replicator.comm.frames import HEADER, Frame, FrameError, Limits, parse_header, parse_specs
from replicator.comm.gloo_peer import TAG, GlooPeer
from replicator.comm.peer_link import Landing, Peer, PeerDied, PeerLinkError, check_into
from replicator.comm.peer_server import Placement

__all__ = ["GlooInbox"]

log = logging.getLogger("replicator.comm.peer_link")


class GlooInbox:
    """Frames from `peers` over Gloo, taken one at a time from whichever sends first; replies through `send`."""

    transport = "gloo"

    def __init__(self, peers: Sequence[Peer], group: dist.ProcessGroup | None, *, place: Placement | None = None,
                 limits: Limits | None = None, reply_group: dist.ProcessGroup | None = None,
                 tag: int = TAG) -> None:
        """`group`: where frames arrive (its timeout bounds a peer's silence: best none, the caller judges
        silence); `reply_group`: where `send` goes (default: `group`); `tag`: this inbox's frames, apart from
        other pairs' between the same ranks."""
        self.group, self.limits, self.place, self.tag = group, limits or Limits(), place, tag
        self.links = {peer: GlooPeer(peer, group if reply_group is None else reply_group, self.limits, tag)
                      for peer in peers}
        self._events: queue.Queue[tuple[Peer, Frame | PeerLinkError] | None] = queue.Queue()
        self._go_on = {peer: threading.Semaphore(0) for peer in peers}  # the caller is done with its last frame
        self._held: Peer | None = None
        self._closed = False
        for peer in peers:
            threading.Thread(target=self._listen, args=(peer,), name=f"replicator-gloo-inbox-{peer.rank}",
                             daemon=True).start()

    @property
    def peers(self) -> list[Peer]:
        return list(self.links)

    def receive(self, timeout_s: float | None = None) -> tuple[Peer, Frame] | None:
        """The next whole frame from any peer, or None after `timeout_s`; raises PeerDied for a peer that left."""
        if self._held is not None:
            self._go_on[self._held].release()
            self._held = None
        try:
            item = self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if item is None:  # wake()
            return None
        peer, event = item
        if isinstance(event, PeerLinkError):
            raise event
        self._held = peer
        return peer, event

    def send(self, peer: Peer, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0,
             flags: int = 0) -> None:
        self.links[peer].send(kind, tensors, request=request, flags=flags)

    def wake(self) -> None:
        """Make the receive() waiting now (or the next one) return None at once, as PeerServer.wake does."""
        self._events.put(None)

    def disconnect(self, peer: Peer) -> None:
        """Nothing to do: a peer that said goodbye sends nothing more under this inbox's tag (its exit, later, is a
        PeerDied for a peer its user no longer counts)."""

    def close(self) -> None:
        """Stop taking frames (a thread blocked in a receive stays there until its peer leaves or the job ends)."""
        self._closed = True

    def _listen(self, peer: Peer) -> None:
        landing = Landing()
        header = torch.empty(HEADER.size, dtype=torch.uint8)
        while not self._closed:
            try:
                frame = self._frame(peer, header, landing)
            except PeerLinkError as error:
                self._events.put((peer, error))
                return
            if frame is None:
                continue
            self._events.put((peer, frame))
            self._go_on[peer].acquire()

    def _frame(self, peer: Peer, header_bytes: torch.Tensor, landing: Landing) -> Frame | None:
        """The next frame of `peer`, in its placement or `landing`; None when it did not fit the placement (dropped)."""
        self._recv(peer, header_bytes)
        try:
            header = parse_header(header_bytes.numpy().tobytes(), self.limits)
            raw = torch.empty(header.extension, dtype=torch.uint8)
            self._recv(peer, raw)
            specs = parse_specs(raw.numpy().tobytes(), header.payload, self.limits)
        except FrameError as error:
            raise PeerLinkError(f"{peer} broke the link's protocol: {error}", peer) from None
        placed = self.place(peer, header.kind, specs) if self.place is not None else None
        mismatch = check_into(specs, placed, peer) if placed is not None else None
        tensors = list(placed) if placed is not None and mismatch is None else landing.views(specs)[0]
        for tensor in tensors:
            self._recv(peer, tensor.reshape(-1).view(torch.uint8))
        if mismatch is not None:
            log.warning("peer link over Gloo: %s; the frame was read and dropped", mismatch)
            return None  # read whole, so the link stays in step; the sender hears nothing back
        return Frame(header.kind, header.flags, header.request, tensors)

    def _recv(self, peer: Peer, tensor: torch.Tensor) -> None:
        if not tensor.numel():
            return
        try:
            dist.recv(tensor, src=peer.rank, group=self.group, tag=self.tag)
        except RuntimeError as error:
            raise PeerDied(f"{peer} left the Gloo link (it exited or crashed): {error}", peer) from None
