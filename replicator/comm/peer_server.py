"""PeerServer: one event loop (selectors) that accepts peers and receives each next frame from whichever sends it.

This is the any-source receive that Gloo lacks: `receive()` sleeps in the kernel until some
connection is readable, reads what arrived without blocking on anyone, and returns the first
whole frame, so one thread serves every peer. Reading is incremental per connection (header,
extension, payload), so a peer that stalls in the middle of a frame holds up nobody; it is
dropped when its frame has not completed within the stall timeout.

Hostile or broken peers are refused or dropped with a log line that names them, and the loop
goes on serving the others: a connection without the job's token (or, on a Unix socket,
another user, or a pid other than the one it claims), a frame past the agreed bounds, bytes
that are not a frame, a peer that stops in the middle of one. A peer that had completed its
handshake and then leaves (end of file, reset) or is dropped makes `receive()` raise
`PeerDied` or `PeerDropped` naming it, once, after the frames it sent before; the server
stays usable.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from replicator import _env
from replicator.comm.frames import (
    FIRST_USER_KIND,
    HEADER,
    HELLO,
    WELCOME,
    Frame,
    FrameError,
    Header,
    Limits,
    TensorSpec,
    byte_view,
    encode,
    parse_header,
    parse_specs,
)
from replicator.comm.peer_link import (
    HANDSHAKE_LIMITS,
    KEY,
    Landing,
    Peer,
    PeerDied,
    PeerDropped,
    PeerLinkError,
    ReadAhead,
    check_into,
    job_token,
    node_identity,
    peer_credentials,
    read_hello,
    send_buffers,
    token_matches,
    tune,
    welcome,
)
from replicator.comm.store import job_store

__all__ = ["PeerServer", "advertised_host"]

log = logging.getLogger("replicator.comm.peer_link")

# Where a frame's tensors land: the server's own tensors for this peer and kind (the caller's
# buffers, filled in place), or None for the connection's reused buffer. A tuple is checked and
# viewed once, then reused while frames land in it (its tensors must keep their storage meanwhile).
Placement = Callable[[Peer, int, Sequence[TensorSpec]], Sequence[torch.Tensor] | None]


def advertised_host() -> str:
    """The address of this host's interface toward the job's master (127.0.0.1 without one)."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master, 1))  # a UDP "connect" sends nothing: it only picks the route
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


@dataclass(eq=False)  # identity: kept in sets
class _Connection:
    """One accepted socket and where it stands in reading its current frame."""

    sock: socket.socket
    peer: Peer
    limits: Limits
    deadline: float | None  # a handshake or a started frame must be complete by then
    transport: str
    ready: bool = False  # handshake done
    header_bytes: bytearray = field(default_factory=lambda: bytearray(HEADER.size))
    extension: bytearray = field(default_factory=bytearray)
    header: Header | None = None
    targets: list[memoryview] = field(default_factory=list)  # what is still to be filled, in order
    filled: int = 0  # of targets[0]
    tensors: list[torch.Tensor] = field(default_factory=list)
    stage: str = "header"
    landing: Landing = field(default_factory=Landing)
    mismatch: str | None = None
    started: bool = False  # some bytes of the current frame have arrived
    ahead: ReadAhead = field(default_factory=ReadAhead)
    paused: bool = False  # a whole frame of it waits for the caller: read no further until it is done
    registered: bool = True  # with the selector (a paused connection leaves it only if it turns up ready)
    # The last placement that was a tuple (it cannot change), the specs it took, its tensors and their byte views.
    placed: tuple[object, object, list[torch.Tensor], list[memoryview]] = (None, None, [], [])


class PeerServer:
    """Listens on a Unix socket and a TCP port, publishes both under `name` in the job's store, and
    serves every peer that connects with the job's token from one thread."""

    def __init__(self, name: str, *, rank: int, role: str, store: dist.Store | None = None,
                 limits: Limits | None = None, timeout_s: float | None = None, host: str | None = None,
                 place: Placement | None = None, handshake_s: float = 10.0) -> None:
        self.name, self.rank, self.role = name, rank, role
        self.limits = limits or Limits()
        self.timeout_s = _env.timeout_s() if timeout_s is None else timeout_s
        self.handshake_s = min(handshake_s, self.timeout_s)
        self.place = place
        store = store or job_store()
        self.token = job_token(store)
        self.selector = selectors.DefaultSelector()
        self.connections: dict[Peer, _Connection] = {}
        self._pending: set[_Connection] = set()  # accepted, handshake not complete
        self._events: deque[tuple[_Connection, Frame | PeerLinkError]] = deque()
        self._held: _Connection | None = None  # its last frame was handed out: its buffer is in use
        self._serial = 0
        self._woken = False
        unix_name = f"replicator-peer-{secrets.token_hex(8)}"
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind("\0" + unix_name)  # abstract: nothing on disk; admission is by token and credentials
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.bind((host or advertised_host(), 0))
        for listener, transport in ((self.unix, "unix"), (self.tcp, "tcp")):
            listener.listen(128)
            listener.setblocking(False)
            self.selector.register(listener, selectors.EVENT_READ, transport)
        # wake(): another thread's byte on this pair ends a wait in receive() (it then returns None).
        self._wake_read, self._wake_write = socket.socketpair()
        for end in (self._wake_read, self._wake_write):
            end.setblocking(False)
        self.selector.register(self._wake_read, selectors.EVENT_READ, _WAKE)
        self.host, self.port = self.tcp.getsockname()[:2]
        record = {"rank": rank, "role": role, "pid": os.getpid(), "node": node_identity(), "unix": unix_name,
                  "host": self.host, "port": self.port}
        store.set(f"{KEY}address/{name}", json.dumps(record))

    # -- the loop ------------------------------------------------------------------------------
    def receive(self, timeout_s: float | None = None) -> tuple[Peer, Frame] | None:
        """The next whole frame from any peer, or None after `timeout_s` (None: wait for one).

        Raises PeerDied / PeerDropped (`.peer` names it) when a peer that had joined leaves; the
        server goes on. A frame's tensors are the placement's or views of its connection's
        buffer, valid until the next `receive()`."""
        if self._held is not None:
            self._release(self._held)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._woken = False
        while not self._events:
            self._turn(deadline)
            if not self._events and (self._woken or deadline is not None and time.monotonic() >= deadline):
                return None
        connection, event = self._events.popleft()
        if isinstance(event, PeerLinkError):
            raise event
        self._hold(connection)
        return connection.peer, event

    def wait_for(self, count: int, timeout_s: float | None = None) -> list[Peer]:
        """Run the loop until `count` peers have joined (a peer's `connect` returns once the server has
        answered its handshake, which it does inside this loop); frames that arrive meanwhile wait
        for `receive()`. Raises PeerLinkError naming who joined, after `timeout_s` (default: the timeout)."""
        within_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + within_s
        while len(self.connections) < count:
            if time.monotonic() >= deadline:
                raise PeerLinkError(f"{len(self.connections)} of {count} peers joined {self.name!r} within "
                                    f"{within_s:g} s: {', '.join(map(str, self.connections)) or 'none'}")
            self._turn(deadline)
        return self.peers

    def _turn(self, deadline: float | None) -> None:
        """One wait in the kernel for any socket, then everything it says is ready, without blocking."""
        now = time.monotonic()
        waits = [c.deadline - now for c in (*self._pending, *self.connections.values()) if c.deadline is not None]
        if deadline is not None:
            waits.append(deadline - now)
        for key, _ in self.selector.select(max(0.0, min(waits)) if waits else None):
            if key.data is _WAKE:
                self._woken = True
                try:
                    while self._wake_read.recv(4096):
                        pass
                except BlockingIOError:
                    pass
            elif isinstance(key.data, str):
                self._accept(key.fileobj, key.data)  # type: ignore[arg-type]
            elif key.data.paused:  # more of it waits in the kernel: leave it there, and stop asking
                self.selector.unregister(key.fileobj)
                key.data.registered = False
            else:
                self._read(key.data)
        self._expire(time.monotonic())

    def send(self, peer: Peer, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0,
             flags: int = 0) -> None:
        """One frame to `peer`. Raises PeerDied if it has gone (it is dropped here, no event follows)."""
        connection = self.connections.get(peer)
        if connection is None:
            raise PeerDied(f"{peer} is no longer connected", peer)
        try:
            send_buffers(connection.sock, encode(kind, tensors, request, flags, connection.limits), self.timeout_s)
        except (BrokenPipeError, ConnectionResetError) as error:
            self._close(connection)
            raise PeerDied(f"{peer} closed its end of the link (it exited or crashed): {error}", peer) from None
        except (TimeoutError, OSError) as error:
            self._close(connection)
            raise PeerDropped(f"{peer} took no reply for {self.timeout_s:.0f} s: {error}", peer) from None

    @property
    def peers(self) -> list[Peer]:
        return list(self.connections)

    def disconnect(self, peer: Peer) -> None:
        """Close `peer`'s connection quietly (it said goodbye): no log line, no PeerDied event follows."""
        connection = self.connections.get(peer)
        if connection is not None:
            self._close(connection)

    def wake(self) -> None:
        """From any thread: make the serving thread's current (or next) wait in `receive()` return None."""
        try:
            self._wake_write.send(b"w")
        except (BlockingIOError, OSError):
            pass  # a byte is already waiting (the pair's buffer is full), or the server closed

    def close(self) -> None:
        for connection in [*self._pending, *self.connections.values()]:
            self._close(connection)
        self.selector.unregister(self._wake_read)
        self._wake_read.close()
        self._wake_write.close()
        for listener in (self.unix, self.tcp):
            self.selector.unregister(listener)
            listener.close()
        self.selector.close()

    # -- connections -----------------------------------------------------------------------------
    def _accept(self, listener: socket.socket, transport: str) -> None:
        while True:
            try:
                sock, address = listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            tune(sock, None)
            if transport == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                where = f"{address[0]}:{address[1]}"
                pid = -1
            else:
                pid, uid = peer_credentials(sock)
                where = "unix"
                if uid != os.getuid():
                    log.warning("peer link %r: refused a connection from pid %d: it runs as uid %d, the job as %d",
                                self.name, pid, uid, os.getuid())
                    sock.close()
                    continue
            connection = _Connection(sock, Peer(-1, "unidentified", pid, where), HANDSHAKE_LIMITS,
                                     time.monotonic() + self.handshake_s, transport)
            self._pending.add(connection)
            self.selector.register(sock, selectors.EVENT_READ, connection)

    def _read(self, connection: _Connection) -> None:
        """Take what the socket holds, without blocking; stop at the end of a frame (its buffer is then in use)."""
        try:
            while True:
                if connection.stage == "header":
                    target = memoryview(connection.header_bytes)
                else:
                    target = connection.targets[0]
                rest = target[connection.filled :]
                received = connection.ahead.take(rest)
                if not received and rest.nbytes:
                    received = connection.ahead.recv(connection.sock, rest)
                    if received == 0:
                        raise _Departed(connection.filled or connection.started)
                if not connection.started:
                    connection.started = True
                    if connection.ready:
                        connection.deadline = time.monotonic() + self.timeout_s
                connection.filled += received
                if connection.filled < target.nbytes:
                    continue
                connection.filled = 0
                if self._advance(connection):
                    return
        except BlockingIOError:
            return
        except ConnectionResetError:
            self._drop(connection, "reset its connection (it exited or crashed)", died=True)
        except _Departed as departed:
            where = " in the middle of a frame" if departed.args[0] else ""
            self._drop(connection, f"closed its end of the link{where} (it exited or crashed)", died=True)
        except (FrameError, PeerLinkError) as error:
            self._drop(connection, f"broke the link's protocol: {error}")
        except OSError as error:
            self._drop(connection, f"failed: {error}", died=True)

    def _advance(self, connection: _Connection) -> bool:
        """Move past a filled part of the frame; True once the frame is whole (and queued)."""
        if connection.stage == "header":
            connection.header = parse_header(connection.header_bytes, connection.limits)
            connection.extension = bytearray(connection.header.extension)
            connection.targets = [memoryview(connection.extension)]
            connection.stage = "extension"
            if connection.header.extension:
                return False
        header = connection.header
        assert header is not None
        if connection.stage == "extension":
            connection.targets.pop(0)
            if not connection.ready:
                self._greet(connection, header)
                return False
            if header.kind < FIRST_USER_KIND:
                raise FrameError(f"a frame of the link's own kind {header.kind} after the handshake")
            specs = parse_specs(connection.extension, header.payload, connection.limits)
            placed = self.place(connection.peer, header.kind, specs) if self.place is not None else None
            mismatch = None
            if placed is not None and placed is connection.placed[0] and specs is connection.placed[1]:
                connection.tensors, targets = connection.placed[2], connection.placed[3]  # checked last time
            elif placed is not None and (mismatch := check_into(specs, placed, connection.peer)) is None:
                connection.tensors = list(placed)
                targets = [view for view in map(byte_view, placed) if view.nbytes]
                if isinstance(placed, tuple):  # it cannot change: its checks and byte views hold for the next frame
                    connection.placed = (placed, specs, connection.tensors, targets)
            else:
                connection.tensors, targets = connection.landing.views(specs)
                targets = [view for view in targets if view.nbytes]
            connection.mismatch, connection.targets = mismatch, list(targets)
            connection.stage = "payload"
        elif connection.targets:
            connection.targets.pop(0)
        if connection.targets:
            return False
        frame = Frame(header.kind, header.flags, header.request, list(connection.tensors))
        connection.stage, connection.started, connection.deadline = "header", False, None
        if connection.mismatch is not None:
            log.warning("peer link %r: %s; the frame was read and dropped", self.name, connection.mismatch)
            return False
        self._events.append((connection, frame))
        connection.paused = True  # until the caller is done with the frame's buffer
        return True

    def _greet(self, connection: _Connection, header: Header) -> None:
        if header.kind != HELLO:
            raise FrameError(f"expected a HELLO, got a frame of kind {header.kind}")
        token, rank, pid, role = read_hello(connection.extension)
        if not token_matches(token, self.token):
            raise FrameError("it did not present the job's token")
        if connection.transport == "unix" and pid != connection.peer.pid:
            raise FrameError(f"it claims pid {pid}, the kernel says {connection.peer.pid}")
        self._serial += 1
        connection.peer = Peer(rank, role, pid, connection.peer.address, self._serial)
        connection.limits = self.limits
        connection.ready, connection.deadline, connection.started = True, None, False
        connection.stage = "header"
        self._pending.discard(connection)
        self.connections[connection.peer] = connection
        connection.sock.setblocking(True)  # the greeting is a few dozen bytes into an empty buffer
        send_buffers(connection.sock, encode(WELCOME, (), 0, 0, self.limits,
                                             extension=welcome(self.rank, self.role, self.limits)), self.handshake_s)
        connection.sock.setblocking(False)

    def _expire(self, now: float) -> None:
        for connection in [*self._pending, *self.connections.values()]:
            if connection.deadline is not None and now >= connection.deadline:
                what = "its handshake" if not connection.ready else "a frame"
                self._drop(connection, f"stopped in the middle of {what} for "
                                       f"{self.timeout_s if connection.ready else self.handshake_s:.0f} s")

    def _drop(self, connection: _Connection, why: str, died: bool = False) -> None:
        who = connection.peer if connection.ready else f"a connection from {connection.peer.address}" + (
            f" (pid {connection.peer.pid})" if connection.peer.pid >= 0 else "")
        what = why if died else f"was dropped: it {why}"
        log.warning("peer link %r: %s %s", self.name, who, what)
        self._close(connection)
        if connection.ready:
            kind = PeerDied if died else PeerDropped
            self._events.append((connection, kind(f"{connection.peer} {what}", connection.peer)))

    def _close(self, connection: _Connection) -> None:
        self._pending.discard(connection)
        self.connections.pop(connection.peer, None)
        if self._held is connection:
            self._held = None
        if connection.registered:
            connection.registered = False
            self.selector.unregister(connection.sock)
        connection.sock.close()

    def _hold(self, connection: _Connection) -> None:
        self._held = connection if connection.peer in self.connections else None

    def _release(self, connection: _Connection) -> None:
        self._held = None
        connection.paused = False
        if connection.peer not in self.connections:
            return
        if not connection.registered:
            self.selector.register(connection.sock, selectors.EVENT_READ, connection)
            connection.registered = True
        if connection.ahead.pending:  # the next frame, or part of it, was read with this one
            self._read(connection)


_WAKE = object()  # the selector's mark for the wake() pair


class _Departed(Exception):
    """A connection reached its end of file (args[0]: whether in the middle of a frame)."""
