"""LocalLink: small messages among the processes of one node over Unix sockets, in tens of µs where Gloo takes hundreds.

Agreement checks and the shared-memory sum's barriers are messages of a few dozen bytes.
Through Gloo each one costs a trip through its worker threads and TCP on the loopback
(0.25-0.6 ms measured on a 2-core machine); a Unix socket's is one system call on each side
(about 30 µs). Processes that cannot all reach each other this way (other nodes, other
network namespaces, another user) make no link, decided together, and keep Gloo.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from replicator import _env
from replicator.comm.decision import everyone_agrees

__all__ = ["LocalLink", "LinkError"]

_TICKET = struct.Struct("<q")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class LinkError(RuntimeError):
    """A peer closed its end (it exited or crashed), or did not send in time."""


class LocalLink:
    """Every member of a group connected to every other by a SOCK_SEQPACKET Unix socket.

    `post(payload)` sends one message to every peer and returns its ticket; `collect(ticket)`
    waits for the peers' messages with that ticket. Every member posts the same number of
    messages in the same order, so the n-th message of each is the n-th exchange. Tickets may
    be collected in any order and from several threads: whichever thread waits reads for all.
    A kernel socket hands over data with a lock on each side, so whatever a peer wrote (into
    shared memory, say) before it posted is visible to the one that collected its message.
    """

    MAX_PAYLOAD = 64 << 10  # bytes a message may carry; messages of agreement checks carry 40

    def __init__(self, peers: dict[int, socket.socket], position: int, ranks: list[int], timeout_s: float) -> None:
        self.position, self.size, self.ranks, self.timeout_s = position, len(ranks), ranks, timeout_s
        self._peers = peers
        self._position_of = {peer.fileno(): at for at, peer in peers.items()}
        self._poller = select.poll()
        for peer in peers.values():
            self._poller.register(peer, select.POLLIN)
        self._sending = threading.Lock()
        self._posted = 0
        self._received_from = {at: 0 for at in peers}  # tickets each peer has sent so far
        self._inbox: dict[int, dict[int, bytes]] = {}
        self._state = threading.Condition()
        self._reading = False  # one waiting thread at a time reads the sockets, for everyone
        self._failure: LinkError | None = None  # a timeout: the members' counts no longer match
        self._departed: dict[int, LinkError] = {}  # peers whose sockets were read to their end

    # -- set-up ---------------------------------------------------------------------
    @classmethod
    def connect(cls, group: dist.ProcessGroup | None, timeout_s: float) -> LocalLink | None:
        """A link among the members of `group` (collective), or None on every member when one
        of them cannot reach all the others: it spans nodes, or sockets are unavailable.
        REPLICATOR_LOCAL_LINK=0 keeps every message on the group's backend."""
        if group is None or dist.get_world_size(group) == 1:
            return None
        ranks = dist.get_process_group_ranks(group)
        position = dist.get_rank(group)
        wanted = _env.local_link() and hasattr(socket, "SO_PEERCRED")
        # A random name, drawn by the first member. Abstract names are listed in /proc/net/unix for
        # anyone in this network namespace, so what admits a connection is its peer's pid and uid.
        token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        dist.broadcast(token, src=ranks[0], group=group)
        listener = None
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(_address(int(token), position))
            listener.listen(len(ranks))
        except OSError:
            wanted = False
        identities = [torch.empty(2, dtype=torch.int64) for _ in ranks]
        dist.all_gather(identities, torch.tensor([os.getpid(), int(wanted)], dtype=torch.int64), group=group)
        pids = [int(identity[0]) for identity in identities]
        peers: dict[int, socket.socket] = {}
        # Connecting to every lower position first completes at once (the listeners' backlogs
        # hold the connections), so nobody waits in accept() for a peer that failed to connect.
        ready = all(int(identity[1]) for identity in identities)
        if ready:
            try:
                for lower in range(position):
                    peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    peers[lower] = peer
                    peer.settimeout(timeout_s / 4)  # a full backlog must not outlast the group's timeout
                    peer.connect(_address(int(token), lower))
                    ready = ready and _peer_credentials(peer) == (pids[lower], os.getuid())
            except OSError:
                ready = False
        if everyone_agrees(ready, group):
            assert listener is not None
            ready = _accept(listener, peers, {pids[higher]: higher for higher in range(position + 1, len(ranks))},
                            timeout_s / 2)
            ready = everyone_agrees(ready, group)
        else:
            ready = False
        if listener is not None:
            listener.close()
        if not ready:
            for peer in peers.values():
                peer.close()
            return None
        for peer in peers.values():
            # Reads wait in poll() against the link's own deadline. A send does not wait: the checks'
            # members are a few messages of 48 bytes apart, and the data of small collectives is
            # collected before the next is posted (one message of at most 64 KiB per peer).
            peer.setblocking(True)
        return cls(peers, position, ranks, timeout_s)

    def close(self) -> None:
        """Close the sockets: peers see this member leave; exchanges here fail from now on."""
        with self._state:
            self._failure = self._failure or LinkError("this process closed its link")
        for peer in self._peers.values():
            peer.close()

    # -- messages -------------------------------------------------------------------
    def post(self, payload: bytes = b"") -> int:
        """Send `payload` to every peer; the ticket to collect their answers with. Raises nothing:
        a peer that has left is reported by the exchanges it can no longer complete."""
        if len(payload) > self.MAX_PAYLOAD:
            raise ValueError(f"a LocalLink message carries at most {self.MAX_PAYLOAD} bytes, got {len(payload)}")
        with self._sending:
            ticket = self._posted
            self._posted += 1
            message = _TICKET.pack(ticket) + payload
            for peer in self._peers.values():
                try:
                    peer.sendall(message, socket.MSG_NOSIGNAL)  # EPIPE, not a fatal SIGPIPE
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it left: reading its socket gives what it sent before, then its end
        return ticket

    def collect(self, ticket: int, within_s: float | None = None) -> list[bytes]:
        """Every member's payload for `ticket`, in group order (this member's own is b''); fails
        the link after `within_s` (default: the link's timeout) without them."""
        payloads = self._collect(ticket, self.timeout_s if within_s is None else within_s, final=True)
        assert payloads is not None
        return payloads

    def collect_within(self, ticket: int, within_s: float) -> list[bytes] | None:
        """`collect`, or None once `within_s` has passed without every message: the link stays
        usable (the caller looks around, then collects again). Departures and failures raise."""
        return self._collect(ticket, min(within_s, self.timeout_s), final=False)

    def missing(self, ticket: int) -> list[int]:
        """The ranks whose message for `ticket` has not arrived yet."""
        with self._state:
            arrived = self._inbox.get(ticket, {})
            return [self.ranks[at] for at in self._peers if at not in arrived]

    def _collect(self, ticket: int, within_s: float, final: bool) -> list[bytes] | None:
        deadline = time.monotonic() + within_s
        with self._state:
            while True:
                arrived = self._inbox.get(ticket, {})
                if len(arrived) == self.size - 1:
                    del self._inbox[ticket]
                    return [arrived.get(at, b"") for at in range(self.size)]
                if self._failure is not None:
                    raise self._failure
                # A peer that left after sending this ticket's message still completes it.
                for at, departure in self._departed.items():
                    if at not in arrived and self._received_from[at] <= ticket:
                        raise departure
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not final:
                    return None
                if remaining <= 0:
                    missing = [self.ranks[at] for at in self._peers if at not in arrived]
                    # The members' message counts no longer match: every later exchange must fail too.
                    self._failure = LinkError(f"rank(s) {missing} sent nothing for {self.timeout_s:.0f} s")
                    raise self._failure
                if self._reading:
                    self._state.wait(remaining)
                    continue
                self._reading = True
                self._state.release()
                received: list[tuple[int, int, bytes]] = []
                departed: dict[int, LinkError] = {}
                try:
                    received = self._read(remaining, departed)
                finally:
                    self._state.acquire()
                    self._reading = False
                    self._state.notify_all()
                for at, sent, payload in received:
                    self._inbox.setdefault(sent, {})[at] = payload
                self._departed.update(departed)

    def barrier(self) -> None:
        """Return once every member has reached this barrier."""
        self.collect(self.post())

    def _read(self, timeout_s: float, departed: dict[int, LinkError]) -> list[tuple[int, int, bytes]]:
        """(position, ticket, payload) of the messages waiting on any peer's socket, after
        waiting up to `timeout_s` for the first. Called by one thread at a time, without the
        state lock. A peer that left goes into `departed` once its last message is read."""
        received = []
        for descriptor, _ in self._poller.poll(max(1, int(timeout_s * 1000))):
            at = self._position_of[descriptor]
            reset = False
            while True:
                try:
                    message = self._peers[at].recv(_TICKET.size + self.MAX_PAYLOAD, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except ConnectionResetError:
                    # It left with our messages unread. The reset can be reported before the
                    # messages it sent us, which are still queued: read on, to its end.
                    if not reset:
                        reset = True
                        continue
                    message = b""  # reported again: nothing more will come
                except OSError as error:  # this process closed the link under a reading thread
                    raise LinkError(f"the link to rank {self.ranks[at]} failed: {error}") from error
                if not message:
                    self._poller.unregister(descriptor)
                    departed[at] = LinkError(f"rank {self.ranks[at]} closed its end of the link "
                                                   "(it exited or crashed)")
                    break
                (ticket,) = _TICKET.unpack_from(message)
                self._received_from[at] = ticket + 1
                received.append((at, ticket, message[_TICKET.size :]))
        return received


def _address(token: int, position: int) -> str:
    return f"\0replicator-link-{token:x}-{position}"  # abstract namespace: nothing on disk to leak


def _peer_credentials(peer: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of `peer`, as the kernel saw it connect."""
    raw = peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, _ = _CREDENTIALS.unpack(raw)
    return pid, uid


def _accept(listener: socket.socket, peers: dict[int, socket.socket], expected: dict[int, int],
            within_s: float) -> bool:
    """Accept a connection from each process in `expected` (pid -> position) into `peers`; False if
    they are not all there within `within_s` (well inside the group's own timeout, so that the
    members still decide together). Connections from any other process are closed unread: an
    impostor can neither take a member's place nor stall the handshake."""
    deadline = time.monotonic() + within_s
    waiting = dict(expected)
    try:
        while waiting:
            listener.settimeout(max(deadline - time.monotonic(), 1e-3))
            peer, _ = listener.accept()
            pid, uid = _peer_credentials(peer)
            if uid != os.getuid() or pid not in waiting:
                peer.close()
                continue
            peers[waiting.pop(pid)] = peer
    except OSError:
        return False
    return True
