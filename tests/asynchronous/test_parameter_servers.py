"""Parameter servers and sync groups: equal to synchronous training at S = 0, S never exceeded, no races."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.testing import run_replicas

from _events import announce, count, wait_for_count
from _numerics import assert_within, training_bound

STEPS = 4
ROWS = 4  # per worker and step


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(ROWS, 5, generator=generator), torch.randn(ROWS, 2, generator=generator)


def reference(workers: int, optimizer_name: str) -> list[torch.Tensor]:
    """One process training on every worker's batch of each step at once."""
    model = make_model()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    for step in range(STEPS):
        parts = [batch(worker, step) for worker in range(workers)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train(servers: int, group_size: int, max_staleness: int | None, optimizer_name: str) -> dict[str, Any]:
    repl = rp.Replicator(mode="async", parameter_servers=servers, sync_group_size=group_size,
                         max_staleness=max_staleness)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(make_optimizer(optimizer_name, model.parameters()))

    def input_fn(ctx: rp.InputContext) -> list[Any]:
        return [batch(ctx.input_pipeline_id, step) for step in range(STEPS)]

    def step_fn(ctx: rp.ReplicaContext, inputs: Any) -> torch.Tensor:
        x, y = inputs
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    steps = sum(1 for _ in repl.run(step_fn, repl.prepare_input(input_fn), steps=STEPS))
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": steps,
            "run": repl.last_run["asynchronous"]}


@pytest.mark.parametrize(("world", "servers", "group_size", "optimizer_name"),
                         [(3, 1, 2, "sgd"), (4, 2, 1, "adam")], ids=["one-group-sgd", "two-groups-two-servers-adam"])
def test_bulk_synchronous_equals_synchronous_training(world: int, servers: int, group_size: int,
                                                      optimizer_name: str) -> None:
    results = run_replicas(train, world, servers, group_size, 0, optimizer_name)
    expected = reference(world - servers, optimizer_name)
    # The workers' batches of ROWS each, against all of them at once: the sums behind a gradient (2 x ROWS rows,
    # fan-ins of 8) in another order, for STEPS steps.
    tolerance = training_bound(torch.float32, expected, 2 * ROWS + 8 + 4, STEPS)
    for rank, result in enumerate(results):
        for index, (got, want) in enumerate(zip(result["params"], expected, strict=True)):
            assert_within(got, want, tolerance, f"rank {rank} parameter {index}")
    workers, server_runs = results[: world - servers], results[world - servers:]
    for result in workers:
        assert result["steps"] == STEPS and result["run"]["role"] == "worker"
        assert result["run"]["staleness"]["max"] == 0 and result["run"]["updates"] == STEPS
    for result in server_runs:
        # S = 0: each round's group gradients make one update.
        assert result["run"]["versions"] == [STEPS] and result["run"]["staleness"]["exceeded"] == 0


class Linear(torch.nn.Module):
    """loss = <w, c>: its gradient is c whatever w is, so plain SGD must end at w0 - lr * (sum of every c
    pushed), in any order; an update lost to a race, or applied twice, shows in the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64, dtype=torch.float64))
        self.v = torch.nn.Parameter(torch.zeros(16, dtype=torch.float64))


def constant_gradient(worker: int, step: int) -> torch.Tensor:
    return torch.full((80,), float(1 + worker * 100 + step), dtype=torch.float64)


def bounded(max_staleness: int | None, steps: int, workers: int, slow_worker: int, events: str) -> dict[str, Any]:
    """Workers of one replica each; the slow one starts only once the others have run as far ahead as they may.

    Events, not sleeps, make it slow: every other worker says when it pushes a gradient ("push-w-s") and when that
    step is done ("done-w-s"). Unbounded, the slow worker waits until they are all done; under a bound S = 1, until
    3 pushes were made (one update at most fits the bound: then the others must be waiting on the servers), and it
    counts how many steps they had finished by then.
    """
    repl = rp.Replicator(mode="async", parameter_servers=1, max_staleness=max_staleness)
    with repl.scope():
        model = Linear()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    seen: list[int] = []
    others_done: list[int] = []
    fast = workers - 1

    def input_fn(ctx: rp.InputContext) -> list[Any]:
        return [(ctx.input_pipeline_id, step) for step in range(steps)]

    def step_fn(ctx: rp.ReplicaContext, inputs: Any) -> None:
        worker, step = (int(v) for v in inputs)
        if worker == slow_worker and step == 0:
            if max_staleness is None:
                wait_for_count(events, "done-*", fast * steps)
            else:
                wait_for_count(events, "push-*", fast + 1)
            others_done.append(count(events, "done-*"))
        c = constant_gradient(worker, step)
        loss = (torch.cat([model.w, model.v]) * c).sum()
        optimizer.zero_grad()
        loss.backward()
        if worker != slow_worker:
            announce(Path(events) / f"push-{worker}-{step}")
        optimizer.step()
        if worker != slow_worker:
            announce(Path(events) / f"done-{worker}-{step}")
        seen.append(1)

    inputs = repl.prepare_input(input_fn)
    for _ in repl.run(step_fn, inputs, steps=steps):
        pass
    return {"params": torch.cat([model.w, model.v]).detach().clone(), "run": repl.last_run["asynchronous"],
            "steps": len(seen), "per_replica": repl.last_run.get("per_replica"), "others_done": others_done}


@pytest.mark.parametrize("max_staleness", [1, None], ids=["S=1", "unbounded"])
def test_staleness_bound_holds_under_a_slow_worker_and_no_update_is_lost(max_staleness: int | None,
                                                                        tmp_path: Path) -> None:
    steps, workers = 6, 3
    results = run_replicas(bounded, workers + 1, max_staleness, steps, workers, 2, str(tmp_path))
    total = sum(constant_gradient(w, s) for w in range(workers) for s in range(steps))
    expected = -0.5 * total
    server = results[-1]["run"]
    assert server["applied_per_group"] == [steps] * workers  # every gradient applied exactly once
    for rank, result in enumerate(results):
        assert torch.equal(result["params"], results[0]["params"]), f"rank {rank}"
        if max_staleness is None:  # one update per gradient (a bound merges waiting gradients into one)
            # Bit for bit, whatever the order: every gradient is an integer, halved by lr 0.5, and float64 adds
            # multiples of 0.5 below 2**52 exactly.
            assert torch.equal(result["params"], expected), f"rank {rank}"
    # The version check: the server measured each gradient's staleness as it applied it.
    staleness = server["staleness"]
    assert staleness["count"] == steps * workers
    [others_done] = results[2]["others_done"]
    if max_staleness is None:
        # The fast workers ran all their steps ahead of the slow one: its first gradient is that many updates stale.
        assert others_done == 2 * steps and staleness["max"] > 1
    else:
        # Held back: the 2 fast workers finished 1 or 2 steps (one update, of one or both gradients) of their 12
        # while the slow one had not pushed; then its gradient was exactly as stale as the bound allows.
        assert others_done in (1, 2), others_done
        assert staleness["exceeded"] == 0 and staleness["max"] == max_staleness
        for result in results[:workers]:
            assert result["run"]["staleness"]["max"] <= max_staleness and result["run"]["staleness"]["exceeded"] == 0
    slow = results[2]["run"]
    assert slow["updates"] == steps and slow["wait_seconds"] >= 0
    # What the main worker prints at the end: every group's updates, staleness and waits, and every worker's
    # step times, in which the waits on servers count as communication.
    groups, per_worker = results[0]["run"]["groups"], results[0]["per_replica"]
    assert sorted(groups) == list(range(workers)) and len(per_worker) == workers
    for group, figures in groups.items():
        assert figures["ranks"] == [group] and figures["updates"] == steps, figures
        assert figures["staleness"]["count"] == steps and figures["staleness"]["exceeded"] == 0, figures
        assert figures["staleness"]["bound"] == max_staleness and figures["staleness"]["max"] >= 0, figures
        assert figures["wait_seconds"] > 0, figures  # every exchange with a server is a wait, and counted
    assert all("groups" not in result["run"] for result in results[1:])  # the main worker's report only
    communication = [row[3] + row[8] for row in per_worker]  # steady and warm-up steps' communication
    assert all(seconds > 0 for seconds in communication), communication


def least_squares(max_staleness: int | None, steps: int) -> dict[str, Any]:
    repl = rp.Replicator(mode="async", parameter_servers=1, max_staleness=max_staleness)
    with repl.scope():
        model = torch.nn.Linear(4, 1, bias=False, dtype=torch.float64)
        torch.nn.init.zeros_(model.weight)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(256, 4, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1 * torch.randn(
        256, 1, generator=generator, dtype=torch.float64)

    def input_fn(ctx: rp.InputContext) -> Any:
        rows = torch.arange(ctx.input_pipeline_id, 256, ctx.num_input_pipelines)
        return [(x[rows[i % len(rows): i % len(rows) + 16]], y[rows[i % len(rows): i % len(rows) + 16]])
                for i in range(0, 16 * steps, 16)]

    def step_fn(ctx: rp.ReplicaContext, inputs: Any) -> None:
        features, targets = inputs
        loss = torch.nn.functional.mse_loss(model(features), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in repl.run(step_fn, repl.prepare_input(input_fn), steps=steps):
        pass
    optimum = torch.linalg.lstsq(x, y).solution.reshape(1, 4)
    return {"weight": model.weight.detach().clone(), "optimum": optimum}


def test_asynchronous_training_reaches_the_least_squares_optimum() -> None:
    results = run_replicas(least_squares, 3, None, 150)
    # Not rounding (float64) but SGD's noise: mse_loss's Hessian is about 2 I, so each update of lr 0.05 shrinks the
    # distance to the optimum by 0.9 and 300 of them leave nothing of the start (|w*| = 3.7); what stays is the
    # noise floor of the 0.1-noisy targets, sqrt(lr * 0.1**2 / (2 * 16 rows)) = 0.004 per coordinate, plus what a
    # stale gradient adds at this small rate: 0.05 is over ten of those.
    for result in results:
        assert_within(result["weight"], result["optimum"], 0.05, "weight vs the least-squares optimum")
