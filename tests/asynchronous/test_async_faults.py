"""The asynchronous regime's bad input and faults: a dead group leaves the others running; a dead server stops all."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.errors import ReplicatorUsageError
from replicator.testing import ReplicaFailure

from _events import announce, wait_for


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"parameter_servers": 1}, "leaves no worker"),
    ({"parameter_servers": 0}, "parameter_servers >= 1"),
    ({"parameter_servers": 1, "max_staleness": -1}, "negative"),
    ({"parameter_servers": 1, "stages": 2}, "not supported yet"),
], ids=["servers>=world", "no-server", "negative-S", "stages"])
def test_bad_arguments_are_refused_before_any_group_is_built(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ReplicatorUsageError, match=words):
        rp.Replicator(mode="async", **kwargs)


def bad_input(case: str) -> None:
    if case == "groups":
        rp.Replicator(mode="async", parameter_servers=1, sync_group_size=2)  # 3 workers
        return
    repl = rp.Replicator(mode="async", parameter_servers=1)
    with repl.scope():
        model = torch.nn.Linear(2, 1)
        repl.wrap_optimizer(torch.optim.LBFGS(model.parameters()))
    for _ in repl.run(lambda ctx, batch: None, repl.prepare_input(lambda ctx: [0]), steps=1):
        pass


@pytest.mark.parametrize(("case", "world", "words"), [("groups", 4, "do not divide into sync groups"),
                                                      ("lbfgs", 3, "cannot shard torch.optim.LBFGS")])
def test_bad_input_raises_on_every_process(run_failing_fast: Callable[..., Any], case: str, world: int,
                                           words: str) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(bad_input, world, case)
    assert sorted(e.rank for e in failure.value.errors) == list(range(world))
    assert all(words in e.message for e in failure.value.errors), failure.value


def faulty(fault: str, steps: int) -> dict[str, Any]:
    repl = rp.Replicator(mode="async", parameter_servers=1)
    with repl.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    if fault == "server" and repl.regime is not None and repl.regime.serves:
        threading.Timer(1.5, os._exit, (3,)).start()

    def step_fn(ctx: rp.ReplicaContext, x: torch.Tensor) -> None:
        if fault == "worker" and repl.topology.rank == 1 and repl.global_step == 3:
            os._exit(3)
        time.sleep(0.05)
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    inputs = repl.prepare_input(lambda ctx: [torch.ones(2, 4)] * steps)
    for _ in repl.run(step_fn, inputs, steps=steps):
        pass
    return repl.last_run["asynchronous"]


def test_a_dead_worker_leaves_the_servers_and_other_groups_running(run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(faulty, 3, "worker", 12, collective_timeout_s=15)
    assert [e.rank for e in failure.value.errors] == [1]  # only the worker that died
    survivors = failure.value.results
    assert survivors[0]["updates"] == 12
    departed = survivors[2]["departed"]
    assert list(departed) == [1] and departed[1]["how"] == "died" and departed[1]["step"] == 3
    assert survivors[2]["applied_per_group"] == [12, 3]


def test_a_dead_server_stops_every_worker_with_its_name(run_failing_fast: Callable[..., Any]) -> None:
    # Collectives would give up after 600 s, the harness after 90: a worker that waited for its timeout instead of
    # hearing that the server died would end in run_replicas' TimeoutError, not this ReplicaFailure. No clock decides.
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(faulty, 3, "server", 10_000, collective_timeout_s=600)
    errors = {e.rank: e for e in failure.value.errors}
    assert set(errors) == {0, 1, 2}
    for rank in (0, 1):
        assert errors[rank].kind == "ServerError" and "parameter server 0 (rank 2)" in errors[rank].message


HANG_TIMEOUT_S = 5.0  # the replicas' REPLICATOR_TIMEOUT in the hang tests


def hung_group(directory: str) -> dict[str, Any]:
    """Group 1 hangs in step 2 (its heartbeat thread beating on) until the servers have dropped it, then tries to
    go on; group 0 trains until group 1 has had its answer, so the servers are still serving when it wakes.

    Events, not a sleep past the timeout: group 0 hears from the servers' replies which groups they dropped, and
    says so ("dropped"); a loaded machine only makes group 1 hang longer."""
    repl = rp.Replicator(mode="async", parameter_servers=1)
    with repl.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    woke, dropped = Path(directory) / "woke", Path(directory) / "dropped"

    def step_fn(ctx: rp.ReplicaContext, x: torch.Tensor) -> None:
        if repl.topology.rank == 1 and ctx.step == 2:
            wait_for(dropped)
        if repl.topology.rank == 0 and 1 in repl.regime._exchanging().departed:  # what the replies told group 0
            announce(dropped)
        time.sleep(0.05)
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    def batches(ctx: rp.InputContext) -> Any:
        for _ in range(2000):  # group 0: until the hung group has its answer (or a minute and a half)
            if repl.topology.rank == 0 and woke.exists():
                return
            yield torch.ones(2, 4)

    try:
        for _ in repl.run(step_fn, repl.prepare_input(batches)):
            pass
    finally:
        if repl.topology.rank == 1:
            woke.touch()
    return repl.last_run["asynchronous"]


def test_a_hung_group_is_dropped_after_the_timeout_and_told_when_it_wakes(run_failing_fast: Callable[..., Any],
                                                                         tmp_path: Path) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(hung_group, 3, str(tmp_path), collective_timeout_s=HANG_TIMEOUT_S)
    errors = {e.rank: e for e in failure.value.errors}
    assert set(errors) == {1}, failure.value  # the server and the other group finish cleanly
    assert errors[1].kind == "ServerError", errors[1]
    assert "dropped sync group 1 (leader rank 1) as hung, 2 updates into the run" in errors[1].message, errors[1]
    assert "it sent nothing for" in errors[1].message and "(REPLICATOR_TIMEOUT=5)" in errors[1].message, errors[1]
    server, survivor = failure.value.results[2], failure.value.results[0]
    assert server["departed"][1]["how"] == "hung" and server["departed"][1]["step"] == 2
    assert survivor["departed"] == {1: "hung"} and survivor["updates"] > 2


def hung_server(directory: str) -> None:
    """The server stops (SIGSTOP: a process that answers nothing, its sockets open) after the group's step 3."""
    repl = rp.Replicator(mode="async", parameter_servers=1, sync_group_size=2)
    with repl.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    pid_file, stopped = Path(directory) / "server.pid", Path(directory) / "stopped"
    if repl.regime.serves:
        pid_file.write_text(str(os.getpid()))

    def step_fn(ctx: rp.ReplicaContext, x: torch.Tensor) -> None:
        if repl.topology.rank == 0 and ctx.step == 3:
            os.kill(int(pid_file.read_text()), signal.SIGSTOP)
            stopped.write_text(repr(time.monotonic()))
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    try:
        for _ in repl.run(step_fn, repl.prepare_input(lambda ctx: [torch.ones(2, 4)] * 100)):
            pass
    except Exception as error:
        waited = time.monotonic() - float(stopped.read_text())
        raise type(error)(f"{error} [after {waited:.1f} s]") from error
    finally:
        if repl.topology.rank == 0 and pid_file.exists():
            time.sleep(1.0)  # the other worker has its answer too; then end the stopped server
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_hung_server_is_named_on_every_worker_within_the_timeout(run_failing_fast: Callable[..., Any],
                                                                   tmp_path: Path) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(hung_server, 3, str(tmp_path), collective_timeout_s=HANG_TIMEOUT_S)
    errors = {e.rank: e for e in failure.value.errors}
    assert set(errors) == {0, 1, 2}, failure.value  # the server was killed at the end
    for rank in (0, 1):
        assert errors[rank].kind == "ServerError" and "parameter server 0 (rank 2)" in errors[rank].message, \
            errors[rank]
        # How long it took ("[after N s]") is in the message for a reader; the verdict is that it came at all, as a
        # ServerError naming the server, before the harness's hang guard (90 s): a count of seconds would vary
        # with the machine's load.
        assert "[after " in errors[rank].message, errors[rank].message
