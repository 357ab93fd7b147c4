"""All-reduce bandwidth and data-parallel step time on a simulated 2-node cluster: torch's all_reduce vs our reducers.

Command (from the repository root, as root: it builds network namespaces; about 2 minutes on 2 cores;
figures go to benchmarks/results/allreduce.json):

    .venv/bin/python benchmarks/allreduce.py
    .venv/bin/python benchmarks/allreduce.py --quick          # sizes up to 16 MiB, fewer repetitions

The cluster (replicator.testing.cluster.SimulatedCluster) is 2 nodes x 2 processes: each node
a network namespace whose link to a private switch is shaped by tbf to `--link-mbit` Mbit/s
per direction; the processes of one node talk over its loopback, unshaped. Every contender
runs in the same processes on the same buffers, in repetitions that take turns (the order
rotates), and figures are medians over repetitions. One repetition of a collective lasts as
long as its slowest rank.

Figures:
  algbw = S / t for an all-reduce of S bytes taking t seconds.
  busbw = algbw * 2(n-1)/n with n = 4 ranks (the bytes a ring moves per rank, nccl-tests' convention).
  link share = W / t / line rate, where W is the payload one node sends over its link
    (one direction) per all-reduce: a ring through all 4 ranks leaves each node once, so
    W = 2(n-1)/n * S = 1.5 S; the hierarchical reducer sends each node's S/L shard per local
    rank across, W = L * 2(N-1)/N * S/L = S with N = 2 nodes. Line rate is the tbf rate,
    which counts Ethernet/IP/TCP headers too: at MTU 1500 payload can reach at most
    1448/1514 = 95.6% of it.
  "inter-node phase only" is a diagnostic row: the hierarchical reducer's cross-node step alone
    (an all-reduce of S/L over every inter-node group at once). It moves the same W = S per
    node, so its link share is what the network allows; the gap to "hierarchical" is the cost
    of the intra-node reduce-scatter and all-gather, which run before and after it, not during.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import (
    add_json_argument,
    in_turns,
    load_average,
    machine,
    machine_line,
    paired_ratio,
    ratio_of_medians,
    slowest_rank,
    write_json,
)

import replicator as rp
from replicator.sync.reducers import make_reducer
from replicator.testing.cluster import SimulatedCluster, cluster_available
from replicator.topology import build_process_groups, discover

KiB, MiB = 1 << 10, 1 << 20
SIZES = tuple(4 * KiB * 4**k for k in range(8))  # 4 KiB .. 64 MiB
QUICK_SIZES = tuple(s for s in SIZES if s <= 16 * MiB)
METHODS = ("torch all_reduce", "flat", "hierarchical")
# Diagnostic: only the cross-node step of the hierarchical reducer, an all-reduce of S/L over each
# inter-node group, all L groups at once. What the network alone allows; not a full sum.
INTER_PHASE = "inter-node phase only"
STEP_REDUCERS = ("flat", "hierarchical", "fp16", "powersgd:4")
NO_COMMUNICATION = "no communication"  # the same step without any all-reduce: the compute floor


@dataclass(frozen=True)
class Config:
    nodes: int = 2
    procs_per_node: int = 2
    link_mbit: float = 1000.0
    mtu: int = 1500
    queue_ms: float = 50.0
    sizes: tuple[int, ...] = SIZES
    repeats: int = 7
    # Step benchmark: an MLP of equal 1024x1024 layers (~3.2 M parameters, 12 MiB of fp32 gradients).
    step_reducers: tuple[str, ...] = STEP_REDUCERS
    step_repeats: int = 5
    steps: int = 4  # timed steps per phase
    warmup: int = 1  # untimed steps before each phase
    batch: int = 64  # per replica
    width: int = 1024
    layers: int = 3
    bucket_mb: float = 4.0
    skip_steps: bool = False
    skip_collectives: bool = False
    seed: int = 0


def iterations(nbytes: int) -> int:
    """Back-to-back calls per timed sample: small messages are timed over several, so the barrier's skew
    does not dominate."""
    return max(1, min(50, (4 * MiB) // nbytes))


def collective_methods(groups: Any) -> tuple[dict[str, Callable[[torch.Tensor], None]], Callable[[], None]]:
    """The contenders, each a blocking call that sums a buffer over all ranks; and a function closing them."""
    flat = make_reducer("flat", groups)
    hierarchical = make_reducer("hierarchical", groups)
    local = dist.get_world_size(groups.intra_node)
    methods: dict[str, Callable[[torch.Tensor], None]] = {
        "torch all_reduce": lambda buffer: dist.all_reduce(buffer, group=groups.world),
        "flat": lambda buffer: flat.reduce(buffer, groups.replica).wait(),
        "hierarchical": lambda buffer: hierarchical.reduce(buffer, groups.replica).wait(),
        INTER_PHASE: lambda buffer: dist.all_reduce(buffer[: buffer.numel() // local], group=groups.inter_node),
    }

    def close() -> None:
        for reducer in (flat, hierarchical):
            getattr(reducer, "close", lambda: None)()

    return methods, close


def measure_collectives(config: Config, groups: Any) -> dict[str, Any]:
    """Seconds per all-reduce, per method and size, one entry per repetition (slowest rank's)."""
    methods, close = collective_methods(groups)
    names = list(methods)
    rank = dist.get_rank()
    times: dict[str, dict[int, list[float]]] = {name: {size: [] for size in config.sizes} for name in names}
    agree: dict[int, bool] = {}
    for size in config.sizes:
        numel = size // 4
        # Integers sum exactly in any order: every method must give the same bits.
        source = torch.randint(-8, 8, (numel,), generator=torch.Generator().manual_seed(rank)).float()
        results = {}
        for name in names:
            buffer = source.clone()
            methods[name](buffer)  # also warms the connections and buffers for this size
            results[name] = buffer
        agree[size] = all(torch.equal(results[name], results[names[0]]) for name in METHODS)
        buffer = torch.empty_like(source)
        count = iterations(size)
        for _, name in in_turns(names, config.repeats):
            buffer.copy_(source).mul_(1e-3)  # small values: repeated sums stay finite
            dist.barrier(group=groups.world)
            started = time.perf_counter()
            for _ in range(count):
                methods[name](buffer)
            times[name][size].append(slowest_rank((time.perf_counter() - started) / count))
    close()
    return {"times": times, "agree": agree}


def make_model(config: Config) -> torch.nn.Module:
    """An MLP of `layers` equal width x width layers and a small head: gradients appear at an even rate in backward."""
    layers: list[torch.nn.Module] = []
    for _ in range(config.layers):
        layers += [torch.nn.Linear(config.width, config.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(config.width, 10))


def gradient_bytes(config: Config) -> int:
    return 4 * sum(p.numel() for p in make_model(config).parameters())


def forward_flops_per_sample(config: Config) -> float:
    """Multiply-adds of the Linear layers, a multiply-add counting 2."""
    linears = [m for m in make_model(config).modules() if isinstance(m, torch.nn.Linear)]
    return 2.0 * sum(m.in_features * m.out_features for m in linears)


def _batches(config: Config, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 * config.seed + rank)
    return [(torch.randn(config.batch, config.width, generator=generator),
             torch.randint(0, 10, (config.batch,), generator=generator))
            for _ in range(4)]


def measure_steps(config: Config, reducers: tuple[str, ...]) -> dict[str, Any]:
    """Seconds per training step (slowest rank's, per repetition) for each reducer and without communication.

    Each reducer has its own rp.Replicator and its own model copy and SGD, started from the
    same weights and fed the same batches, so flat and hierarchical must end equal.
    """
    replicators = {spec: rp.Replicator(reducer=spec, bucket_cap_mb=config.bucket_mb) for spec in reducers}
    rank = dist.get_rank()
    torch.manual_seed(config.seed)
    reference = make_model(config)  # the same seed everywhere: the same weights on every rank
    contenders: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for spec, repl in replicators.items():
        with repl.scope():
            model = make_model(config)
            model.load_state_dict(reference.state_dict())
            contenders[spec] = (model, repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)))
    local = make_model(config)
    local.load_state_dict(reference.state_dict())
    contenders[NO_COMMUNICATION] = (local, torch.optim.SGD(local.parameters(), lr=0.01, momentum=0.9))
    batches = _batches(config, rank)
    cursor = {name: 0 for name in contenders}

    def run(name: str, count: int) -> None:
        model, optimizer = contenders[name]
        for _ in range(count):
            images, labels = batches[cursor[name] % len(batches)]
            cursor[name] += 1
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()  # waits for the last bucket's reduction

    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _, name in in_turns(names, config.step_repeats):
        run(name, config.warmup)
        dist.barrier()
        started = time.perf_counter()
        run(name, config.steps)
        times[name].append(slowest_rank((time.perf_counter() - started) / config.steps))
    flat_params = None
    if "flat" in contenders:
        flat_params = torch.cat([p.detach().reshape(-1) for p in contenders["flat"][0].parameters()])
    checks = {}
    if flat_params is not None and "hierarchical" in contenders:
        hierarchical = torch.cat([p.detach().reshape(-1) for p in contenders["hierarchical"][0].parameters()])
        checks["hierarchical vs flat: max |diff| of parameters"] = float((hierarchical - flat_params).abs().max())
    if flat_params is not None:
        initial = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        checks["flat: max |change since start|"] = float((flat_params - initial).abs().max())
    for repl in replicators.values():
        getattr(repl.reducer, "close", lambda: None)()
    return {"times": times, "checks": checks}


def cluster_job(config: Config) -> dict[str, Any]:
    """One rank of the cluster: collectives, then training steps."""
    torch.set_num_threads(1)
    topology = discover()
    groups = build_process_groups(topology)
    out: dict[str, Any] = {"topology": (topology.rank, topology.node_rank, topology.local_rank, topology.num_nodes)}
    if not config.skip_collectives:
        out["collectives"] = measure_collectives(config, groups)
    if not config.skip_steps:
        out["steps"] = measure_steps(config, config.step_reducers)
    dist.barrier()
    return out


# -- reporting ------------------------------------------------------------------------
def link_bytes(method: str, size: int, nodes: int, procs_per_node: int) -> float:
    """Payload one node sends over its link, one direction, per all-reduce of `size` bytes (see the module
    docstring)."""
    n = nodes * procs_per_node
    if method in ("hierarchical", INTER_PHASE):
        return 2 * (nodes - 1) / nodes * size
    return 2 * (n - 1) / n * size  # a ring over all ranks in rank order: one edge leaves each node


def _size(nbytes: float) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / KiB:g} KiB"


@dataclass
class Summary:
    rows: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    targets: dict[str, Any] = field(default_factory=dict)


def summarize(config: Config, result: dict[str, Any]) -> Summary:
    summary = Summary()
    n = config.nodes * config.procs_per_node
    line_rate = config.link_mbit * 1e6 / 8
    collectives = result.get("collectives")
    if collectives is not None:
        times = collectives["times"]
        for size in config.sizes:
            for method in (*METHODS, INTER_PHASE):
                samples = times[method][size]
                t = statistics.median(samples)
                algbw = size / t
                summary.rows.append({
                    "size": size, "method": method, "median_s": t, "min_s": min(samples), "max_s": max(samples),
                    "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n,
                    "link_share": link_bytes(method, size, config.nodes, config.procs_per_node) / t / line_rate,
                    # Times: flat's over this method's, so above 1 means faster than flat.
                    "vs_flat": ratio_of_medians(times["flat"][size], samples),
                    "paired_vs_flat": paired_ratio(times["flat"][size], samples),
                    "agree": collectives["agree"][size] if method in METHODS else None,
                })
        big = [r for r in summary.rows if r["method"] == "hierarchical" and r["size"] >= 16 * MiB]
        if big:
            worst = min(r["vs_flat"] for r in big)
            summary.targets["hierarchical >= 1.3 x flat at >= 16 MiB"] = {"measured": worst, "met": worst >= 1.3}
        largest = max(config.sizes)
        if largest >= 64 * MiB:
            for method in (*METHODS, INTER_PHASE):
                share = next(r["link_share"] for r in summary.rows if r["method"] == method and r["size"] == largest)
                summary.targets[f"{method}: link share >= 90% at {_size(largest)}"] = {
                    "measured": share, "met": share >= 0.9,
                }
    steps = result.get("steps")
    if steps is not None:
        floor = statistics.median(steps["times"][NO_COMMUNICATION])
        flat = statistics.median(steps["times"]["flat"]) if "flat" in steps["times"] else None
        for name, samples in steps["times"].items():
            t = statistics.median(samples)
            summary.steps.append({"reducer": name, "median_s": t, "min_s": min(samples), "max_s": max(samples),
                                  "vs_flat": None if flat is None or name == NO_COMMUNICATION else flat / t,
                                  "over_compute_s": t - floor})
    return summary


def print_tables(config: Config, summary: Summary, result: dict[str, Any]) -> list[str]:
    lines = []
    if summary.rows:
        lines += ["", f"All-reduce over {config.nodes} nodes x {config.procs_per_node} processes, "
                  f"{config.link_mbit:g} Mbit/s "
                  f"links (MTU {config.mtu}), median of {config.repeats} interleaved repetitions:", "",
                  "| size | method | time (ms) | algbw (MB/s) | busbw (MB/s) | link share | vs flat (ratio of medians) "
                  "| vs flat (median paired) | results equal |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for row in summary.rows:
            agree = {True: "yes", False: "NO", None: "(not a full sum)"}[row["agree"]]
            lines.append(
                f"| {_size(row['size'])} | {row['method']} | {row['median_s'] * 1e3:.3f} | {row['algbw'] / 1e6:.1f} "
                f"| {row['busbw'] / 1e6:.1f} | {row['link_share']:.1%} | {row['vs_flat']:.2f} "
                f"| {row['paired_vs_flat']:.2f} "
                f"| {agree} |")
    if summary.steps:
        lines += ["", f"Data-parallel step, MLP {config.layers} x {config.width}x{config.width} + head "
                  f"({gradient_bytes(config) / MiB:.1f} MiB fp32 gradients), batch {config.batch} per replica, "
                  f"{config.bucket_mb:g} MiB buckets, median of {config.step_repeats} x {config.steps} steps:", "",
                  "| reducer | step (ms) | range (ms) | speed-up vs flat | above the no-communication step (ms) |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for row in summary.steps:
            ratio = "" if row["vs_flat"] is None else f"{row['vs_flat']:.2f}"
            lines.append(f"| {row['reducer']} | {row['median_s'] * 1e3:.1f} "
                         f"| {row['min_s'] * 1e3:.1f}–{row['max_s'] * 1e3:.1f} "
                         f"| {ratio} | {row['over_compute_s'] * 1e3:.1f} |")
        for name, value in result["steps"]["checks"].items():
            lines.append(f"  check: {name} = {value:.3g}")
    if summary.targets:
        lines += ["", "Targets:"]
        for name, target in summary.targets.items():
            value = target["measured"]
            shown = f"{value:.1%}" if "share" in name else f"{value:.2f}x"
            lines.append(f"  {name}: measured {shown} -> {'met' if target['met'] else 'NOT met'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mbit", type=float, default=Config.link_mbit,
                        help="each node's link, Mbit/s per direction")
    parser.add_argument("--mtu", type=int, default=Config.mtu, help="MTU of the simulated links (default 1500)")
    parser.add_argument("--queue-ms", type=float, default=Config.queue_ms, help="switch buffer, in ms at the link rate")
    parser.add_argument("--repeats", type=int, default=Config.repeats, help="interleaved repetitions per collective")
    parser.add_argument("--step-repeats", type=int, default=Config.step_repeats,
                        help="interleaved repetitions per reducer")
    parser.add_argument("--steps", type=int, default=Config.steps, help="timed steps per phase")
    parser.add_argument("--batch", type=int, default=Config.batch, help="samples per replica per step")
    parser.add_argument("--bucket-mb", type=float, default=Config.bucket_mb, help="gradient bucket size (MiB)")
    parser.add_argument("--quick", action="store_true", help="sizes up to 16 MiB, 3 repetitions, fewer steps")
    parser.add_argument("--only", choices=("collectives", "steps", "both"), default="both")
    add_json_argument(parser, "allreduce")
    options = parser.parse_args(argv)
    available, why = cluster_available()
    if not available:
        print(f"cannot build the simulated cluster: {why}", file=sys.stderr)
        return 2
    config = Config(link_mbit=options.link_mbit, mtu=options.mtu, queue_ms=options.queue_ms, repeats=options.repeats,
                    step_repeats=options.step_repeats, steps=options.steps, batch=options.batch,
                    bucket_mb=options.bucket_mb,
                    skip_steps=options.only == "collectives", skip_collectives=options.only == "steps")
    if options.quick:
        config = Config(**{**asdict(config), "sizes": QUICK_SIZES, "repeats": 3, "step_repeats": 3, "steps": 3})
    header = machine()
    print(f"{machine_line(header)}; {config.nodes} x {config.procs_per_node} processes share the cores", flush=True)
    # Inside a node's namespace c10d cannot reverse-resolve its peers' addresses and warns about
    # it once per connection; the processes inherit this before they import torch.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    load_before = header["load_average"][0]
    started = time.perf_counter()
    with SimulatedCluster(config.nodes, config.procs_per_node, config.link_mbit, mtu=config.mtu,
                          queue_ms=config.queue_ms) as cluster:
        # Generous: the machine may be shared; a hang still ends the run.
        results = cluster.run(cluster_job, config, timeout_s=1800.0)
        burst = cluster.burst_bytes
    summary = summarize(config, results[0])
    lines = print_tables(config, summary, results[0])
    load_after = load_average()[0]
    lines.append(f"\n1-minute load average {load_before:.2f} before, {load_after:.2f} after, on {os.cpu_count()} cores "
                 f"(this run adds {config.nodes * config.procs_per_node} processes); tbf burst {burst} B; "
                 f"{time.perf_counter() - started:.0f} s")
    print("\n".join(lines), flush=True)
    report = {"config": asdict(config), "rows": summary.rows, "steps": summary.steps, "targets": summary.targets,
              "checks": results[0].get("steps", {}).get("checks", {}),
              "load_average_1min": {"before": load_before, "after": load_after}, "tbf_burst_bytes": burst}
    write_json(options.json, report, header)
    ok = all(r["agree"] is not False for r in summary.rows)
    ok &= all(v <= 1e-4 for k, v in results[0].get("steps", {}).get("checks", {}).items() if "diff" in k)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
