"""LocalLink: messages in order from any thread, a departed peer reported at once, links made by all or none."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import replicator as rp
from replicator.local_link import LinkError, LocalLink, _is_process
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


def _peer_leaves() -> tuple[str, float] | None:
    link = LocalLink.connect(_group(), timeout_s=30)
    assert link is not None
    link.barrier()
    if dist.get_rank() == 2:
        link.close()  # as a crashed process's sockets close
        return None
    started = time.monotonic()
    try:
        link.barrier()
    except LinkError as error:
        return str(error), time.monotonic() - started
    raise AssertionError("a barrier completed without one of its members")


def test_a_peer_that_leaves_is_reported_at_once_not_after_the_timeout() -> None:
    results = run_replicas(_peer_leaves, 3, timeout_s=60)
    for message, seconds in results[:2]:
        assert "rank 2 closed its end" in message, message
        assert seconds < 10, f"reported after {seconds:.1f} s, as if it had waited for the 30 s timeout"


def _one_member_declines() -> bool:
    group = _group()
    if dist.get_rank() == 1:
        os.environ["REPLICATOR_LOCAL_LINK"] = "0"
    return LocalLink.connect(group, timeout_s=30) is None


def test_members_link_all_together_or_none_at_all() -> None:
    assert run_replicas(_one_member_declines, 3, timeout_s=60) == [True, True, True]


def test_a_connection_from_another_process_is_refused() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        assert _is_process(ours, os.getpid())
        assert not _is_process(ours, os.getpid() + 1)


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
