"""LocalLink: messages in order from any thread, a departed peer reported at once, links made by all or none."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.comm.local_link import LinkError, LocalLink, _accept, _peer_credentials
from replicator.testing import run_replicas
from replicator.topology import build_process_groups, discover


def _group() -> dist.ProcessGroup | None:
    return build_process_groups(discover()).control  # every process, on Gloo


def _exchanges() -> dict[str, Any]:
    link = LocalLink.connect(_group(), timeout_s=30)
    assert link is not None
    rank = dist.get_rank()
    tickets = [link.post(f"{rank}:{n}".encode()) for n in range(3)]
    collected: dict[int, list[bytes]] = {}
    # The last ticket on another thread while this one collects the first two in reverse:
    # whichever thread reads must hand every message to the right exchange.
    late = threading.Thread(target=lambda: collected.__setitem__(2, link.collect(tickets[2])))
    late.start()
    collected[1] = link.collect(tickets[1])
    collected[0] = link.collect(tickets[0])
    late.join()
    link.barrier()
    return {"position": link.position, "collected": collected}


def test_messages_reach_the_right_exchange_whichever_thread_collects() -> None:
    results = run_replicas(_exchanges, 3, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["position"] == rank
        for n in range(3):
            expected = [b"" if peer == rank else f"{peer}:{n}".encode() for peer in range(3)]
            assert result["collected"][n] == expected, f"rank {rank}, exchange {n}: {result['collected'][n]}"


def _peer_leaves() -> tuple[list[bytes], str] | None:
    # The link would wait 600 s for a message, the harness 120 s for the run: a peer that waited for the timeout
    # instead of noticing the departure ends in run_replicas' TimeoutError. No clock in the verdict.
    link = LocalLink.connect(_group(), timeout_s=600)
    assert link is not None
    link.barrier()
    first = link.post(f"{dist.get_rank()}".encode())
    if dist.get_rank() == 2:
        link.collect(first)
        link.collect(first + 1)  # the others' next message: they have sent it and one more
        time.sleep(0.3)
        link.close()  # as a crashed process's sockets close, with a message unread: the peers' sockets reset
        return None
    second = link.post(b"second")
    time.sleep(0.1)
    link.post(b"third")  # arrives while rank 2 sleeps: it leaves with it unread
    time.sleep(0.5)
    link.post(b"to nobody")  # rank 2 is gone: noted, not raised
    completed = link.collect(first)  # rank 2 sent its part before it left
    try:
        link.collect(second)
    except LinkError as error:
        return completed, str(error)
    raise AssertionError("an exchange completed without one of its members")


def test_a_peer_that_leaves_completes_what_it_sent_and_is_reported_at_once() -> None:
    results = run_replicas(_peer_leaves, 3, timeout_s=120)
    for rank, (completed, message) in enumerate(results[:2]):
        assert completed == [b"" if peer == rank else f"{peer}".encode() for peer in range(3)], completed
        assert "rank 2 closed its end" in message, message


def test_messages_sent_before_a_reset_are_still_delivered() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = LocalLink({1: ours}, position=0, ranks=[0, 1], timeout_s=5)
    for ticket in range(2):
        theirs.send(struct.pack("<q", ticket) + f"answer {ticket}".encode())
    link.post(b"left unread")
    theirs.close()  # with our message unread: the kernel reports a reset before their two messages
    assert link.collect(0) == [b"", b"answer 0"]
    assert link.collect(1) == [b"", b"answer 1"]
    with pytest.raises(LinkError, match="rank 1 closed its end"):
        link.collect(2)


def test_a_message_too_large_for_the_link_is_refused_where_it_is_sent() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        link = LocalLink({1: ours}, position=0, ranks=[0, 1], timeout_s=5)
        with pytest.raises(ValueError, match="at most"):
            link.post(bytes(LocalLink.MAX_PAYLOAD + 1))
        link.post(bytes(LocalLink.MAX_PAYLOAD))  # the largest fits whole
        theirs.send(struct.pack("<q", 0) + bytes(LocalLink.MAX_PAYLOAD))
        assert link.collect(0) == [b"", bytes(LocalLink.MAX_PAYLOAD)]


def _one_member_declines() -> bool:
    group = _group()
    if dist.get_rank() == 1:
        os.environ["REPLICATOR_LOCAL_LINK"] = "0"
    return LocalLink.connect(group, timeout_s=30) is None


def test_members_link_all_together_or_none_at_all() -> None:
    assert run_replicas(_one_member_declines, 3, timeout_s=60) == [True, True, True]


def test_connections_from_other_processes_are_closed_unread() -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    name = f"\0replicator-test-{os.getpid()}"  # the child is given it without the leading NUL
    listener.bind(name)
    listener.listen(4)
    # An impostor connects first; it must neither take the member's place nor stall the handshake.
    impostor = subprocess.Popen([sys.executable, "-c", _CONNECT_AND_WAIT, name[1:]], stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline().strip() == "connected"
        assert not _accept(listener, {}, {os.getpid() + 10**6: 1}, within_s=0.5)  # the member never comes
        # ... and _accept gave up while the impostor still held its connection open (it waits 60 s): it did not
        # wait on the impostor's silence. An order of events, not a duration.
        assert impostor.poll() is None
        member = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        member.connect(name)
        peers: dict[int, socket.socket] = {}
        assert _accept(listener, peers, {os.getpid(): 1}, within_s=5)
        assert list(peers) == [1] and _peer_credentials(peers[1]) == (os.getpid(), os.getuid())
        member.close()
    finally:
        impostor.kill()
        listener.close()


_CONNECT_AND_WAIT = """
import socket, sys, time
peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
peer.connect("\\0" + sys.argv[1])
print("connected", flush=True)
time.sleep(60)
"""


def _train_through_shared_memory() -> dict[str, Any]:
    torch.manual_seed(0)
    repl = rp.Replicator(reducer="shm")
    with repl.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    generator = torch.Generator().manual_seed(repl.replica_id)
    batches = [torch.randn(4, 8, generator=generator) for _ in range(4)]

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    losses = [float(loss) for _, loss in repl.run(step_fn, batches, progress=False)]
    linked = [repl.agreement.link is not None, repl.reducer.summation.link is not None]  # type: ignore[attr-defined]
    return {"linked": linked, "losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def test_training_is_the_same_bits_with_and_without_the_link() -> None:
    linked = run_replicas(_train_through_shared_memory, 2, timeout_s=90)
    gloo = run_replicas(_train_through_shared_memory, 2, timeout_s=90, env={"REPLICATOR_LOCAL_LINK": "0"})
    assert [r["linked"] for r in linked] == [[True, True]] * 2
    assert [r["linked"] for r in gloo] == [[False, False]] * 2
    for with_link, without in zip(linked, gloo):
        assert with_link["losses"] == without["losses"]
        assert all(torch.equal(a, b) for a, b in zip(with_link["params"], without["params"]))
