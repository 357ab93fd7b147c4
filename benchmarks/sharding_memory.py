"""Peak resident memory per replica at each shard level, and a model that trains only sharded under a memory budget.

Command (from the repository root; about two minutes on 2 loaded cores; figures go to
benchmarks/results/sharding_memory.json):

    .venv/bin/python benchmarks/sharding_memory.py

(a) For each of shard=None / "optimizer" / "gradients" / "parameters", a fresh set of N = 4
processes builds the same MLP (`layers` Linear(width, width) blocks), wraps AdamW and trains
`steps` steps; each process reports its peak resident set (VmHWM, /proc/self/status) less its
resident set just before the model was built (the interpreter, torch, the process group: the
same at every level); "build peak" is that growth at the end of `repl.scope()`. "parameters"
builds the model on the meta device (each unit given values and sharded in turn); "parameters,
built whole" builds it for real first, for comparison. The saving against shard=None is set
beside the formula's (replicator.plan.memory: fp32 Adam 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N + the
largest unit): the target is a measured saving of at least 80 % of the formula's. Every level
uses the same `bucket_mb` gradient buckets (smaller than the 25 MB default: "gradients" keeps at
most two buckets whole during backward, so a bucket as large as the model would save nothing)
and Gloo's all-reduce (reducer="flat": the shared-memory reducer's segments would count in the
resident set of the unsharded levels, not of FSDP2's).

Each table is run under three settings of glibc's heap (ALLOCATORS), because the resident set
is the heap's, not the tensors': FSDP2 allocates and frees every unit's gathered parameters and
gradients at every step, and a heap that keeps freed blocks (glibc's default grows its mmap
threshold past a unit's size; `replicator launch` keeps the whole heap, for speed) holds far
more than the live tensors.

(b) The budget: the resident set of a replica holding no model (measured in the same run) plus
`allowance_mb`, less than the model's fp32 Adam state (16Ψ). It is enforced by a watchdog in
this process that reads every replica's VmRSS from /proc every few milliseconds and kills a
replica over it (SIGKILL), and checked again from each surviving replica's own VmHWM (a peak
between two readings would show there). Not RLIMIT_AS: it limits address space, and torch
reserves far more of it than it touches (thread stacks, mapped libraries: the VmSize of an idle
replica is printed), so no address-space limit says how much memory a replica uses. The same
training script runs with shard="parameters" on 4 processes and on 1.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _harness import add_json_argument, machine, machine_line, write_json
from torch.distributed.tensor import DTensor

import replicator as rp
from replicator.plan.memory import shard_memory, smallest_fitting
from replicator.testing import ReplicaFailure, run_replicas

MB = 2**20
LEVELS = ("none", "optimizer", "gradients", "parameters", "parameters, built whole")


@dataclass(frozen=True)
class Config:
    replicas: int = 4
    layers: int = 12
    width: int = 768
    batch: int = 8  # per replica: activations stay small beside the model state
    steps: int = 3
    bucket_mb: float = 2.0
    allowance_mb: float = 80.0
    poll_ms: float = 2.0
    allocators: str = "glibc,returned,kept"  # comma-separated names of ALLOCATORS


def mlp(config: Config) -> torch.nn.Sequential:
    """`layers` blocks of Linear + tanh, each Linear a direct child: a unit of shard="parameters" (default policy)."""
    blocks: list[torch.nn.Module] = []
    for _ in range(config.layers):
        blocks += [torch.nn.Linear(config.width, config.width), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def parameters_of(config: Config) -> tuple[int, int]:
    """Ψ and the largest unit's elements."""
    unit = config.width * config.width + config.width
    return config.layers * unit, unit


def status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM and VmSize of a process, in bytes (Linux /proc)."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmSize"):
                found[key] = int(value.split()[0]) * 1024
    return found


def local_bytes(tensors: Any) -> int:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


# glibc's heap, set with mallopt() in each replica (its environment variables are read when a process starts, and
# the replicas are forked from a server started before): M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3.
ALLOCATORS = {
    "glibc": {},  # the defaults: the mmap threshold grows to the largest block freed, up to 32 MiB
    "returned": {-3: 128 * 1024},  # a fixed threshold: every block over 128 KiB is its own mapping, unmapped on free
    "kept": {-1: 1 << 30, -3: 1 << 30},  # what `replicator launch` sets (HEAP_KEPT): nothing returned, for speed
}


def set_allocator(name: str) -> None:
    libc = ctypes.CDLL(None)
    for option, value in ALLOCATORS[name].items():
        if libc.mallopt(option, value) != 1:
            raise RuntimeError(f"mallopt({option}, {value}) failed")


def train(level: str, config: Config, allocator: str, pid_dir: str | None) -> dict[str, Any]:
    """Inside a replica: build, wrap AdamW, train; the resident set before and at its peak, and the model state."""
    set_allocator(allocator)
    torch.set_num_threads(1)
    if pid_dir is not None:  # for the watchdog: this process's id, once it is started
        with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
    shard = None if level == "none" else level.split(",")[0]
    repl = rp.Replicator(shard=shard, reducer="flat", bucket_cap_mb=config.bucket_mb)
    before = status()
    with repl.scope():
        torch.manual_seed(0)
        if level == "parameters":
            with torch.device("meta"):
                model = mlp(config)
        else:
            model = mlp(config)
        optimizer = repl.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    built = status()  # its peak so far is the build's (the whole model, or one unit and the shards)
    seen: dict[str, int] = {}

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        F.mse_loss(model(batch), batch.flip(1)).backward()
        if ctx.step == config.steps - 1:  # the fullest moment: gradients, and the moments of earlier steps
            params = list(model.parameters())
            sharded = repl.optimizers.wrapped[0].sharded
            state = optimizer.state if sharded is None else sharded.shard.state
            slices = sharded.slices.values() if sharded is not None else []
            seen["model_state_bytes"] = (
                local_bytes(params) + local_bytes(p.grad for p in params if p.grad is not None) + local_bytes(slices)
                + local_bytes(v for entry in state.values() for k, v in entry.items() if k != "step"))
        optimizer.step()

    generator = torch.Generator().manual_seed(repl.replica_id)
    batches = [torch.randn(config.batch, config.width, generator=generator) for _ in range(config.steps)]
    for _ in repl.run(step_fn, batches, record=False):
        pass
    after = status()
    repl.close()
    return {"rss_before": before["VmRSS"], "build_peak": built["VmHWM"], "peak": after["VmHWM"],
            "vm_size": before["VmSize"], **seen}


def idle(pid_dir: str | None) -> dict[str, int]:
    """Inside a replica: the resident set with the process group up and no model (what the budget adds to)."""
    repl = rp.Replicator()
    found = status()
    repl.close()
    return found


class Watchdog:
    """Once a process whose pid file is in `pid_dir` has a VmRSS over `budget` bytes, kills (SIGKILL) them all."""

    def __init__(self, pid_dir: str, budget: int, poll_s: float) -> None:
        self.pid_dir, self.budget, self.poll_s = pid_dir, budget, poll_s
        self.peaks: dict[int, int] = {}
        self.killed: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for name in os.listdir(self.pid_dir):
                pid = int(name.split(".")[0])
                if pid in self.killed:
                    continue
                try:
                    rss = status(pid)["VmRSS"]
                except (OSError, KeyError):
                    continue  # ended, or a zombie without a resident set
                self.peaks[pid] = max(self.peaks.get(pid, 0), rss)
                if rss > self.budget:
                    self.killed[pid] = rss
                    self._kill_all()  # the others would wait for it in their next collective
            time.sleep(self.poll_s)

    def _kill_all(self) -> None:
        for name in os.listdir(self.pid_dir):
            try:
                os.kill(int(name.split(".")[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def under_budget(config: Config, replicas: int, budget: int, allocator: str) -> dict[str, Any]:
    """shard="parameters" on `replicas` processes under the watchdog: trained, or killed, and the peaks seen."""
    with tempfile.TemporaryDirectory() as pid_dir, Watchdog(pid_dir, budget, config.poll_ms / 1e3) as watchdog:
        try:
            results = run_replicas(train, replicas, "parameters", config, allocator, pid_dir, timeout_s=900)
            outcome = "trained"
        except ReplicaFailure as failure:
            results = []
            outcome = "killed by the watchdog" if watchdog.killed else f"failed: {failure.errors[0].message[:200]}"
    within = all(result["peak"] <= budget for result in results)
    if results and not within:
        outcome = "trained, but over the budget between two readings"
    return {"replicas": replicas, "allocator": allocator, "outcome": outcome,
            "killed_at_mb": [rss / MB for rss in watchdog.killed.values()],
            "watchdog_peak_mb": max(watchdog.peaks.values(), default=0) / MB,
            "own_peak_mb": [result["peak"] / MB for result in results]}


def peaks(config: Config, allocator: str) -> dict[str, dict[str, Any]]:
    """(a) for one heap setting: every level's peak growth per replica beside the formula, printed as a table."""
    psi, unit = parameters_of(config)
    rows: dict[str, dict[str, Any]] = {}
    for level in LEVELS:
        results = run_replicas(train, config.replicas, level, config, allocator, None, timeout_s=900)
        growth = [(r["peak"] - r["rss_before"]) / MB for r in results]
        formula = shard_memory(level.split(",")[0], psi, config.replicas, "adam", largest_unit=unit).total / MB
        build = [(r["build_peak"] - r["rss_before"]) / MB for r in results]
        rows[level] = {"peak_growth_mb": growth, "median_mb": statistics.median(growth), "formula_mb": formula,
                       "build_growth_mb": build,
                       "model_state_mb": [r["model_state_bytes"] / MB for r in results]}
    none = rows["none"]
    print(f"heap: {allocator}")
    print(f"{'shard':26s} {'peak RSS growth (MB)':>22s} {'model state':>12s} {'formula':>8s} {'saved':>8s} "
          f"{'formula saves':>14s} {'saved/formula':>14s} {'build peak':>11s}")
    for level, row in rows.items():
        saved = none["median_mb"] - row["median_mb"]
        formula_saves = none["formula_mb"] - row["formula_mb"]
        row["saved_mb"], row["formula_saves_mb"] = saved, formula_saves
        row["saved_fraction"] = saved / formula_saves if formula_saves else None
        fraction = f"{row['saved_fraction']:.0%}" if row["saved_fraction"] is not None else "-"
        spread = f"{row['median_mb']:.1f} [{min(row['peak_growth_mb']):.1f}, {max(row['peak_growth_mb']):.1f}]"
        print(f"{level:26s} {spread:>22s} {statistics.median(row['model_state_mb']):12.1f} {row['formula_mb']:8.1f} "
              f"{saved:8.1f} {formula_saves:14.1f} {fraction:>14s} {statistics.median(row['build_growth_mb']):11.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field, default in asdict(Config()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", dest=field, type=type(default), default=default)
    add_json_argument(parser, "sharding_memory")
    arguments = parser.parse_args()
    config = Config(**{k: v for k, v in vars(arguments).items() if k != "json"})
    header = machine()
    print(machine_line(header))
    psi, unit = parameters_of(config)
    n = config.replicas
    print(f"model: {config.layers} x Linear({config.width}, {config.width}), {psi:,} parameters "
          f"(largest unit {unit:,}); fp32 AdamW state 16 x {psi:,} = {16 * psi / MB:.1f} MB; N = {n}; "
          f"buckets {config.bucket_mb} MB\n")

    allocators = config.allocators.split(",")
    report: dict[str, Any] = {"config": asdict(config), "parameters": psi, "largest_unit": unit, "levels": {},
                              "targets_met": {}}
    for allocator in allocators:  # (a) peak resident memory per replica, each level in fresh processes
        rows = report["levels"][allocator] = peaks(config, allocator)
        report["targets_met"][allocator] = {
            level: rows[level]["saved_fraction"] >= 0.8 for level in ("optimizer", "gradients", "parameters")}
        print(f"target (saved >= 80 % of the formula's saving): {report['targets_met'][allocator]}\n")

    # (b) the budget.
    baseline = run_replicas(idle, 1, None, timeout_s=300)[0]
    budget = int(baseline["VmRSS"] + config.allowance_mb * MB)
    plan = {k: smallest_fitting([shard_memory(level, psi, k, "adam", largest_unit=unit)
                                 for level in ("none", "optimizer", "gradients", "parameters")],
                                config.allowance_mb * MB) for k in (1, n)}
    print(f"budget: {budget / MB:.1f} MB resident per process (an idle replica's {baseline['VmRSS'] / MB:.1f} MB + "
          f"{config.allowance_mb:.0f} MB; the fp32 Adam state alone is {16 * psi / MB:.1f} MB; VmSize of an idle "
          f"replica {baseline['VmSize'] / MB:.0f} MB)")
    print("planner: least sharded level whose model state fits the allowance: "
          + ", ".join(f"N = {k}: {fit.level if fit else 'none fits'}" for k, fit in plan.items()))
    budgeted = [under_budget(config, k, budget, allocator) for allocator in allocators for k in (n, 1)]
    for run in budgeted:
        peaks_mb = run["own_peak_mb"] or run["killed_at_mb"]
        print(f"  heap {run['allocator']:9s} shard='parameters' on {run['replicas']} process(es): {run['outcome']}; "
              f"peak resident {max(peaks_mb, default=0):.1f} MB (watchdog saw {run['watchdog_peak_mb']:.1f} MB)")
    report.update({"budget_mb": budget / MB, "idle_rss_mb": baseline["VmRSS"] / MB,
                   "idle_vm_size_mb": baseline["VmSize"] / MB,
                   "planner": {str(k): fit.level if fit else None for k, fit in plan.items()}, "budgeted": budgeted})
    write_json(arguments.json, report, header)


if __name__ == "__main__":
    main()
