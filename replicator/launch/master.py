"""Finding node 0 of a multi-node job: `--master` resolved at once, then waited for, saying so while it waits."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

__all__ = ["split_master", "resolve_master", "wait_for_master", "NOTE_EVERY_S"]

NOTE_EVERY_S = 10.0  # how often a node waiting for node 0 says that it still waits


def split_master(master: str) -> tuple[str, int]:
    """HOST and PORT of `--master HOST:PORT` (an IPv6 host may be bracketed: [::1]:29400)."""
    host, port = master.rsplit(":", 1)
    return host.strip("[]"), int(port)


def resolve_master(master: str) -> tuple[str, int]:
    """HOST and PORT of `master`; raises ValueError at once when HOST does not resolve.

    torch's store would retry an unresolvable name until its rendezvous timed out, in silence.
    """
    host, port = split_master(master)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        reason = error.strerror if isinstance(error, socket.gaierror) else str(error)
        raise ValueError(
            f"--master {master}: the host name {host!r} does not resolve ({reason}). Give node 0's host name "
            "or IP address as the other nodes reach it (for example the address `hostname -I` prints on node 0), "
            "the same on every node"
        ) from None
    return host, port


def wait_for_master(host: str, port: int, timeout_s: float, node_rank: int,
                    say: Callable[[str], None]) -> None:
    """Return once node 0 accepts connections at HOST:PORT; raise TimeoutError after `timeout_s`.

    Nodes may start in any order: until node 0's launcher listens, this one says every
    NOTE_EVERY_S that it is waiting, instead of hanging in torch's rendezvous without a word.
    """
    started = time.monotonic()
    next_note = 0.0
    while True:
        waited = time.monotonic() - started
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s - waited))):
                return
        except OSError as error:
            reason = error.strerror or str(error)
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise TimeoutError(
                f"node 0 did not answer at {host}:{port} within {timeout_s:g} s (this is node {node_rank}; last "
                f"attempt: {reason}). Start node 0 (`replicator launch --node-rank 0` with the same --master; nodes "
                f"may start in any order), check that {host} is node 0's address as this machine reaches it "
                f"and that port {port} is open between them, or wait longer with --master-timeout SECONDS"
            )
        if waited >= next_note:
            say(f"replicator: waiting for node 0 at {host}:{port} ({waited:.0f} s)")
            next_note += NOTE_EVERY_S
        time.sleep(min(1.0, max(0.0, timeout_s - waited)))
