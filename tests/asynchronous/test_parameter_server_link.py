"""Parameter servers on the peer link: over sockets and over Gloo, replies landing in place, deaths by end of file."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

from _numerics import assert_within, training_bound

STEPS = 4
ROWS = 4  # per worker and step
# How each carrier is chosen: the job's default (sockets), and a job that cannot use them.
TRANSPORTS = {"sockets": {}, "gloo": {"REPLICATOR_PEER_LINK": "0"}}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(ROWS, 5, generator=generator), torch.randn(ROWS, 2, generator=generator)


def reference(workers: int) -> list[torch.Tensor]:
    """One process training on every worker's batch of each step at once."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        parts = [batch(worker, step) for worker in range(workers)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def train(servers: int, group_size: int) -> dict[str, Any]:
    repl = rp.Replicator(mode="async", parameter_servers=servers, sync_group_size=group_size, max_staleness=0)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    buffers = []

    def step_fn(ctx: rp.ReplicaContext, inputs: Any) -> None:
        buffers.append(storages(model))  # where the parameters are, as each step starts
        x, y = inputs
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    batches = repl.prepare_input(lambda ctx: [batch(ctx.input_pipeline_id, step) for step in range(STEPS)])
    for _ in repl.run(step_fn, batches, steps=STEPS):
        pass
    buffers.append(storages(model))
    return {"params": [p.detach().clone() for p in model.parameters()], "buffers": buffers,
            "run": repl.last_run["asynchronous"]}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize(("world", "servers", "group_size"), [(3, 1, 2), (4, 2, 1)],
                         ids=["one-group-of-two", "two-groups-two-servers"])
def test_bulk_synchronous_training_over_each_transport_equals_synchronous_training(
        transport: str, world: int, servers: int, group_size: int) -> None:
    results = run_replicas(train, world, servers, group_size, env=TRANSPORTS[transport])
    expected = reference(world - servers)
    tolerance = training_bound(torch.float32, expected, 2 * ROWS + 8 + 4, STEPS)  # as test_parameter_servers
    for rank, result in enumerate(results):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert_within(got, want, tolerance, f"rank {rank} parameter {index}")
    for result in results[: world - servers]:
        # Which carrier the job chose, and that the whole job chose it.
        assert result["run"]["transport"] == ("gloo" if transport == "gloo" else "unix"), result["run"]
        # The parameters of a server's shard are views of one persistent buffer (one dtype here), which every
        # reply lands in: as many storages as servers, the same ones from the first step to the end.
        assert len(result["buffers"][0]) == servers and all(seen == result["buffers"][0] for seen in result["buffers"])
        assert len(result["buffers"]) == STEPS + 1


def killed_server(directory: str, group_size: int) -> None:
    """A worker kills the server (SIGKILL) at its step 3, then every worker goes on: its next exchange must name the
    server, told by the link's end of file (the replicas' timeout is 10 minutes: no clock can explain the error)."""
    repl = rp.Replicator(mode="async", parameter_servers=1, sync_group_size=group_size)
    with repl.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    pid_file, killed = Path(directory) / "server.pid", Path(directory) / "killed"
    if repl.regime.serves:
        pid_file.write_text(str(os.getpid()))

    def step_fn(ctx: rp.ReplicaContext, x: torch.Tensor) -> None:
        if repl.topology.rank == 0 and ctx.step == 3:
            killed.write_text(repr(time.monotonic()))  # first: the other worker may hear of the kill at once
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    try:
        for _ in repl.run(step_fn, repl.prepare_input(lambda ctx: [torch.ones(2, 4)] * 100)):
            pass
    except Exception as error:
        # For a reader: how long after the kill this process heard of it ("within 2 s" is the aim; a loaded
        # machine can stretch it, so it is not the test's verdict).
        raise type(error)(f"{error} [after {time.monotonic() - float(killed.read_text()):.2f} s]") from error


@pytest.mark.parametrize("group_size", [1, 2], ids=["groups-of-one", "one-group-of-two"])
def test_a_killed_server_is_named_on_every_worker_from_its_end_of_file(run_failing_fast: Any, tmp_path: Path,
                                                                       group_size: int) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(killed_server, 3, str(tmp_path), group_size, collective_timeout_s=600)
    errors = {e.rank: e for e in failure.value.errors}
    assert set(errors) == {0, 1, 2}, failure.value  # the server, killed, exits with its signal
    for rank in (0, 1):
        message = errors[rank].message
        assert errors[rank].kind == "ServerError" and "parameter server 0 (rank 2)" in message, errors[rank]
        # Its end of file, not a timeout: a member hears the leader's reason too.
        assert "closed its end of the link" in message and "[after " in message, message
