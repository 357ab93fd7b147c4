"""PeerLink: tensors round-trip bit for bit, one event loop serves many peers, a dead peer is named at once,
hostile peers are refused or dropped while the others are served, TCP across simulated nodes."""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from replicator.comm import frames
from replicator.comm.frames import FIRST_USER_KIND, HEADER, HELLO, MAGIC, VERSION, FrameError, Limits
from replicator.comm.gloo_peer import GlooPeer, use_sockets
from replicator.comm.peer_link import KEY, Peer, PeerConnection, PeerDied, PeerLinkError, connect, job_token
from replicator.comm.peer_server import PeerServer
from replicator.testing import run_replicas
from replicator.testing.cluster import cluster_available, run_on_cluster

ECHO, DIE, HALT = FIRST_USER_KIND, FIRST_USER_KIND + 1, FIRST_USER_KIND + 2
SAFETY_S = 60.0  # only a safety net against a hang: no verdict below depends on it


def sample_tensors(seed: int) -> list[torch.Tensor]:
    """Tensors of many dtypes and shapes, with values that a lossy path would change (NaN, -0.0, extremes)."""
    generator = torch.Generator().manual_seed(seed)
    floats = torch.randn(3, 4, generator=generator)
    floats[0, 0], floats[0, 1], floats[0, 2] = float("nan"), -0.0, float("inf")
    return [
        floats,
        torch.randn(7, generator=generator, dtype=torch.float64),
        torch.randn(2, 3, 5, generator=generator).to(torch.bfloat16),
        torch.randn(9, generator=generator).to(torch.float16),
        torch.tensor([torch.iinfo(torch.int64).min, -1, 0, torch.iinfo(torch.int64).max]),
        torch.randint(0, 256, (33,), generator=generator, dtype=torch.uint8),
        torch.randint(-(2**15), 2**15, (4, 4), generator=generator, dtype=torch.int16),
        torch.tensor(seed % 2 == 0),  # zero dimensions
        torch.empty(0, 3),  # no elements
        torch.randn(85_000, generator=generator),  # an 85k-parameter model's flat gradient
        torch.randn(2, 2, generator=generator, dtype=torch.complex64),
    ]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes: NaN payloads and the sign of zero included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _join_job() -> None:
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")


def serve_echo(server: PeerServer, until_departed: int, on_frame: Callable[[Any, Any], bool] | None = None
               ) -> tuple[dict[str, int], list[str]]:
    """Echo every frame to its sender until `until_departed` peers have left; frames and departures by peer."""
    served: dict[str, int] = {}
    departures: list[str] = []
    deadline = time.monotonic() + SAFETY_S
    while len(departures) < until_departed:
        assert time.monotonic() < deadline, f"the server saw only {departures} leave"
        try:
            received = server.receive(timeout_s=1.0)
        except PeerLinkError as error:
            departures.append(str(error))
            continue
        if received is None:
            continue
        peer, frame = received
        if on_frame is not None and on_frame(peer, frame):
            continue
        served[str(peer)] = served.get(str(peer), 0) + 1
        server.send(peer, frame.kind, frame.tensors, request=frame.request, flags=frame.flags)
    return served, departures


# -- bit-exact round trips, many clients on one event loop ------------------------------------------------


def _echo_job(rounds: int) -> dict[str, Any]:
    _join_job()
    rank = dist.get_rank()
    if rank == 0:
        server = PeerServer("echo", rank=0, role="server", timeout_s=SAFETY_S)
        dist.barrier()
        joined = server.wait_for(dist.get_world_size() - 1)
        assert sorted(map(str, joined)) == [f"rank {r} (worker)" for r in range(1, dist.get_world_size())]
        served, departures = serve_echo(server, until_departed=dist.get_world_size() - 1)
        server.close()
        return {"served": served, "departures": departures}
    dist.barrier()
    link = connect("echo", rank=rank, role="worker", timeout_s=SAFETY_S)
    exact, requests = [], []
    for round_ in range(rounds):
        sent = sample_tensors(seed=100 * rank + round_)
        link.send(ECHO, sent, request=1000 * rank + round_, flags=rank)
        if round_ % 2:  # into tensors of the caller's own
            into = [torch.empty_like(tensor) for tensor in sent]
            frame = link.receive(into=into)
            exact.append(all(same_bits(a, b) for a, b in zip(sent, into, strict=True))
                         and all(t is i for t, i in zip(frame.tensors, into, strict=True)))
        else:  # into the link's reused buffer
            frame = link.receive()
            exact.append(all(same_bits(a, b) for a, b in zip(sent, frame.tensors, strict=True)))
        requests.append((frame.kind, frame.request, frame.flags))
    # A burst of small frames sent back to back, before any answer is read: several arrive in one
    # read, on both ends, and each must still come out whole and in order.
    burst = [torch.arange(float(n * 37 % 900 + rank)) for n in range(30)]
    for n, tensor in enumerate(burst):
        link.send(ECHO, [tensor], request=n)
    pipelined = []
    for n, tensor in enumerate(burst):
        frame = link.receive()
        pipelined.append(frame.request == n and same_bits(frame.tensors[0], tensor))
    link.close()
    return {"exact": exact + pipelined, "requests": requests, "transport": link.transport,
            "server": str(link.peer)}


def test_tensors_of_many_dtypes_round_trip_bit_exact_through_one_event_loop_serving_many_clients() -> None:
    rounds = 4
    results = run_replicas(_echo_job, 4, rounds, timeout_s=120)
    server = results[0]
    for rank in (1, 2, 3):
        result = results[rank]
        assert result["exact"] == [True] * (rounds + 30), f"rank {rank}: {result['exact']}"
        assert result["requests"] == [(ECHO, 1000 * rank + n, rank) for n in range(rounds)]
        assert result["transport"] == "unix" and result["server"] == "rank 0 (server)"
        assert server["served"][f"rank {rank} (worker)"] == rounds + 30
    assert sorted(server["departures"]) == [f"rank {r} (worker) closed its end of the link (it exited or crashed)"
                                            for r in (1, 2, 3)]


# -- peers that die ---------------------------------------------------------------------------------------


def _store_at(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=SAFETY_S))


def _client_that_dies(port: int, mid_frame: bool) -> None:
    link = connect("solo", rank=5, role="worker", store=_store_at(port), timeout_s=SAFETY_S)
    link.send(ECHO, [torch.arange(4.0)])
    link.receive()
    if mid_frame:  # a header that promises 400 bytes, and 10 of them
        link.sock.sendall(frames.encode(ECHO, [torch.zeros(100)], 0, 0, Limits())[0] + bytes(10))
    os.kill(os.getpid(), signal.SIGKILL)


def _server_that_dies(port: int) -> None:
    server = PeerServer("solo", rank=0, role="server", store=_store_at(port), timeout_s=SAFETY_S)
    while True:
        received = server.receive()
        assert received is not None
        peer, frame = received
        if frame.kind == DIE:
            os.kill(os.getpid(), signal.SIGKILL)  # with the client waiting for its answer
        server.send(peer, frame.kind, frame.tensors)


def _process(target: Callable[..., None], *args: Any) -> multiprocessing.process.BaseProcess:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "replicator"])
    process = context.Process(target=target, args=args, daemon=True)
    process.start()
    return process


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=SAFETY_S))


@pytest.mark.parametrize("mid_frame", [False, True], ids=["between-frames", "mid-frame"])
def test_a_killed_client_is_named_by_the_server_from_its_end_of_file(store: dist.TCPStore, mid_frame: bool) -> None:
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S)
    client = _process(_client_that_dies, store.port, mid_frame)
    served, departures = serve_echo(server, until_departed=1)
    client.join(SAFETY_S)
    server.close()
    assert client.exitcode == -signal.SIGKILL
    assert served == {"rank 5 (worker)": 1}
    where = " in the middle of a frame" if mid_frame else ""
    assert departures == [f"rank 5 (worker) closed its end of the link{where} (it exited or crashed)"]


def test_a_killed_server_is_named_by_its_client_from_its_end_of_file(store: dist.TCPStore) -> None:
    server = _process(_server_that_dies, store.port)
    link = connect("solo", rank=1, role="worker", store=store, timeout_s=SAFETY_S)
    ones = torch.ones(8)
    link.send(ECHO, [ones])
    assert same_bits(link.receive().tensors[0], ones)
    link.send(DIE)
    with pytest.raises(PeerDied, match=r"^rank 0 \(server\) closed its end of the link \(it exited or crashed\)$"):
        link.receive()
    with pytest.raises(PeerDied):  # and so does every later use
        link.send(ECHO, [ones])
    server.join(SAFETY_S)
    assert server.exitcode == -signal.SIGKILL


# -- hostile peers: refused or dropped, with a log line naming them, while another peer is served -----------


def _hostile(port: int, case: str) -> tuple[str, int]:
    store = _store_at(port)
    record = json.loads(store.get(f"{KEY}address/solo"))
    token = job_token(store)
    if case == "another user":
        os.setgid(65534)
        os.setuid(65534)  # nobody: it knows the token, but the kernel says who it is
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + record["unix"])
    # The server may refuse before it reads a byte (kernel credentials at accept): a send that meets the
    # closed connection is the server closing it, whichever comes first under load.
    try:
        if case in ("another user", "a pid not its own"):
            pid = os.getpid() + (1 if case == "a pid not its own" else 0)
            hello = struct.pack(f"<{len(token)}sqqB", token, 9, pid, 7) + b"hostile"
            sock.sendall(HEADER.pack(MAGIC, VERSION, HELLO, 0, 0, len(hello), 0) + hello)
        elif case in ("garbage before the handshake", "wrong token"):
            if case == "wrong token":
                token = bytes(len(token))
            hello = struct.pack(f"<{len(token)}sqqB", token, 9, os.getpid(), 7) + b"hostile"
            message = HEADER.pack(MAGIC, VERSION, HELLO, 0, 0, len(hello), 0) + hello
            sock.sendall(message if case == "wrong token" else os.urandom(200))
        else:
            hello = struct.pack(f"<{len(token)}sqqB", token, 9, os.getpid(), 7) + b"hostile"
            sock.sendall(HEADER.pack(MAGIC, VERSION, HELLO, 0, 0, len(hello), 0) + hello)
            welcome = sock.recv(4096)
            assert welcome[:4] == struct.pack("<I", MAGIC), welcome
            if case == "lengths past the bounds":
                sock.sendall(HEADER.pack(MAGIC, VERSION, ECHO, 0, 0, 10, 1 << 40))
            elif case == "garbage after the handshake":
                sock.sendall(b"\x00" * 8 + os.urandom(100))
            elif case == "descriptors that do not add up":
                extension = struct.pack("<HBBQ", 1, 1, 1, 1_000)  # one float32 of 1000 elements
                sock.sendall(HEADER.pack(MAGIC, VERSION, ECHO, 0, 0, len(extension), 8) + extension)
            elif case == "stops mid-frame":
                sock.sendall(frames.encode(ECHO, [torch.zeros(1000)], 0, 0, Limits())[0] + bytes(100))
    except (BrokenPipeError, ConnectionResetError):
        return "closed by the server", os.getpid()
    sock.settimeout(SAFETY_S)
    try:
        while sock.recv(4096):  # until the server closes this connection
            pass
    except ConnectionResetError:
        pass
    return "closed by the server", os.getpid()


def _honest(port: int, rounds: int) -> None:
    link = connect("solo", rank=1, role="worker", store=_store_at(port), timeout_s=SAFETY_S)
    for round_ in range(rounds):
        sent = sample_tensors(round_)
        link.send(ECHO, sent, request=round_)
        received = link.receive()
        assert received.request == round_ and all(map(same_bits, sent, received.tensors)), f"round {round_}"
    link.send(HALT)
    link.receive()  # the server answers HALT once it has dealt with the hostile peer
    link.close()


HOSTILE = {  # case: what the log line says, and whether the peer had completed its handshake
    "a pid not its own": ("dropped: it broke the link's protocol: it claims pid ", False),
    "wrong token": ("dropped: it broke the link's protocol: it did not present the job's token", False),
    "garbage before the handshake": ("dropped: it broke the link's protocol: not a frame of the peer link", False),
    "lengths past the bounds": ("dropped: it broke the link's protocol: a payload of 1099511627776 bytes, past the "
                                "agreed", True),
    "garbage after the handshake": ("dropped: it broke the link's protocol: not a frame of the peer link", True),
    "descriptors that do not add up": ("dropped: it broke the link's protocol: the descriptors need more than the 8 "
                                       "bytes", True),
    "stops mid-frame": ("dropped: it stopped in the middle of a frame for 2 s", True),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_peer_is_refused_or_dropped_with_its_name_while_another_is_served(
        store: dist.TCPStore, case: str, caplog: pytest.LogCaptureFixture) -> None:
    expected, joined = HOSTILE[case]
    # A short stall timeout for the mid-frame case: the drop must come from it, not from the peer closing.
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=2.0 if case == "stops mid-frame"
                        else SAFETY_S)
    honest = _process(_honest, store.port, 3)
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool:
        hostile = pool.apply_async(_hostile, (store.port, case))
        halted, dropped = None, []
        deadline = time.monotonic() + SAFETY_S
        with caplog.at_level(logging.WARNING, logger="replicator.comm.peer_link"):
            while not (halted and hostile.ready() and any("dropped" in r.message for r in caplog.records)):
                assert time.monotonic() < deadline, f"the hostile peer was not dealt with: {caplog.records}"
                try:
                    received = server.receive(timeout_s=0.5)
                except PeerLinkError as error:
                    dropped.append(str(error))
                    continue
                if received is None:
                    continue
                peer, frame = received
                if frame.kind == HALT:
                    halted = peer  # answered below, once the hostile peer is gone
                else:
                    server.send(peer, frame.kind, frame.tensors, request=frame.request)
            outcome, pid = hostile.get(SAFETY_S)
            assert outcome == "closed by the server"
            server.send(halted, HALT)  # the honest peer was served all along, and still is
        honest.join(SAFETY_S)
    server.close()
    assert honest.exitcode == 0
    lines = [record.message for record in caplog.records if "dropped" in record.message]
    assert len(lines) == 1 and expected in lines[0], lines
    who = "rank 9 (hostile)" if joined else f"a connection from unix (pid {pid})"
    assert lines[0].startswith(f"peer link 'solo': {who} was dropped: it "), lines[0]
    assert [message.startswith("rank 9 (hostile) was dropped: it ") for message in dropped] == (
        [True] if joined else [])


# -- frames: the parser holds every length to the agreed bounds --------------------------------------------


def test_the_frame_parser_checks_every_length_against_the_bounds() -> None:
    limits = Limits(max_payload=1000, max_extension=100, max_tensors=2, max_dims=3)
    good = HEADER.pack(MAGIC, VERSION, ECHO, 0, 0, 12, 16)
    assert frames.parse_header(good, limits).payload == 16
    for raw, why in [
        (HEADER.pack(MAGIC + 1, VERSION, ECHO, 0, 0, 0, 0), "not a frame"),
        (HEADER.pack(MAGIC, VERSION + 1, ECHO, 0, 0, 0, 0), "version"),
        (HEADER.pack(MAGIC, VERSION, ECHO, 0, 0, 101, 0), "extension of 101 bytes"),
        (HEADER.pack(MAGIC, VERSION, ECHO, 0, 0, 0, 1001), "payload of 1001 bytes"),
    ]:
        with pytest.raises(FrameError, match=why):
            frames.parse_header(raw, limits)
    one = struct.pack("<HBBQ", 1, 1, 1, 4)  # one float32 tensor of 4 elements: 16 bytes
    assert frames.parse_specs(one, 16, limits)[0].shape == (4,)
    for raw, payload, why in [
        (one, 15, "need more than"),
        (one, 17, "account for 16 bytes"),
        (one + b"x", 16, "left over"),
        (struct.pack("<H", 3), 0, "3 tensors"),
        (struct.pack("<HBB", 1, 99, 0), 0, "unknown dtype"),
        (struct.pack("<HBB", 1, 1, 4), 0, "4 dimensions"),
        (struct.pack("<HBBQQ", 1, 1, 2, 1 << 61, 1 << 61), 16, "need more than"),  # no overflow to a small product
        (struct.pack("<HBBQ", 1, 1, 1, 1 << 63), 16, "past 2\\*\\*62"),
    ]:
        with pytest.raises(FrameError, match=why):
            frames.parse_specs(raw, payload, limits)


def test_a_frame_past_the_bounds_or_tensors_that_cannot_take_one_are_refused_and_the_link_stays_in_step(
        store: dist.TCPStore) -> None:
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S,
                        limits=Limits(max_payload=1024))
    received: list[Any] = []
    serving = threading.Thread(target=lambda: received.append(server.receive(timeout_s=SAFETY_S)))
    serving.start()  # the handshake is answered inside receive()
    link = connect("solo", rank=1, role="worker", store=store, timeout_s=SAFETY_S)
    assert isinstance(link, PeerConnection) and link.limits.max_payload == 1024  # the server's bounds, agreed
    with pytest.raises(ValueError, match="at most 1024 bytes"):
        link.send(ECHO, [torch.zeros(257)])
    link.send(ECHO, [torch.zeros(256)])  # the largest that fits goes through
    serving.join(SAFETY_S)
    assert received[0] is not None and received[0][1].tensors[0].numel() == 256
    # Tensors that cannot take a frame are refused once it has been read whole: the link stays in step.
    peer = received[0][0]
    server.send(peer, ECHO, [torch.arange(6.0)])
    server.send(peer, ECHO, [torch.arange(6.0)])
    with pytest.raises(ValueError, match=r"at \[0\] to receive rank 0 \(server\)'s frame into are not contiguous"):
        link.receive(into=[torch.empty(6, 2)[:, 0]])
    with pytest.raises(ValueError, match=r"rank 0 \(server\) sent tensors \[\(torch.float32, \(6,\)\)\], the receiver "
                                         r"expected \[\(torch.float32, \(3,\)\)\]"):
        link.receive(into=[torch.empty(3)])
    link.send(ECHO, [torch.ones(2)])
    assert same_bits(server.receive(timeout_s=SAFETY_S)[1].tensors[0], torch.ones(2))  # type: ignore[index]
    link.close()
    server.close()


# -- TCP: across simulated nodes, and on the loopback ------------------------------------------------------


def _cluster_job() -> dict[str, Any]:
    result = _echo_job(rounds=2)
    if dist.get_rank() == 0:
        return result
    return {**result, "node": os.environ.get("SIMULATED_CLUSTER_NODE", "")}


available, reason = cluster_available()


@pytest.mark.skipif(not available, reason=f"simulated cluster unavailable: {reason}")
def test_peers_on_another_node_connect_over_tcp_and_on_the_same_node_over_unix() -> None:
    results = run_on_cluster(_cluster_job, nodes=2, procs_per_node=2, link_mbit=1000.0, timeout_s=180)
    assert [results[rank]["transport"] for rank in (1, 2, 3)] == ["unix", "tcp", "tcp"]
    for rank in (1, 2, 3):
        assert results[rank]["exact"] == [True] * (2 + 30), f"rank {rank}"
    assert len(results[0]["departures"]) == 3


def _tcp_client(port: int) -> bool:
    link = connect("solo", rank=1, role="worker", store=_store_at(port), timeout_s=SAFETY_S, force_tcp=True)
    sent = sample_tensors(7)
    link.send(ECHO, sent)
    exact = all(map(same_bits, sent, link.receive().tensors))
    link.close()
    return exact and link.transport == "tcp" and link.peer.address.startswith("127.0.0.1:")


def test_tcp_on_the_loopback_round_trips_bit_exact(store: dist.TCPStore) -> None:
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S, host="127.0.0.1")
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool:
        client = pool.apply_async(_tcp_client, (store.port,))
        served, _ = serve_echo(server, until_departed=1)
        assert client.get(SAFETY_S) is True
    server.close()
    assert served == {"rank 1 (worker)": 1}


# -- the fallback: the same frames over Gloo, decided by the whole job --------------------------------------


def _fallback_job(refuse_on: int | None) -> dict[str, Any]:
    _join_job()
    rank = dist.get_rank()
    if rank == refuse_on:
        os.environ["REPLICATOR_PEER_LINK"] = "0"
    sockets = use_sockets()
    if sockets:
        return {"sockets": True}
    link = GlooPeer(Peer(1 - rank, "worker" if rank == 0 else "server", -1, "gloo"))
    if rank == 0:
        frame = link.receive()
        link.send(frame.kind, frame.tensors, request=frame.request, flags=frame.flags)
        return {"sockets": False}
    sent = sample_tensors(3)
    link.send(ECHO, sent, request=42, flags=7)
    into = [torch.empty_like(tensor) for tensor in sent]
    frame = link.receive(into=into)
    return {"sockets": False, "exact": all(map(same_bits, sent, into)), "header": (frame.kind, frame.request,
                                                                                     frame.flags)}


def test_one_process_without_the_peer_link_moves_every_pair_to_the_same_frames_over_gloo() -> None:
    results = run_replicas(_fallback_job, 2, 1, timeout_s=120)
    assert [result["sockets"] for result in results] == [False, False]
    assert results[1]["exact"] is True and results[1]["header"] == (ECHO, 42, 7)
    assert run_replicas(_fallback_job, 2, None, timeout_s=120) == [{"sockets": True}] * 2


def test_a_server_that_hangs_is_named_after_replicator_timeout(store: dist.TCPStore,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S)
    received: list[Any] = []
    serving = threading.Thread(target=lambda: received.append(server.receive(timeout_s=SAFETY_S)))
    serving.start()  # takes the frame and never answers: alive (its socket open) but hung
    monkeypatch.setenv("REPLICATOR_TIMEOUT", "1")
    link = connect("solo", rank=1, role="worker", store=store)
    link.send(ECHO, [torch.ones(3)])
    with pytest.raises(PeerLinkError, match=r"^rank 0 \(server\) sent nothing for 1 s \(REPLICATOR_TIMEOUT\)"):
        link.receive()
    serving.join(SAFETY_S)
    assert received[0] is not None
    server.close()


def test_waiting_for_peers_that_do_not_come_names_those_that_did(store: dist.TCPStore) -> None:
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S)
    with pytest.raises(PeerLinkError, match=r"^0 of 2 peers joined 'solo' within 0.2 s: none$"):
        server.wait_for(2, timeout_s=0.2)
    server.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
def test_a_peer_of_another_user_is_refused_by_its_kernel_credentials(store: dist.TCPStore,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S)
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool, caplog.at_level(logging.WARNING, logger="replicator.comm.peer_link"):
        hostile = pool.apply_async(_hostile, (store.port, "another user"))
        deadline = time.monotonic() + SAFETY_S
        while not hostile.ready():
            assert time.monotonic() < deadline
            assert server.receive(timeout_s=0.5) is None  # nothing from it ever reaches the caller
        outcome, pid = hostile.get()
    server.close()
    assert outcome == "closed by the server"
    assert [record.message for record in caplog.records] == [
        f"peer link 'solo': refused a connection from pid {pid}: it runs as uid 65534, the job as {os.getuid()}"]


def _placed_client(port: int) -> bool:
    link = connect("solo", rank=1, role="worker", store=_store_at(port), timeout_s=SAFETY_S)
    link.send(ECHO, [torch.arange(5.0)])
    link.send(ECHO, [torch.arange(3)])  # int64 where the server placed float32: read, logged, dropped
    link.send(HALT)
    answer = link.receive()
    link.close()
    return answer.kind == HALT


def test_a_server_places_frames_in_its_own_tensors_and_drops_one_that_does_not_fit(
        store: dist.TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    target = torch.full((5,), -1.0)
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S,
                        place=lambda peer, kind, specs: [target] if kind == ECHO else None)
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool, caplog.at_level(logging.WARNING, logger="replicator.comm.peer_link"):
        client = pool.apply_async(_placed_client, (store.port,))
        received = server.receive(timeout_s=SAFETY_S)
        assert received is not None
        peer, frame = received
        assert frame.tensors[0] is target and same_bits(target, torch.arange(5.0))
        received = server.receive(timeout_s=SAFETY_S)  # the misfit is skipped: the stream is still in step
        assert received is not None and received[1].kind == HALT
        server.send(peer, HALT)
        assert client.get(SAFETY_S) is True
    server.close()
    assert [record.message for record in caplog.records] == [
        "peer link 'solo': rank 1 (worker) sent tensors [(torch.int64, (3,))], the receiver expected "
        "[(torch.float32, (5,))]; the frame was read and dropped"]


def _fixed_buffers_client(port: int) -> list[bool]:
    link = connect("solo", rank=1, role="worker", store=_store_at(port), timeout_s=SAFETY_S)
    into = (torch.empty(5), torch.empty(2, dtype=torch.int64))  # a tuple: checked and viewed once, then reused
    checks = []
    for round_ in range(4):
        if round_ == 3:
            link.send(ECHO, [torch.arange(3)])  # int64 where the server placed float32: read, logged, dropped
        sent = [torch.arange(5.0) + 10 * round_, torch.tensor([round_, -round_])]
        link.send(ECHO, sent)
        frame = link.receive(into=into)  # the server's reply: the same buffers each time, new values each time
        checks.append(all(same_bits(a, b) and t is b for a, b, t in zip(sent, into, frame.tensors, strict=True)))
    link.send(HALT)
    try:  # a reply of another shape does not land in the tuple; the link stays in step
        link.receive(into=into)
        checks.append(False)
    except ValueError as error:
        checks.append("expected [(torch.float32, (5,)), (torch.int64, (2,))]" in str(error))
    link.receive(into=into)
    checks.append(same_bits(into[0], torch.arange(5.0) + 30) and link.receive().kind == HALT)
    link.close()
    return checks


def test_buffers_sent_and_received_frame_after_frame_are_checked_once_and_carry_each_frames_values(
        store: dist.TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    """A tuple placed or received into and an Outgoing are described, checked and viewed once: what lands and
    what goes out is still each frame's own values, and a frame that does not fit is still refused."""
    landing = (torch.full((5,), -1.0), torch.zeros(2, dtype=torch.int64))
    reply = frames.Outgoing(landing)  # the server answers from the very buffers the requests land in
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S,
                        place=lambda peer, kind, specs: landing if kind == ECHO else None)
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool, caplog.at_level(logging.WARNING, logger="replicator.comm.peer_link"):
        client = pool.apply_async(_fixed_buffers_client, (store.port,))
        for _ in range(4):
            received = server.receive(timeout_s=SAFETY_S)
            assert received is not None
            peer, frame = received
            assert frame.kind == ECHO and all(t is b for t, b in zip(frame.tensors, landing, strict=True))
            server.send(peer, ECHO, reply)
        received = server.receive(timeout_s=SAFETY_S)
        assert received is not None and received[1].kind == HALT
        server.send(peer, ECHO, [torch.arange(4.0)])
        server.send(peer, ECHO, reply)
        server.send(peer, HALT)
        assert client.get(SAFETY_S) == [True] * 6
    server.close()
    assert [record.message for record in caplog.records] == [
        "peer link 'solo': rank 1 (worker) sent tensors [(torch.int64, (3,))], the receiver expected "
        "[(torch.float32, (5,)), (torch.int64, (2,))]; the frame was read and dropped"]


def test_connecting_to_a_name_nobody_published_says_so(store: dist.TCPStore) -> None:
    with pytest.raises(PeerLinkError, match=r"^no server was published as 'nobody' within 0.2 s"):
        connect("nobody", rank=1, role="worker", store=store, timeout_s=0.2)


def _big_client(port: int, force_tcp: bool) -> list[bool]:
    link = connect("solo", rank=1, role="worker", store=_store_at(port), timeout_s=SAFETY_S, force_tcp=force_tcp)
    # Three times the kernel's socket buffers: the sender's sendmsg takes it in parts, the receiver's
    # recv_into lands it in parts, both ways.
    big = torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))
    small = torch.arange(7)
    link.send(ECHO, [small, big, small])
    into = [torch.empty_like(small), torch.empty_like(big), torch.empty_like(small)]
    link.receive(into=into)
    exact = [same_bits(big, into[1]), same_bits(small, into[0]) and same_bits(small, into[2])]
    link.close()
    return [*exact, link.transport == ("tcp" if force_tcp else "unix")]


@pytest.mark.parametrize("force_tcp", [False, True], ids=["unix", "tcp"])
def test_a_frame_larger_than_the_socket_buffers_goes_in_parts_and_arrives_whole(store: dist.TCPStore,
                                                                                force_tcp: bool) -> None:
    server = PeerServer("solo", rank=0, role="server", store=store, timeout_s=SAFETY_S, host="127.0.0.1")
    context = multiprocessing.get_context("forkserver")
    with context.Pool(1) as pool:
        client = pool.apply_async(_big_client, (store.port, force_tcp))
        served, _ = serve_echo(server, until_departed=1)
        assert client.get(SAFETY_S) == [True, True, True]
    server.close()
    assert served == {"rank 1 (worker)": 1}
