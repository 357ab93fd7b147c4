"""Asynchronous training: an update's round trip, a straggler, updates/s against the peers' parameter-server
patterns, DiLoCo's traffic.

Command (from the repository root; figures go to benchmarks/results/asynchronous.json; about
50 jobs of 2 to 4 processes, each starting afresh: 15 to 40 minutes on 2 cores, as loaded):

    .venv/bin/python benchmarks/asynchronous.py                 # every part
    .venv/bin/python benchmarks/asynchronous.py --part peers    # one part: transport, straggler, peers or diloco
    .venv/bin/python benchmarks/asynchronous.py --quick         # a smoke run of every part (3 to 6 minutes)

The peers and DiLoCo parts train an MLP (64-256-256-10, 85k parameters) on scikit-learn's digits
(a fixed stratified split: 1,347 training and 450 test images, standardized on the training
set), batch 32 per worker, 1 torch thread per process, every job in real processes joined by
Gloo on 127.0.0.1:

- *Transport.* 1 server + 1 worker of mode="async" with one parameter of 4 KB or of 85k floats
  and next to no compute: the worker's median `optimizer.step()` (push, the server's SGD step,
  the reply landing in place) and the CPU of both processes per update (from /proc, over the
  timed updates only), against a local SGD step and against the echoes of
  `benchmarks/peer_link.py` (the peer link over Unix and TCP, one Gloo message each way, a
  `torch.distributed.rpc` `rpc_sync` echo) in turns with it.
- *Straggler.* {sync (3 replicas), async S = 4, async unbounded (1 server + 3 workers)} x {with a
  straggler, without}, on a wider MLP (64-1024-1024-10, 1.1M parameters, 6.4 ms of CPU per step,
  SGD lr 0.0015) so that sync's time to target spans over 10 s of training, not start-up: the last worker
  sleeps after each step twice as long as the step took, so its steps take 3x as long. Each
  worker trains the same number of steps on its own shard, so every arm sees the same data.
  Rank 0 (a fast worker) copies the parameters at most every `--snapshot-s` seconds and
  evaluates the copies after the run: evaluation costs no arm any time. Figures: time to 95 %
  test accuracy (with the ideal ratio to sync: every batch counting the same), final accuracy,
  the fast workers' updates/s.
- *Peers.* Parameter updates/s with 2 workers and no straggler: replicator's mode="async"
  (1 server, 2 workers) against the PyTorch-RPC parameter-server pattern, the Ray
  parameter-server pattern (skipped where ray cannot be imported), both written here
  (`_peer_servers.py`), and a ceiling (the same 2 workers with local optimizers, no server);
  CPU ms per update summed over every process of an arm, and the share of a worker's time
  blocked on its server, over its steady steps (the window updates/s is read in) and over its
  whole run().
- *DiLoCo.* 2 groups of 1 replica, H in {1, 8, 32}, against mode="sync" with the same steps and
  batches: test accuracy after a fixed number of inner steps, and the bytes per step each process
  hands to reductions (`repl.last_run`).

Arms run as separate jobs in turns (the order rotates every repetition); figures are medians
with min and max over repetitions, ratios paired within a repetition (benchmarks/_harness.py).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _digits import Batch, accuracy, digits, make_model, make_optimizer, shard_batches
from _harness import (
    Spread,
    add_json_argument,
    in_turns,
    load_average,
    machine,
    machine_line,
    paired_ratio,
    write_json,
)
from _peer_servers import RayEchoes, process_stat, ray_missing, ray_rates, rpc_rate_job
from peer_link import SIZES
from peer_link import _measure as link_round_trips

import replicator as rp
from replicator.launch import heap_kept_environment
from replicator.testing import run_replicas
from replicator.testing.processes import free_port

PARTS = ("transport", "straggler", "peers", "diloco")


@dataclass(frozen=True)
class Config:
    hidden: int = 256
    batch: int = 32  # per worker (replica) and step
    lr: float = 0.02  # SGD with momentum 0.9, applied alike by servers, replicas and the peers' servers
    seed: int = 0
    # straggler: a wider MLP, so that a step takes >= 5 ms of CPU and time to target measures training, not start-up
    straggler_hidden: int = 1024  # 1.1M parameters: 6.4 ms of CPU per step of batch 32 on one core
    straggler_lr: float = 0.0015  # at 0.002 sync with the straggler reached 95 % in 8.2-9.2 s: short of 10 s
    straggler_repeats: int = 3
    straggler_steps: int = 800  # per worker: 3 workers x 800 x 32 = 57 passes over the training set
    slow_factor: float = 3.0
    target: float = 0.95
    max_staleness: int = 4
    snapshot_s: float = 0.05
    straggler_all_arms: bool = True
    # transport
    transport_repeats: int = 3
    transport_updates: int = 2000  # per size and repetition, after 20 of warm-up: 0.5 s outvotes a stall of the host
    # peers
    peer_repeats: int = 5
    peer_warmup: int = 20
    peer_steps: int = 300  # timed updates per worker
    # diloco
    diloco_seeds: tuple[int, ...] = (0, 1, 2)
    diloco_steps: int = 256  # inner steps per replica (a multiple of every H)
    outer_every: tuple[int, ...] = (1, 8, 32)
    inner_lr: float = 1e-3  # Adam, the paper's inner optimizer family


QUICK = Config(transport_repeats=1, transport_updates=100, straggler_repeats=1, straggler_steps=600,
               straggler_all_arms=False, peer_repeats=1, peer_warmup=10, peer_steps=60, diloco_seeds=(0,),
               diloco_steps=64, outer_every=(32,))


# -- transport -----------------------------------------------------------------------------------

WARMUP_UPDATES = 20
RAY_ECHO = "ray actor echo"


class _Vector(torch.nn.Module):
    """One parameter of `numel` float32s: an update moves exactly the bytes of the round trips it is compared with."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel))


def cpu_seconds(pids: Sequence[int]) -> float:
    """User and system CPU of every thread of these processes so far (/proc: they run on this machine)."""
    return sum(process_stat(pid)[1] for pid in pids)


def update_job(numel: int, updates: int, mode: rp.ParameterServers | None = None) -> dict[str, Any]:
    """1 server and 1 worker (`mode`), or one process with a local optimizer (None), and next to no compute: the
    update as the worker sees it (optimizer.step(): the push, the server's SGD step, the reply landing in place;
    alone, the SGD step), and the CPU every process spends over the timed updates (read by the worker from /proc,
    warm-up, start-up and finish left out).

    The one-process run is the same run() with the same record: what the exchange adds is the difference.
    The worker also runs the steps in a plain torch loop first: the CPU of the update's arithmetic alone."""
    torch.set_num_threads(1)
    repl = rp.Replicator(mode=mode or "sync")
    with repl.scope():
        model = _Vector(numel)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    direction = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    local_cpu = None
    if mode is not None and not repl.regime.serves:
        alone = _Vector(numel)
        local = torch.optim.SGD(alone.parameters(), lr=1e-3, momentum=0.9)
        local_cpu = time.process_time()
        for _ in range(updates):
            local.zero_grad()
            (alone.w * direction).sum().backward()
            local.step()
        local_cpu = (time.process_time() - local_cpu) / updates
    trips: list[float] = []
    window: list[float] = []
    total = WARMUP_UPDATES + updates

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        if ctx.step == WARMUP_UPDATES:
            window.append(cpu_seconds([int(pid) for pid in pids]))
        optimizer.zero_grad()
        (model.w * direction).sum().backward()
        started = time.perf_counter()
        optimizer.step()
        trips.append(time.perf_counter() - started)
        if ctx.step == total - 1:
            window.append(cpu_seconds([int(pid) for pid in pids]))

    for _ in repl.run(step_fn, repl.prepare_input(lambda ctx: [0] * total), steps=total, progress=False):
        pass
    figures = repl.last_run.get("asynchronous", {})
    repl.close()
    return {"round_trip_s": statistics.median(trips[WARMUP_UPDATES:]) if trips else None,
            "cpu_s": window[1] - window[0] if len(window) == 2 else None, "updates": updates,
            "local_cpu_s": local_cpu, "transport": figures.get("transport"), "payloads": figures.get("payloads")}


def run_transport(config: Config) -> tuple[dict[str, Any], list[str], bool]:
    """Update round trips through mode="async" against the raw round trips of benchmarks/peer_link.py."""
    rows: dict[str, dict[str, list[float]]] = {size: {} for size in SIZES}
    transports: set[str] = set()
    _transport_repetitions(config, rows, transports)
    return _transport_table(config, rows, transports)


def _transport_repetitions(config: Config, rows: dict[str, dict[str, list[float]]], transports: set[str]) -> None:
    """Each repetition: mode='async' updates, then the raw echoes, then (with Ray) Ray's echo, of every size."""
    for repetition in range(config.transport_repeats):
        for size, numel in SIZES.items():
            worker, _ = run_replicas(update_job, 2, numel, config.transport_updates, rp.ParameterServers(servers=1),
                                     timeout_s=300)
            (alone,) = run_replicas(update_job, 1, numel, config.transport_updates, timeout_s=300)
            transports.add(f"{worker['transport']} (payloads: {worker['payloads']})")
            row = rows[size]
            row.setdefault("update", []).append(worker["round_trip_s"])
            row.setdefault("update_cpu", []).append(worker["cpu_s"] / worker["updates"])
            row.setdefault("alone_cpu", []).append(alone["cpu_s"] / alone["updates"])
            row.setdefault("local_cpu", []).append(worker["local_cpu_s"])
        raw = run_replicas(link_round_trips, 2, free_port(), 1, max(50, config.transport_updates // 4),
                           timeout_s=600)[1]  # one kept phase of every arm (the first warms up)
        for size in SIZES:
            for arm, values in raw["walls"][size].items():
                rows[size].setdefault(arm, []).extend(values)
                rows[size].setdefault(f"{arm} cpu", []).extend(raw["cpus"][size][arm])
        if not ray_missing():
            # Started and stopped around its own arm: Ray's idle daemons take CPU the other arms would lose.
            ray_echoes = RayEchoes()
            try:
                for size, numel in SIZES.items():
                    wall, cpu = ray_echoes.round_trips(numel, max(50, config.transport_updates // 4))
                    rows[size].setdefault(RAY_ECHO, []).append(wall)
                    rows[size].setdefault(f"{RAY_ECHO} cpu", []).append(cpu)
            finally:
                ray_echoes.close()
        print(f"  transport, repetition {repetition + 1}: " + ", ".join(
            f"{size}: update {1e6 * rows[size]['update'][-1]:.0f} µs, "
            f"rpc_sync {1e6 * rows[size]['rpc_sync echo'][-1]:.0f} µs" for size in SIZES), flush=True)


def _transport_table(config: Config, rows: dict[str, dict[str, list[float]]], transports: set[str]
                     ) -> tuple[dict[str, Any], list[str], bool]:
    lines = [f"\nTransport: round trips on one node, 2 processes, {config.transport_repeats} repetition(s); "
             f"carrier of mode='async': {', '.join(sorted(transports))}", "",
             "| size | contender | round trip µs (median) | vs rpc_sync echo (paired) | CPU µs, both processes |",
             "| --- | --- | ---: | ---: | ---: |"]
    healthy = True
    for size in SIZES:
        row = rows[size]
        rpc = row["rpc_sync echo"]
        for arm, label in (("update", "mode='async' update (push, SGD step, reply in place)"),
                           ("peer link (unix)", "peer link (unix), echo"), ("peer link (tcp)", "peer link (tcp), echo"),
                           ("gloo send/recv", "one Gloo message each way"), ("rpc_sync echo", "rpc_sync echo"),
                           (RAY_ECHO, "Ray actor echo (NumPy array; CPU of every Ray process)")):
            if arm not in row:
                continue
            cpu = row["update_cpu"] if arm == "update" else row[f"{arm} cpu"]
            lines.append(f"| {size} | {label} | {_spread([1e6 * v for v in row[arm]], '{:.0f}')} "
                         f"| {_ratio(_paired_optional(row[arm], rpc))} | {_spread([1e6 * v for v in cpu], '{:.0f}')} |")
        for baseline, label in (("alone_cpu", "the same run() in one process with a local optimizer"),
                                ("local_cpu", "a plain torch loop's step (no run(), no record)")):
            over = [a - b for a, b in zip(row["update_cpu"], row[baseline], strict=True)]
            lines.append(f"| {size} | CPU an update costs beyond {label}, both processes | | "
                         f"| {_spread([1e6 * v for v in over], '{:.0f}')} |")
        healthy &= all(v is not None for v in row["update"])
    lines.append("  the old chain (a ticket in the store, the server polling it, 6 Gloo messages) is gone; issue 30 "
                 "measured it at 4.6-6.8 ms and 3.3 ms of server CPU per 85k-parameter update")
    lines.append("  update CPU: the worker's and the server's (every thread, /proc, 10 ms ticks) over the timed "
                 "updates, per update, record included; the one-process run() is measured the same way, so what is "
                 "left is the exchange; the echoes': time.process_time() of both processes (benchmarks/peer_link.py)")
    if ray_missing():
        lines.append("  ray's actor echo: not measured (ray cannot be imported here)")
    return {"rows": rows, "transports": sorted(transports)}, lines, healthy


# -- straggler -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    mode: str  # "sync" or "async"
    max_staleness: int | None
    straggler: bool

    @property
    def name(self) -> str:
        regime = "sync" if self.mode == "sync" else (
            "async unbounded" if self.max_staleness is None else f"async S={self.max_staleness}")
        return f"{regime}, {'straggler' if self.straggler else 'no straggler'}"

    @property
    def processes(self) -> int:
        return 3 if self.mode == "sync" else 4  # 3 workers, and 1 server in async mode


def straggler_arms(config: Config) -> list[Arm]:
    """Every regime with and without the straggler; `--quick`: only the arms the targets need."""
    if config.straggler_all_arms:
        regimes = [("sync", None), ("async", config.max_staleness), ("async", None)]
        return [Arm(mode, bound, straggler) for mode, bound in regimes for straggler in (True, False)]
    bounded = config.max_staleness
    return [Arm("sync", None, True), Arm("async", bounded, True), Arm("async", bounded, False)]


def _replicator(arm: Arm) -> rp.Replicator:
    if arm.mode == "sync":
        return rp.Replicator()
    return rp.Replicator(mode=rp.ParameterServers(servers=1, max_staleness=arm.max_staleness))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def straggler_job(config: Config, arm: Arm) -> dict[str, Any]:
    """One process of one arm: a worker (or replica) trains and stamps its steps; rank 0 snapshots; a server serves."""
    torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = digits()
    repl = _replicator(arm)
    with repl.scope():
        model = make_model(config.straggler_hidden, config.seed)
        optimizer = repl.wrap_optimizer(make_optimizer(model.parameters(), config.straggler_lr))
    me: dict[str, Any] = {"pipeline": None, "slow": False}

    def input_fn(ctx: rp.InputContext) -> list[Batch]:
        me["pipeline"] = ctx.input_pipeline_id
        me["slow"] = arm.straggler and ctx.input_pipeline_id == ctx.num_input_pipelines - 1
        return shard_batches(train_x, train_y, config.batch, ctx.input_pipeline_id, ctx.num_input_pipelines,
                             config.straggler_steps, config.seed)

    def step_fn(ctx: rp.ReplicaContext, batch: Batch) -> torch.Tensor:
        started = time.perf_counter()
        inputs, labels = batch
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if me["slow"]:  # the injected straggler: every step takes slow_factor times as long as its work
            time.sleep((config.slow_factor - 1.0) * (time.perf_counter() - started))
        return loss.detach()

    inputs = repl.prepare_input(input_fn)
    dist.barrier()  # every process, servers included, starts run() together: rank 0's clock is the job's
    snapshot = dist.get_rank() == 0
    snapshots: list[tuple[float, torch.Tensor]] = []
    stamps: list[float] = []
    begun = last = time.monotonic()
    for _ in repl.run(step_fn, inputs, steps=config.straggler_steps, progress=False):
        now = time.monotonic()
        stamps.append(now)
        if snapshot and now - last >= config.snapshot_s:
            snapshots.append((now - begun, _flat(model).clone()))  # a copy: evaluated after the run
            last = now
    ended = time.monotonic() - begun
    final = _flat(model)
    result: dict[str, Any] = {"rank": dist.get_rank(), "pipeline": me["pipeline"], "slow": me["slow"],
                              "stamps": stamps, "seconds": ended, "final_sum": float(final.double().sum()),
                              "last_run": repl.last_run.get("asynchronous", {})}
    if snapshot:
        curve = []
        for seconds, flat in snapshots:
            torch.nn.utils.vector_to_parameters(flat, model.parameters())
            curve.append((round(seconds, 3), round(accuracy(model, test_x, test_y), 4)))
        torch.nn.utils.vector_to_parameters(final, model.parameters())
        result.update(curve=curve, final_accuracy=accuracy(model, test_x, test_y))
    repl.close()
    return result


def _rate(stamps: Sequence[float], skip: int) -> float:
    """Steps per second after the first `skip` steps."""
    timed = stamps[skip:]
    return (len(timed) - 1) / (timed[-1] - timed[0]) if len(timed) > 1 else float("nan")


def _median_step(stamps: Sequence[float]) -> float:
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:])) if len(stamps) > 1 else float("nan")


def straggler_figures(config: Config, arm: Arm, results: list[dict[str, Any]]) -> dict[str, Any]:
    workers = [r for r in results if r["pipeline"] is not None]
    fast = [r for r in workers if r["pipeline"] < len(workers) - 1]  # the same two workers in every arm
    last = workers[-1]
    first = next(r for r in workers if r["rank"] == 0)
    time_to_target = next((seconds for seconds, acc in first["curve"] if acc >= config.target), None)
    skip = min(5, config.straggler_steps // 10)
    figures: dict[str, Any] = {
        "time_to_target_s": time_to_target,
        "final_accuracy": first["final_accuracy"],
        "fast_updates_per_s": sum(_rate(r["stamps"], skip) for r in fast),
        "fast_step_s": statistics.median(_median_step(r["stamps"]) for r in fast),
        "slowdown_of_last_worker": _median_step(last["stamps"]) / statistics.median(
            _median_step(r["stamps"]) for r in fast),
        "run_seconds": max(r["seconds"] for r in workers),
        "final_parameters_agree": len({r["final_sum"] for r in results}) == 1,
        "curve": first["curve"],
    }
    if arm.mode == "async":
        server = next(r for r in results if r["pipeline"] is None)["last_run"]
        figures["server"] = {key: server.get(key) for key in ("versions", "applied_per_group", "staleness")}
        figures["fast_wait_share"] = statistics.median(
            r["last_run"]["wait_seconds"] / r["seconds"] for r in fast)
    return figures


def ideal_ratio(config: Config, workers: int = 3) -> float:
    """Time to target of asynchronous training over synchronous with one worker slow_factor times slower, if every
    batch counted the same wherever it was computed: sync moves at the slowest worker's pace (workers batches per
    slow step), async at every worker's own (workers - 1 + 1 / slow_factor batches per fast step)."""
    synchronous = workers / config.slow_factor
    return synchronous / (workers - 1 + 1 / config.slow_factor)


def run_straggler(config: Config) -> tuple[dict[str, Any], list[str], bool]:
    arms = straggler_arms(config)
    runs: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
    for repetition, arm in in_turns(arms, config.straggler_repeats):
        results = run_replicas(straggler_job, arm.processes, config, arm,
                               timeout_s=120.0 + 2.0 * config.straggler_steps)
        runs[arm.name].append(straggler_figures(config, arm, results))
        print(f"  straggler, repetition {repetition + 1}, {arm.name}: "
              f"{_seconds(runs[arm.name][-1]['time_to_target_s'])} to {config.target:.0%}", flush=True)
    parameters = sum(p.numel() for p in make_model(config.straggler_hidden, config.seed).parameters())
    fast_steps = [1e3 * f["fast_step_s"] for arm in arms for f in runs[arm.name] if f.get("fast_step_s")]
    lines = [f"\nStraggler: 3 workers, MLP 64-{config.straggler_hidden}-{config.straggler_hidden}-10 ({parameters:,} "
             f"parameters), SGD lr {config.straggler_lr:g}, batch {config.batch} each, {config.straggler_steps} steps "
             f"per worker (a fast worker's step: {_spread(fast_steps, '{:.1f}')} ms); time to {config.target:.0%} "
             f"test accuracy (rank 0's copies, every {config.snapshot_s:g} s); the ideal ratio to sync with the "
             f"straggler is {ideal_ratio(config):.2f} (every batch counting the same):", "",
             "| arm | time to target (s) | vs sync, straggler (paired) | final accuracy | fast workers' updates/s "
             "| vs no straggler (paired) | last worker's step / fast's | fast workers blocked on the server |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    sync = runs[Arm("sync", None, True).name]
    healthy = True
    for arm in arms:
        figures = runs[arm.name]
        times = [f["time_to_target_s"] for f in figures]
        reached = [t for t in times if t is not None]
        against_sync = _paired_optional(times, [f["time_to_target_s"] for f in sync])
        calm = runs.get(replace(arm, straggler=False).name)
        keep = None if calm is None or not arm.straggler else paired_ratio(
            [f["fast_updates_per_s"] for f in figures], [f["fast_updates_per_s"] for f in calm])
        missed = len(times) - len(reached)
        lines.append(
            f"| {arm.name} | {_spread(reached)}{f' ({missed} missed)' if missed else ''} "
            f"| {'(peer)' if figures is sync else _ratio(against_sync)} "
            f"| {_spread([100 * f['final_accuracy'] for f in figures], '{:.1f}')} "
            f"| {_spread([f['fast_updates_per_s'] for f in figures], '{:.0f}')} "
            f"| {_ratio(keep)} "
            f"| {'(lockstep)' if arm.mode == 'sync' else _spread([f['slowdown_of_last_worker'] for f in figures])} "
            f"| {'-' if arm.mode == 'sync' else _spread([100 * f['fast_wait_share'] for f in figures], '{:.0f}%')} |")
        for f in figures:
            healthy &= f["final_parameters_agree"] and f["final_accuracy"] > 0.5
            if "server" in f:
                staleness = f["server"]["staleness"]
                healthy &= staleness["exceeded"] == 0
    lines.append("  checks: every process ended with the same parameters, every run trained, no staleness above "
                 f"the bound: {'yes' if healthy else 'NO'}")
    bounded = [f for arm in arms if arm.max_staleness is not None for f in runs[arm.name]]
    if bounded:
        worst = max(f["server"]["staleness"].get("max", 0) for f in bounded)
        lines.append(f"  largest staleness the server applied at S={config.max_staleness}: {worst}")
    return {"runs": runs}, lines, healthy


def _paired_optional(values: Sequence[float | None], peer: Sequence[float | None]) -> float | None:
    """The paired ratio over the repetitions where both figures exist (a target reached, a rate measured)."""
    pairs = [v / p for v, p in zip(values, peer, strict=True)
             if v is not None and p is not None and math.isfinite(v) and math.isfinite(p)]
    return statistics.median(pairs) if pairs else None


# -- peers ---------------------------------------------------------------------------------------


def replicator_rate_job(config: Config) -> dict[str, Any]:
    """mode="async" with 1 server and 2 workers; workers stamp each update."""
    torch.set_num_threads(1)
    train_x, train_y, _, _ = digits()
    repl = rp.Replicator(mode=rp.ParameterServers(servers=1))
    with repl.scope():
        model = make_model(config.hidden, config.seed)
        optimizer = repl.wrap_optimizer(make_optimizer(model.parameters(), config.lr))
    steps = config.peer_warmup + config.peer_steps

    def input_fn(ctx: rp.InputContext) -> list[Batch]:
        return shard_batches(train_x, train_y, config.batch, ctx.input_pipeline_id, ctx.num_input_pipelines,
                             steps, config.seed)

    def step_fn(ctx: rp.ReplicaContext, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    inputs = repl.prepare_input(input_fn)
    dist.barrier()  # the workers start together
    begun, cpu = time.monotonic(), time.process_time()
    stamps = [time.monotonic() for _ in repl.run(step_fn, inputs, steps=steps, progress=False,
                                                 warmup_steps=config.peer_warmup)]
    cpu, ended = time.process_time() - cpu, time.monotonic()  # cpu: every thread, from run()'s start to its end
    figures = repl.last_run.get("asynchronous", {})
    repl.close()
    # The whole run's share: every exchange (the first pull, the pushes, the wait at the end for the other group)
    # over run() from its start to its end.
    waiting = figures["wait_seconds"] / (ended - begun) if stamps else None
    return {"stamps": stamps, "updates": figures["versions"][0] if "versions" in figures else None, "waiting": waiting,
            "moved": float((_flat(model) - _flat(make_model(config.hidden, config.seed))).abs().max()),
            "cpu_s": cpu, "transport": figures.get("transport"), "per_worker": repl.last_run.get("per_replica")}


def steady_wait_share(per_worker: Sequence[Sequence[float]], stamps: Sequence[Sequence[float]],
                      warmup: int) -> list[float]:
    """Each worker's share of its steady steps blocked on the server: the pushes' waits after the warm-up (its
    run's steady communication seconds) over the time from its warm-up's last step to its last step, the window
    updates/s is read in."""
    return [row[3] / (mine[-1] - mine[warmup - 1]) for row, mine in zip(per_worker, stamps, strict=True)]


def ceiling_rate_job(config: Config) -> dict[str, Any]:
    """The ceiling: the same 2 workers, each with its own optimizer and no server (nothing to wait for)."""
    torch.set_num_threads(1)
    train_x, train_y, _, _ = digits()
    rank, workers = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = make_model(config.hidden, config.seed)
    optimizer = make_optimizer(model.parameters(), config.lr)
    steps = config.peer_warmup + config.peer_steps
    batches = shard_batches(train_x, train_y, config.batch, rank, workers, steps, config.seed)
    stamps, cpu = [], time.process_time()
    for inputs, labels in batches:
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stamps.append(time.monotonic())
    return {"stamps": stamps, "updates": steps, "cpu_s": time.process_time() - cpu,
            "moved": float((_flat(model) - _flat(make_model(config.hidden, config.seed))).abs().max())}


def window_rate(stamps: Sequence[Sequence[float]], warmup: int) -> float:
    """Updates per second while every worker is past its warm-up and not yet done: the job's steady rate.

    The workers' clocks are one (CLOCK_MONOTONIC), so their stamps share a time line.
    """
    start = max(s[warmup] for s in stamps)
    end = min(s[-1] for s in stamps)
    count = sum(1 for s in stamps for t in s if start < t <= end)
    return count / (end - start) if end > start else float("nan")


CEILING = "ceiling: local optimizers, no server"


def run_peers(config: Config) -> tuple[dict[str, Any], list[str], bool]:
    contenders = ["replicator mode=async", "torch.distributed.rpc pattern", "ray pattern", CEILING]
    notes: list[str] = []
    if (missing := ray_missing()) is not None:
        contenders.remove("ray pattern")
        notes.append(missing)
        print(f"  {missing}", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    cpu_ms: dict[str, list[float]] = {name: [] for name in contenders}  # per update, every process of the arm
    waiting: list[float] = []  # replicator's workers: share of their steady steps' time blocked on the server
    waiting_whole: list[float] = []  # the same over their whole run() (start-up and the wait at the end too)
    transports: set[str] = set()
    healthy = True
    total = config.peer_warmup + config.peer_steps
    timeout = 120.0 + 0.5 * total
    for repetition, name in in_turns(contenders, config.peer_repeats):
        cpu: float | None = None
        if name == "replicator mode=async":
            results = run_replicas(replicator_rate_job, 3, config, timeout_s=timeout)
            stamps = [r["stamps"] for r in results[:2]]
            waiting.append(statistics.median(steady_wait_share(results[0]["per_worker"], stamps, config.peer_warmup)))
            waiting_whole.append(statistics.median(r["waiting"] for r in results[:2]))
            updates, moved = results[2]["updates"], min(r["moved"] for r in results)
            cpu = sum(r["cpu_s"] for r in results)
            transports.update(r["transport"] for r in results[:2])
        elif name == "torch.distributed.rpc pattern":
            results = run_replicas(rpc_rate_job, 3, config.hidden, config.batch, config.lr, config.seed,
                                   total, timeout_s=timeout)
            stamps = [r["stamps"] for r in results[:2]]
            updates, moved = results[2]["updates"], min(r["moved"] for r in results[:2])
            cpu = sum(r["cpu_s"] for r in results)
        elif name == CEILING:
            results = run_replicas(ceiling_rate_job, 2, config, timeout_s=timeout)
            stamps = [r["stamps"] for r in results]
            updates, moved = sum(r["updates"] for r in results), min(r["moved"] for r in results)
            cpu = sum(r["cpu_s"] for r in results)
        else:
            outcome = ray_rates(config.hidden, config.batch, config.lr, config.seed, total)
            stamps, updates, moved, cpu = outcome["stamps"], outcome["updates"], outcome["moved"], outcome["cpu_s"]
        rate = window_rate(stamps, config.peer_warmup)
        rates[name].append(rate)
        if cpu is not None:
            cpu_ms[name].append(1e3 * cpu / (2 * total))
        ok = updates == 2 * total and moved > 1e-6
        healthy &= ok
        print(f"  peers, repetition {repetition + 1}, {name}: {rate:,.0f} updates/s"
              f"{f', {cpu_ms[name][-1]:.2f} CPU ms per update' if cpu is not None else ''}"
              f"{'' if ok else f' (CHECK FAILED: {updates} updates applied, moved {moved:.3g})'}", flush=True)
    peer_names = [n for n in contenders if n != "replicator mode=async"]
    lines = [f"\nPeers: parameter updates/s, 1 server + 2 workers, no straggler, batch {config.batch}, "
             f"{config.peer_steps} timed updates per worker after {config.peer_warmup}:", "",
             "| contender | updates/s (median) | range | replicator / this (paired) | CPU ms per update, every "
             "process (median) | over the ceiling's |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    ours = rates["replicator mode=async"]
    for name in rates:
        measured = [rate for rate in rates[name] if math.isfinite(rate)]
        spread = Spread.of(measured) if measured else Spread(math.nan, math.nan, math.nan)
        ratio = "(this package)" if name == "replicator mode=async" else _ratio(_paired_optional(ours, rates[name]))
        spent = _spread(cpu_ms[name]) if cpu_ms[name] else "-"
        over = "-" if name == CEILING or not cpu_ms[name] else _spread(
            [a - b for a, b in zip(cpu_ms[name], cpu_ms[CEILING], strict=False)])
        lines.append(f"| {name} | {spread.median:,.0f} | {spread.min:,.0f}–{spread.max:,.0f} | {ratio} | {spent} "
                     f"| {over} |")
        if len(measured) < len(rates[name]):
            notes.append(f"{name}: in {len(rates[name]) - len(measured)} repetition(s) the workers' timed phases did "
                         "not overlap; left out")
    lines.append(f"  replicator's workers spent {_spread([100 * w for w in waiting], '{:.0f}')} % of their steady "
                 f"steps' time blocked on the server (the updates/s window; repl.last_run['per_replica']), "
                 f"{_spread([100 * w for w in waiting_whole], '{:.0f}')} % of their whole run() (its start-up and the "
                 f"wait at its end for the other group too; repl.last_run['asynchronous']['wait_seconds']); carrier: "
                 f"{', '.join(sorted(map(str, transports)))}")
    lines.append("  CPU: time.process_time() of every process of the arm (all its threads), over run() or the "
                 "training loop (warm-up included), per update; 'over the ceiling' is what the exchange costs "
                 "beyond the same training with a local optimizer (paired by repetition)")
    lines += [f"  {note}" for note in notes]
    lines.append(f"  checks: every server applied exactly 2 x {total} updates "
                 f"and the weights moved: {'yes' if healthy else 'NO'}")
    return {"rates": rates, "cpu_ms_per_update": cpu_ms, "peers": peer_names, "notes": notes,
            "replicator_wait_share": waiting, "replicator_wait_share_whole_run": waiting_whole,
            "transports": sorted(map(str, transports))}, lines, healthy


# -- DiLoCo --------------------------------------------------------------------------------------


def diloco_job(config: Config, seed: int, outer_every: int | None) -> dict[str, Any]:
    """One of 2 processes: mode="sync" (outer_every None) or mode="diloco" at H = outer_every, one seed."""
    torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = digits()
    repl = rp.Replicator() if outer_every is None else rp.Replicator(mode=rp.DiLoCo(outer_every=outer_every))
    with repl.scope():
        model = make_model(config.hidden, seed)
        optimizer = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=config.inner_lr))
    batches = shard_batches(train_x, train_y, config.batch, repl.replica_id, repl.num_replicas,
                            config.diloco_steps, seed)

    def step_fn(ctx: rp.ReplicaContext, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    started = time.perf_counter()
    for _ in repl.run(step_fn, batches, steps=config.diloco_steps, progress=False):
        pass
    run = repl.last_run
    figures = {
        "seed": seed, "outer_every": outer_every, "seconds": time.perf_counter() - started,
        "accuracy": accuracy(model, test_x, test_y), "final_sum": float(_flat(model).double().sum()),
        **{key: run.get(key) for key in ("bytes_per_step", "synchronous_bytes_per_step", "bytes_reduction",
                                          "outer_steps")},
    }
    repl.close()
    return figures


def run_diloco(config: Config) -> tuple[dict[str, Any], list[str], bool]:
    # One job per regime and seed: a Replicator built after another's close() in the same processes
    # can hang (see docs/results.md), and fresh processes are what the other parts use anyway.
    regimes: list[int | None] = [None, *config.outer_every]
    rows: list[dict[str, Any]] = []
    healthy = True
    for seed in config.diloco_seeds:
        for outer_every in regimes:
            results = run_replicas(diloco_job, 2, config, seed, outer_every,
                                   timeout_s=120.0 + 0.5 * config.diloco_steps)
            rows.append(results[0])
            healthy &= results[0]["final_sum"] == results[1]["final_sum"]
            print(f"  diloco, seed {seed}, {'sync' if outer_every is None else f'H={outer_every}'}: "
                  f"{100 * results[0]['accuracy']:.1f} %", flush=True)
    sync_bytes = statistics.median(r["synchronous_bytes_per_step"] for r in rows if r["outer_every"] is not None)
    lines = [f"\nDiLoCo: 2 groups of 1 replica, {config.diloco_steps} inner steps of batch {config.batch} each, "
             f"Adam lr {config.inner_lr:g} inside, the default outer Nesterov SGD (lr 0.7, momentum 0.9); "
             f"seeds {list(config.diloco_seeds)}:", "",
             "| regime | test accuracy % (median, min–max over seeds) | vs sync (median paired, points) "
             "| bytes per step and process | fewer than sync |",
             "| --- | ---: | ---: | ---: | ---: |"]
    sync = sorted((r for r in rows if r["outer_every"] is None), key=lambda r: r["seed"])
    for outer_every in regimes:
        arm = sorted((r for r in rows if r["outer_every"] == outer_every), key=lambda r: r["seed"])
        accuracies = [100 * r["accuracy"] for r in arm]
        if outer_every is None:
            lines.append(f"| sync (mode='sync') | {_spread(accuracies, '{:.1f}')} | (peer) | {sync_bytes:,.0f} | 1 |")
            continue
        gap = statistics.median(100 * (r["accuracy"] - s["accuracy"]) for r, s in zip(arm, sync, strict=True))
        spent = statistics.median(r["bytes_per_step"] for r in arm)
        lines.append(f"| DiLoCo H={outer_every} | {_spread(accuracies, '{:.1f}')} | {gap:+.2f} | {spent:,.0f} "
                     f"| {statistics.median(r['bytes_reduction'] for r in arm):.1f}x |")
        healthy &= all(r["outer_steps"] == config.diloco_steps // outer_every for r in arm)
    lines.append("  bytes: what each process hands to reductions per step, in the reducer's wire type, as "
                 "repl.last_run reports (sync: DiLoCo's synchronous_bytes_per_step, the same reducer every step)")
    lines.append(f"  checks: both processes ended with the same parameters, every outer step taken: "
                 f"{'yes' if healthy else 'NO'}")
    return {"rows": rows}, lines, healthy


# -- the report ----------------------------------------------------------------------------------


def _spread(values: Sequence[float], form: str = "{:.2f}") -> str:
    if not values:
        return "never"
    spread = Spread.of(values)
    if len(values) == 1:
        return form.format(spread.median)
    return f"{form.format(spread.median)} ({form.format(spread.min)}–{form.format(spread.max)})"


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def targets(config: Config, report: dict[str, Any]) -> list[str]:
    """Issues 17's and 30's targets, each with the figure that meets or misses it."""
    lines = ["\nTargets (issues 17 and 30):"]

    def say(claim: str, met: bool | None, figure: str) -> None:
        verdict = "not measured" if met is None else ("met" if met else "MISSED")
        lines.append(f"  {claim}: {figure} -> {verdict}")

    if "transport" in report:
        row = report["transport"]["rows"]["85k params (340 KB)"]
        ratio = _paired_optional(row["update"], row["rpc_sync echo"])
        say("an 85k-parameter update's round trip <= 0.5x the rpc_sync echo's", None if ratio is None else ratio <= 0.5,
            f"{_ratio(ratio)}x")
        over = statistics.median(a - b for a, b in zip(row["update_cpu"], row["alone_cpu"], strict=True))
        plain = statistics.median(a - b for a, b in zip(row["update_cpu"], row["local_cpu"], strict=True))
        say("<= 0.3 ms of CPU per 85k-parameter update, both sides (beyond the same run() with a local optimizer)",
            over <= 0.3e-3, f"{1e3 * over:.2f} ms ({1e3 * plain:.2f} ms beyond a plain torch step, "
            f"{1e3 * statistics.median(row['update_cpu']):.2f} ms in all)")
    if "straggler" in report:
        runs = report["straggler"]["runs"]
        bounded = runs[Arm("async", config.max_staleness, True).name]
        sync = runs[Arm("sync", None, True).name]
        ratio = _paired_optional([f["time_to_target_s"] for f in bounded], [f["time_to_target_s"] for f in sync])
        say(f"S={config.max_staleness} reaches {config.target:.0%} in <= 0.6x sync's time", None if ratio is None
            else ratio <= 0.6, f"{_ratio(ratio)}x (ideal {ideal_ratio(config):.2f}x)")
        gap = statistics.median(100 * (b["final_accuracy"] - s["final_accuracy"])
                                for b, s in zip(bounded, sync, strict=True))
        say(f"S={config.max_staleness} final accuracy within 0.5 points of sync (or above it)", gap >= -0.5,
            f"{gap:+.2f} points")
        calm = runs[Arm("async", config.max_staleness, False).name]
        keep = paired_ratio([f["fast_updates_per_s"] for f in bounded], [f["fast_updates_per_s"] for f in calm])
        say("fast workers keep >= 90% of their no-straggler updates/s", keep >= 0.9, f"{keep:.1%}")
    if "peers" in report:
        rates = report["peers"]["rates"]
        ours = rates["replicator mode=async"]
        for name, needed in (("torch.distributed.rpc pattern", 2.0), ("ray pattern", 1.5)):
            ratio = _paired_optional(ours, rates[name]) if name in rates else None
            if ratio is not None:
                say(f"updates/s >= {needed:g}x the {name}", ratio >= needed, f"{ratio:.2f}x")
            else:
                say(f"updates/s >= {needed:g}x the {name}", None, "skipped")
        share = report["peers"]["replicator_wait_share"]
        say("a worker blocked on its server <= 40% of its time (steady steps)", statistics.median(share) <= 0.4,
            f"{100 * statistics.median(share):.0f}%")
    if "diloco" in report:
        rows = report["diloco"]["rows"]
        sync = [r for r in rows if r["outer_every"] is None]
        far = [r for r in rows if r["outer_every"] == max(config.outer_every)]
        gap = statistics.median(100 * (r["accuracy"] - s["accuracy"]) for r, s in zip(far, sync, strict=True))
        fewer = statistics.median(r["bytes_reduction"] for r in far)
        say(f"DiLoCo H={max(config.outer_every)} within 1 point of sync with >= 16x fewer bytes",
            gap >= -1.0 and fewer >= 16, f"{gap:+.2f} points, {fewer:.1f}x fewer bytes")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all", help="which part to run (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: one short repetition of each part (its figures are not the claims')")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repetitions of the transport, straggler and peers parts (default 3, 3 and 5)")
    parser.add_argument("--hidden", type=int, default=Config.hidden,
                        help="the MLP's width (8 makes messages tiny: the exchanges' fixed costs show)")
    parser.add_argument("--snapshot-s", type=float, default=Config.snapshot_s,
                        help="seconds between rank 0's parameter copies in the straggler part")
    add_json_argument(parser, "asynchronous")
    options = parser.parse_args(argv)
    config = QUICK if options.quick else Config()
    config = replace(config, snapshot_s=options.snapshot_s, hidden=options.hidden)
    if options.repeats is not None:
        if options.repeats < 1:
            parser.error("--repeats must be at least 1")
        config = replace(config, transport_repeats=options.repeats, straggler_repeats=options.repeats,
                         peer_repeats=options.repeats)
    parts = PARTS if options.part == "all" else (options.part,)
    header = machine()
    parameters = sum(p.numel() for p in make_model(config.hidden, config.seed).parameters())
    print(f"{machine_line(header)}\nMLP 64-{config.hidden}-{config.hidden}-10 ({parameters:,} parameters) on the "
          f"digits, batch {config.batch} per worker, SGD lr {config.lr:g} momentum 0.9, 1 thread per process; "
          f"parts: {', '.join(parts)}{' (quick)' if options.quick else ''}", flush=True)
    os.environ.update(heap_kept_environment())  # the processes run as `replicator launch` runs replicas
    load_before = load_average()[0]
    report: dict[str, Any] = {"config": asdict(config), "parameters": parameters, "quick": options.quick}
    lines: list[str] = []
    healthy = True
    for part in parts:
        started = time.perf_counter()
        figures, part_lines, ok = {"transport": run_transport, "straggler": run_straggler, "peers": run_peers,
                                   "diloco": run_diloco}[part](config)
        report[part] = figures
        lines += part_lines + [f"  ({time.perf_counter() - started:.0f} s)"]
        healthy &= ok
    lines += targets(config, report)
    load_after = load_average()[0]
    report["load_average_1min"] = {"before": load_before, "after": load_after}
    lines.append(f"\n1-minute load average: {load_before:.2f} before, {load_after:.2f} after, on {os.cpu_count()} "
                 "cores (a job here runs up to 4 processes).")
    print("\n".join(lines), flush=True)
    write_json(options.json, report, header)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
