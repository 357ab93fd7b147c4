"""PeerLink: one persistent socket per peer pair (Unix within a node, TCP across), set up once through the job's store.

A serving process (`comm.peer_server.PeerServer`) publishes its addresses in the job's store
under a name, with the job's token beside them; a peer reads them once, connects, proves it
holds the token and says who it is (rank, role, pid), and from then on the two talk over the
socket alone: the store leaves the hot path. Within a node (same host and network namespace)
the socket is a Unix one and the kernel's credentials (`SO_PEERCRED`) must match the pid and
user that were published or claimed; across nodes it is TCP to the address the server
published. Frames are those of `comm.frames`: one `sendmsg` of the header and the tensors'
own bytes, received with `recv_into` straight into the caller's tensors or a reused buffer.

A peer's end of file or a reset raises `PeerDied` at once, naming it; a peer that sends
nothing for the timeout (REPLICATOR_TIMEOUT) raises `PeerLinkError`, naming it too.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from replicator import _env
from replicator.comm.frames import (
    HEADER,
    HELLO,
    WELCOME,
    Frame,
    FrameError,
    Limits,
    TensorSpec,
    byte_view,
    encode,
    parse_header,
    parse_specs,
)
from replicator.comm.store import job_store

__all__ = ["Peer", "PeerConnection", "ReadAhead", "PeerLinkError", "PeerDied", "PeerDropped", "connect", "job_token",
           "node_identity", "HANDSHAKE_LIMITS"]

KEY = "replicator/peer_link/"
TOKEN_BYTES = 32
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_HELLO = struct.Struct(f"<{TOKEN_BYTES}sqqB")  # token, rank, pid, length of the role that follows
_WELCOME = struct.Struct("<qqQIIIB")  # rank, pid, max payload, max extension, max tensors, max dims, role length
# What a peer may send before it has shown the token: a HELLO and nothing more.
HANDSHAKE_LIMITS = Limits(max_payload=0, max_extension=_HELLO.size + 255, max_tensors=0, max_dims=0)
BUFFER_BYTES = 4 << 20  # kernel socket buffers asked for, each way
_ALIGN = 64  # each received tensor starts at a multiple of this in the reused buffer (any dtype can view it)


class PeerLinkError(RuntimeError):
    """The link to a peer failed: it broke the protocol, sent nothing in time, or could not be made."""

    def __init__(self, message: str, peer: Peer | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerDied(PeerLinkError):
    """A peer closed its end (end of file or a reset): it exited or crashed."""


class PeerDropped(PeerLinkError):
    """A server dropped a peer that broke the protocol or stopped in the middle of a frame."""


@dataclass(frozen=True)
class Peer:
    """Who is at the other end of a connection, as it said in its handshake (and the kernel confirmed)."""

    rank: int  # -1: not in the torch.distributed world
    role: str
    pid: int
    address: str  # where it connected from (Unix: "unix"; TCP: host:port)
    serial: int = 0  # tells apart two connections of the same process (a server numbers them)

    def __str__(self) -> str:
        who = f"rank {self.rank}" if self.rank >= 0 else f"pid {self.pid}"
        return f"{who} ({self.role})" if self.role else who


def node_identity() -> str:
    """Processes with the same identity reach each other by Unix socket (one host, one network namespace)."""
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


def job_token(store: dist.Store | None = None) -> bytes:
    """The job's random token, drawn by whichever process asks first (atomically, in the store)."""
    store = store or job_store()
    value = store.compare_set(f"{KEY}token", "", secrets.token_hex(TOKEN_BYTES))
    return bytes.fromhex(value.decode("ascii"))


# -- sending and receiving, shared by both ends ------------------------------------------------


def send_buffers(sock: socket.socket, buffers: list[memoryview | bytes], within_s: float | None) -> int:
    """Send every buffer, in order, with as few `sendmsg` calls as the kernel allows (one when it takes all);
    returns the bytes sent."""
    total = sum(memoryview(buffer).nbytes for buffer in buffers)
    if len(buffers) <= 512:  # the usual case, in one call: the kernel takes the whole frame
        try:
            sent = sock.sendmsg(buffers, [], socket.MSG_NOSIGNAL)
        except BlockingIOError:
            if sock.gettimeout() is None:  # a blocking socket: its kernel send timeout (SO_SNDTIMEO) passed
                raise TimeoutError("the peer took nothing for the timeout") from None
            sent = 0  # a non-blocking one, full: wait below until it takes more
        if sent == total:
            return total
        buffers = _past(buffers, sent)
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    deadline = None if within_s is None else time.monotonic() + within_s
    while views:
        try:
            sent = sock.sendmsg(views[:512], [], socket.MSG_NOSIGNAL)  # under IOV_MAX; EPIPE, not SIGPIPE
        except BlockingIOError:
            if sock.gettimeout() is None:  # a blocking socket: its kernel send timeout (SO_SNDTIMEO) passed
                raise TimeoutError("the peer took nothing for the timeout") from None
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("the peer took nothing for the timeout") from None
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            poller.poll(None if remaining is None else max(1, int(remaining * 1000)))
            continue
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]
    return total


def _past(buffers: list[memoryview | bytes], sent: int) -> list[memoryview | bytes]:
    """What is left of `buffers` once their first `sent` bytes are gone."""
    left = [memoryview(buffer).cast("B") for buffer in buffers]
    while left and sent >= left[0].nbytes:
        sent -= left.pop(0).nbytes
    if sent:
        left[0] = left[0][sent:]
    return list(left)


def tune(sock: socket.socket, timeout_s: float | None) -> None:
    """Large kernel buffers (a model-sized frame in one `sendmsg`) and, for a blocking socket, the
    timeout kept by the kernel (SO_RCVTIMEO/SO_SNDTIMEO): a wait costs no `poll` before each call."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)  # the kernel caps it at its maximum
    if timeout_s is not None:
        sock.settimeout(None)
        seconds = min(int(timeout_s), 2**31 - 1)
        timeval = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            sock.setsockopt(socket.SOL_SOCKET, option, timeval)


class ReadAhead:
    """Bytes read past what was asked, kept for the next read: the header, the descriptors and a small
    payload cost one `recv` together, while a large payload is received straight into its tensor."""

    SIZE = 64 << 10

    def __init__(self) -> None:
        self.view = memoryview(bytearray(self.SIZE))
        self.start = self.end = 0

    @property
    def pending(self) -> int:
        return self.end - self.start

    def take(self, target: memoryview) -> int:
        """Copy what is buffered into `target`; how many bytes."""
        count = min(self.end - self.start, target.nbytes)
        if count:
            target[:count] = self.view[self.start : self.start + count]
            self.start += count
        return count

    def recv(self, sock: socket.socket, target: memoryview) -> int:
        """Bytes received into `target` (0: end of file); only when nothing is buffered."""
        if target.nbytes >= self.SIZE // 2:
            return sock.recv_into(target)
        self.start, self.end = 0, sock.recv_into(self.view)
        return self.take(target)


class Landing:
    """A buffer reused from frame to frame: each received tensor lands in an aligned slot of it."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._specs: Sequence[TensorSpec] = ()
        self._views: list[torch.Tensor] = []
        self._bytes: list[memoryview] = []

    def views(self, specs: Sequence[TensorSpec]) -> tuple[list[torch.Tensor], list[memoryview]]:
        """Tensors for `specs` in the buffer, and their bytes; the same objects again while the shapes repeat."""
        if specs is self._specs or specs == self._specs:
            return self._views, self._bytes
        offsets, total = [], 0
        for spec in specs:
            offsets.append(total)
            total += -(-spec.nbytes // _ALIGN) * _ALIGN
        if total > self.buffer.numel():
            self.buffer = torch.empty(max(total, 2 * self.buffer.numel()), dtype=torch.uint8)
        self._views = [self.buffer[at : at + spec.nbytes].view(spec.dtype).view(spec.shape)
                       for at, spec in zip(offsets, specs, strict=True)]
        self._bytes = [byte_view(view) for view in self._views]
        self._specs = specs
        return self._views, self._bytes


def check_into(specs: Sequence[TensorSpec], into: Sequence[torch.Tensor], peer: Peer) -> str | None:
    """Why the caller's tensors cannot take this frame's (None: they can)."""
    unfit = [n for n, tensor in enumerate(into) if tensor.device.type != "cpu" or not tensor.is_contiguous()]
    if unfit:
        return (f"the tensors at {unfit} to receive {peer}'s frame into are not contiguous CPU tensors "
                "(call .contiguous(), or receive into a CPU buffer and copy)")
    wanted = [(tensor.dtype, tuple(tensor.shape)) for tensor in into]
    sent = [(spec.dtype, spec.shape) for spec in specs]
    if wanted != sent:
        return f"{peer} sent tensors {sent}, the receiver expected {wanted}"
    return None


def hello(token: bytes, rank: int, role: str) -> bytes:
    encoded = role.encode("ascii")[:255]
    return _HELLO.pack(token, rank, os.getpid(), len(encoded)) + encoded


def read_hello(extension: bytes | bytearray | memoryview) -> tuple[bytes, int, int, str]:
    """(token, rank, pid, role) of a HELLO's extension, or FrameError."""
    if len(extension) < _HELLO.size:
        raise FrameError(f"a HELLO of {len(extension)} bytes, shorter than {_HELLO.size}")
    token, rank, pid, length = _HELLO.unpack_from(extension)
    if len(extension) != _HELLO.size + length:
        raise FrameError("a HELLO whose role does not fill it")
    try:
        role = bytes(extension[_HELLO.size :]).decode("ascii")
    except UnicodeDecodeError:
        raise FrameError("a HELLO whose role is not ASCII") from None
    return token, rank, pid, role


def welcome(rank: int, role: str, limits: Limits) -> bytes:
    encoded = role.encode("ascii")[:255]
    return _WELCOME.pack(rank, os.getpid(), limits.max_payload, limits.max_extension, limits.max_tensors,
                         limits.max_dims, len(encoded)) + encoded


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel saw it connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, _ = _CREDENTIALS.unpack(raw)
    return pid, uid


# -- the connecting end ------------------------------------------------------------------------


# Where a received frame's tensors land, chosen once its kind and tensor specs are known (None: the reused buffer).
IntoFor = Callable[[int, Sequence[TensorSpec]], Sequence[torch.Tensor] | None]


class PeerConnection:
    """A connected peer: `send` a frame (from any thread), `receive` the next one (one thread at a time;
    blocking, at most the timeout)."""

    def __init__(self, sock: socket.socket, peer: Peer, limits: Limits, transport: str, timeout_s: float) -> None:
        self.sock, self.peer, self.limits, self.transport, self.timeout_s = sock, peer, limits, transport, timeout_s
        self._header = bytearray(HEADER.size)
        self._extension = bytearray(limits.max_extension)
        self._landing = Landing()
        self._broken: PeerLinkError | None = None
        self._sending = threading.Lock()  # frames from several threads go whole, one after another
        self._ahead = ReadAhead()
        # The last tuple of tensors received into (it cannot change), its specs, and their byte views.
        self._into: tuple[object, object, list[torch.Tensor], list[memoryview]] = (None, None, [], [])
        self.sent_bytes = self.received_bytes = 0  # whole frames, as a report of what the link carried
        tune(sock, timeout_s)

    def send(self, kind: int, tensors: Sequence[torch.Tensor] = (), *, request: int = 0, flags: int = 0) -> None:
        """One frame: the header and every tensor's bytes, in place, in one `sendmsg` when the kernel takes it all."""
        if self._broken is not None:
            raise self._broken
        buffers = encode(kind, tensors, request, flags, self.limits)
        try:
            with self._sending:
                self.sent_bytes += send_buffers(self.sock, buffers, None)
        except (BrokenPipeError, ConnectionResetError) as error:
            raise self._fail(PeerDied(f"{self.peer} closed its end of the link (it exited or crashed): {error}",
                                      self.peer)) from None
        except (TimeoutError, OSError) as error:
            raise self._fail(PeerLinkError(f"sending to {self.peer} failed: {error}", self.peer)) from None

    def receive(self, into: Sequence[torch.Tensor] | IntoFor | None = None) -> Frame:
        """The next frame. With `into`, its tensors land in those (dtypes and shapes must match what
        was sent); without, in a buffer this connection reuses (views valid until the next receive).
        `into` may also be a function of the frame's kind and tensor specs that returns the tensors to
        land in, or None for the reused buffer (a reply whose kind says whether it carries weights). A
        tuple is checked and viewed once, then reused while frames land in it (its tensors must keep
        their storage meanwhile)."""
        if self._broken is not None:
            raise self._broken
        try:
            self._fill(memoryview(self._header))
            header = parse_header(self._header, self.limits)
            extension = memoryview(self._extension)[: header.extension]
            self._fill(extension)
            specs = parse_specs(extension, header.payload, self.limits)
            if callable(into):
                into = into(header.kind, specs)
            mismatch = None
            if into is None:
                tensors, targets = self._landing.views(specs)
            elif into is self._into[0] and specs is self._into[1]:  # the same buffers as last time: checked then
                tensors, targets = self._into[2], self._into[3]
            elif (mismatch := check_into(specs, into, self.peer)) is None:
                tensors, targets = list(into), [byte_view(tensor) for tensor in into]
                if isinstance(into, tuple):  # it cannot change: its checks and byte views hold for the next frame
                    self._into = (into, specs, tensors, targets)
            else:
                tensors, targets = self._landing.views(specs)
            for target in targets:
                self._fill(target)
        except FrameError as error:
            raise self._fail(PeerLinkError(f"{self.peer} broke the link's protocol: {error}", self.peer)) from None
        self.received_bytes += HEADER.size + header.extension + header.payload
        if mismatch is not None:
            raise ValueError(mismatch)  # the frame was read whole: the link is still in step
        return Frame(header.kind, header.flags, header.request, list(tensors))

    def _fill(self, view: memoryview) -> None:
        filled = self._ahead.take(view)
        while filled < view.nbytes:
            try:
                received = self._ahead.recv(self.sock, view[filled:])
            except (TimeoutError, BlockingIOError):  # BlockingIOError: the kernel's receive timeout passed
                raise self._fail(PeerLinkError(f"{self.peer} sent nothing for {self.timeout_s:.0f} s "
                                               f"(REPLICATOR_TIMEOUT): it hangs", self.peer)) from None
            except ConnectionResetError:
                received = 0
            except OSError as error:
                raise self._fail(PeerLinkError(f"the link to {self.peer} failed: {error}", self.peer)) from None
            if received == 0:
                where = f" in the middle of a frame ({filled} of {view.nbytes} bytes)" if filled else ""
                raise self._fail(PeerDied(f"{self.peer} closed its end of the link{where} (it exited or crashed)",
                                          self.peer))
            filled += received

    def _fail(self, error: PeerLinkError) -> PeerLinkError:
        self._broken = error
        self.sock.close()
        return error

    def close(self) -> None:
        self._broken = self._broken or PeerLinkError("this process closed the link", self.peer)
        self.sock.close()


def _record(name: str, store: dist.Store, within_s: float) -> dict[str, object]:
    key = f"{KEY}address/{name}"
    try:
        store.wait([key], timedelta(seconds=within_s))
    except RuntimeError as error:  # torch's DistStoreError: the wait timed out or the store went away
        raise PeerLinkError(f"no server was published as {name!r} within {within_s:g} s: {error}") from None
    try:
        record = json.loads(store.get(key).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise PeerLinkError(f"the store's record of {name!r} is not JSON: {error}") from None
    fields = {"rank": int, "role": str, "pid": int, "node": str, "unix": str, "host": str, "port": int}
    if not isinstance(record, dict) or any(not isinstance(record.get(k), t) for k, t in fields.items()):
        raise PeerLinkError(f"the store's record of {name!r} lacks a field of {sorted(fields)}: {record!r}")
    return record


def connect(name: str, *, rank: int, role: str, store: dist.Store | None = None, timeout_s: float | None = None,
            force_tcp: bool = False) -> PeerConnection:
    """Connect to the server published as `name` (waiting up to the timeout for it to publish), over a
    Unix socket when it runs on this node, else TCP; handshake, and return the connection."""
    store = store or job_store()
    timeout_s = _env.timeout_s() if timeout_s is None else timeout_s
    record = _record(name, store, timeout_s)
    token = job_token(store)
    server = Peer(int(record["rank"]), str(record["role"]), int(record["pid"]), "")  # type: ignore[call-overload]
    attempts: list[tuple[str, socket.socket, object]] = []
    if record["node"] == node_identity() and not force_tcp:
        attempts.append(("unix", socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), "\0" + str(record["unix"])))
    attempts.append(("tcp", socket.socket(socket.AF_INET, socket.SOCK_STREAM), (record["host"], record["port"])))
    errors = []
    for transport, sock, address in attempts:
        try:
            sock.settimeout(timeout_s)
            sock.connect(address)  # type: ignore[arg-type]
            if transport == "unix" and peer_credentials(sock) != (server.pid, os.getuid()):
                raise PeerLinkError(f"the process listening as {name!r} is pid/uid {peer_credentials(sock)}, "
                                    f"not the published {(server.pid, os.getuid())}")
            if transport == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return _handshake(sock, server, token, rank, role, transport, timeout_s)
        except (OSError, PeerLinkError) as error:
            sock.close()
            errors.append(f"{transport} {address!r}: {error}")
    raise PeerLinkError(f"could not reach {server} (published as {name!r}): " + "; ".join(errors)
                        + " (a server closes a connection it refuses: its log says why)", server)


def _handshake(sock: socket.socket, server: Peer, token: bytes, rank: int, role: str, transport: str,
               timeout_s: float) -> PeerConnection:
    send_buffers(sock, encode(HELLO, (), 0, 0, HANDSHAKE_LIMITS, extension=hello(token, rank, role)), timeout_s)
    greeting = PeerConnection(sock, server, Limits(max_payload=0, max_extension=_WELCOME.size + 255), transport,
                              timeout_s)  # becomes the connection: what it read past the WELCOME stays in it
    header_view = memoryview(greeting._header)
    greeting._fill(header_view)
    header = parse_header(greeting._header, greeting.limits)
    if header.kind != WELCOME or header.payload:
        raise PeerLinkError(f"{server} answered the handshake with a frame of kind {header.kind}", server)
    extension = memoryview(greeting._extension)[: header.extension]
    greeting._fill(extension)
    if len(extension) < _WELCOME.size:
        raise PeerLinkError(f"{server} sent a WELCOME of {len(extension)} bytes", server)
    their_rank, pid, max_payload, max_extension, max_tensors, max_dims, length = _WELCOME.unpack_from(extension)
    their_role = bytes(extension[_WELCOME.size : _WELCOME.size + length]).decode("ascii", errors="replace")
    if (their_rank, pid) != (server.rank, server.pid):
        raise PeerLinkError(f"the handshake answered as rank {their_rank} pid {pid}, not {server}", server)
    host, port = sock.getpeername()[:2] if transport == "tcp" else ("", 0)
    greeting.peer = Peer(their_rank, their_role, pid, f"{host}:{port}" if transport == "tcp" else "unix")
    ours = Limits()  # the bounds agreed: the tighter of the server's and this end's
    greeting.limits = Limits(min(max_payload, ours.max_payload), min(max_extension, ours.max_extension),
                             min(max_tensors, ours.max_tensors), min(max_dims, ours.max_dims))
    greeting._extension = bytearray(greeting.limits.max_extension)
    return greeting


def token_matches(token: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(token, expected)
