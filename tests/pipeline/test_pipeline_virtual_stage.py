"""Interleaved 1F1B and zero bubble in real processes train exactly like one process on the whole batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import replicator as rp
from replicator.pipeline import PipelineError, build_pipeline
from replicator.testing import run_replicas
from replicator.topology import build_process_groups, discover

from _numerics import small_model_bound

BATCHES = [16, 13, 11]  # 13 and 11 split unevenly into 4 micro-batches
# Pipelines against one process on the same batches cut into micro-batches: len(BATCHES) steps of a small model.
ATOL = small_model_bound(len(BATCHES))
# (schedule, virtual stages, recompute, optimizer)
CONFIGS = [
    ("interleaved", 2, "never", "sgd"),
    ("interleaved", 3, "always", "adam"),
    ("zero_bubble", 1, "except_last", "sgd"),
    ("zero_bubble", 1, "never", "adam"),
    ("zero_bubble", 2, "always", "sgd"),
]


class Fork(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x), x * 0.5  # a tuple travels between chunks


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.linear(inputs[0]) + inputs[1]


def make_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 16), Fork(), Merge(), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]


BALANCE = {1: [3, 4], 2: [1, 2, 2, 2], 3: [1, 1, 1, 1, 2, 1]}  # K = 2 stages x V chunks


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)) for n in BATCHES]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=0.01)


def reference(optimizer_name: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = nn.Sequential(*make_layers())
    optimizer = make_optimizer(optimizer_name, model.parameters())
    losses = []
    for x, y in make_batches():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def two_stage_worker() -> dict[str, Any]:
    groups = build_process_groups(discover(), stages=2)
    stage_id = groups.stage_ranks.index(dist.get_rank())
    results: dict[str, Any] = {}
    for schedule, V, recompute, optimizer_name in CONFIGS:
        pipe = build_pipeline(make_layers(), stage_id=stage_id, num_stages=2, balance=BALANCE[V],
                              stage_ranks=groups.stage_ranks, stage_group=groups.stage, chunks=4,
                              schedule=schedule, recompute=recompute, virtual_stages=V)
        optimizer = make_optimizer(optimizer_name, pipe.parameters())
        losses = []
        for x, y in make_batches():
            optimizer.zero_grad()
            losses.append(pipe.train_step(x, y, F.cross_entropy).item())
            optimizer.step()
        state, expected = reference(optimizer_name)
        results[f"{schedule} V={V} {recompute} {optimizer_name}"] = (
            max(float((v - state[k]).abs().max()) for k, v in pipe.module.state_dict().items()),
            max(abs(a - b) for a, b in zip(losses, expected)),
            sorted(pipe.module.state_dict()),
        )
        events = pipe.gather_timeline()
        results[f"{schedule} V={V} events"] = sorted({(e.stage, e.chunk, e.op) for e in events if e.is_compute})
    # Evaluation through the chunks: the last stage returns the unsplit model's output.
    model = nn.Sequential(*make_layers())
    model.load_state_dict(reference(CONFIGS[-1][3])[0])
    x = make_batches()[0][0]
    output = pipe.eval_step(x)
    results["eval"] = None if output is None else float((output - model(x)).abs().max())
    # A failing loss on the last stage fails the step on every stage; the next step works.
    def bad_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in the loss")
    try:
        pipe.train_step(x, make_batches()[0][1], bad_loss)
        results["failure"] = "no error"
    except PipelineError as error:
        results["failure"] = str(error)
    results["after failure"] = pipe.train_step(x, make_batches()[0][1], F.cross_entropy).item()
    return results


def test_interleaved_and_zero_bubble_train_like_one_process() -> None:
    results = run_replicas(two_stage_worker, 2, timeout_s=240)
    for rank, result in enumerate(results):
        for schedule, V, recompute, optimizer_name in CONFIGS:
            param_diff, loss_diff, keys = result[f"{schedule} V={V} {recompute} {optimizer_name}"]
            assert param_diff < ATOL and loss_diff < ATOL, (rank, schedule, V, recompute, param_diff, loss_diff)
            # Stage s keeps pieces s, s + 2, ...: its layer names are those of the whole model.
            assert keys and all(k.split(".")[0].isdigit() for k in keys)
        chunks = {c for _, c, _ in result["interleaved V=3 events"]}
        assert chunks == {0, 1, 2}
        ops = {op for _, _, op in result["zero_bubble V=1 events"]}
        assert ops == {"forward", "backward_input", "backward_weight"}
        assert "boom in the loss" in result["failure"] and "pipeline step failed" in result["failure"]
        assert result["after failure"] > 0
    assert results[0]["eval"] is None and results[1]["eval"] < ATOL


def replica_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator))
            for _ in range(3)]


def replica_stage(schedule: str, virtual_stages: int) -> tuple[int, dict[str, torch.Tensor], list[float]]:
    repl = rp.Replicator(stages=2, chunks=4, schedule=schedule, virtual_stages=virtual_stages)
    with repl.scope():
        pipe = repl.pipeline(make_layers(), balance=BALANCE[virtual_stages])
        optimizer = repl.wrap_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9))

    def input_fn(ctx: rp.InputContext):
        share = ctx.per_replica_batch_size(16)
        for x, y in replica_batches():
            mine = slice(ctx.replica_id * share, (ctx.replica_id + 1) * share)
            yield x[mine], y[mine]

    def step_fn(ctx: rp.ReplicaContext, data: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss = pipe.train_step(data[0], data[1], F.cross_entropy)
        optimizer.step()
        return ctx.all_mean(loss)

    losses = [float(loss) for _, loss in repl.run(step_fn, repl.prepare_input(input_fn))]
    return repl.stage_id, {k: v.detach().clone() for k, v in pipe.module.state_dict().items()}, losses


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("interleaved", 2), ("zero_bubble", 1)])
def test_two_replicas_by_two_stages_match_one_process(schedule: str, virtual_stages: int) -> None:
    model = nn.Sequential(*make_layers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, y in replica_batches():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        expected.append(float(loss.detach()))
    state = model.state_dict()
    for _, params, losses in run_replicas(replica_stage, 4, schedule, virtual_stages, timeout_s=180):
        assert losses == pytest.approx(expected, abs=ATOL)
        assert max(float((v - state[k]).abs().max()) for k, v in params.items()) < ATOL
