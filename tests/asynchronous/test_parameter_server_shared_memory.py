"""Parameter servers on a worker's node: payloads through shared memory, header-only frames, the socket path's bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.testing import run_replicas

STEPS = 5
ROWS = 4
OFF = {"REPLICATOR_PS_SHARED_MEMORY": "0"}  # the documented switch: payloads on the socket, as across nodes


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(ROWS, 32, generator=generator), torch.randn(ROWS, 8, generator=generator)


def train(servers: int, group_size: int) -> dict[str, Any]:
    # max_staleness=0: every round sums the same gradients in group order, so both paths compute the same bits.
    repl = rp.Replicator(mode="async", parameter_servers=servers, sync_group_size=group_size, max_staleness=0)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    def step_fn(ctx: rp.ReplicaContext, inputs: Any) -> None:
        x, y = inputs
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    batches = repl.prepare_input(lambda ctx: [batch(ctx.input_pipeline_id, step) for step in range(STEPS)])
    for _ in repl.run(step_fn, batches, steps=STEPS):
        pass
    return {"params": [p.detach().clone() for p in model.parameters()], "run": repl.last_run["asynchronous"],
            "segments": segments_mapped()}


def segments_mapped() -> set[str]:
    """The replicator segments this process maps, as the kernel lists them (a removed name ends in "(deleted)")."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(None, 5)[5] for line in lines if "/replicator-peer-" in line}


@pytest.mark.parametrize(("world", "servers", "group_size"), [(3, 1, 1), (4, 2, 2)],
                         ids=["two-groups-one-server", "one-group-of-two-two-servers"])
def test_a_same_node_update_sends_header_only_frames_and_equals_the_socket_path_bit_for_bit(
        world: int, servers: int, group_size: int) -> None:
    shared = run_replicas(train, world, servers, group_size)
    sockets = run_replicas(train, world, servers, group_size, env=OFF)
    model_bytes = sum(p.numel() * p.element_size() for p in make_model().parameters())
    workers = world - servers
    for rank in range(world):  # every process ends with the same model, bit for bit, whichever way payloads went
        for got, want in zip(shared[rank]["params"], sockets[rank]["params"], strict=True):
            assert torch.equal(got, want), f"rank {rank}"
    leaders = [rank for rank in range(workers) if rank % group_size == 0]
    for rank in leaders:
        on, off = shared[rank]["run"], sockets[rank]["run"]
        assert on["transport"] == off["transport"] == "unix", (on, off)
        assert on["payloads"] == "shared memory" and off["payloads"] == "unix", (on, off)
        exchanges = STEPS + 2  # the first pull, each push, the final exchange
        # Over the socket, every exchange carries the model twice (the gradient out, the parameters back); in
        # shared memory, a frame is its header, a few descriptors and numbers: far less than one model's bytes.
        assert off["link_bytes"] >= 2 * model_bytes * STEPS, off
        assert on["link_bytes"] / exchanges < model_bytes / 10, on
        assert on["link_bytes"] < 512 * exchanges * servers, on  # header, descriptors, rates: tens of bytes each
    # One segment per (group, server) pair, mapped by both; each one's name removed as soon as both had mapped it:
    # nothing of the job is left in /dev/shm, whenever and however it ends.
    for rank, result in enumerate(shared):
        expected = servers if rank in leaders else 0 if rank < workers else workers // group_size
        assert len(result["segments"]) == expected, (rank, result["segments"])
        assert all(name.endswith("(deleted)") for name in result["segments"]), result["segments"]
    assert not any(result["segments"] for result in sockets)
