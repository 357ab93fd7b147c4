"""Data-parallel throughput of replicator against torch DDP (2 processes) and a plain loop (1 process).

Command (from the repository root; a few minutes on 2 cores; figures go to
benchmarks/results/data_parallel.json):

    .venv/bin/python benchmarks/data_parallel.py --repeats 15 --steps 6 --batch 64

Both comparisons run their contenders inside the same processes on the same fixed synthetic
batches, in short phases that take turns (the order rotates every repetition), so background
load hits every contender alike; figures are medians over the repetitions. Many short
repetitions rather than a few long ones: on a shared machine the load drifts within seconds,
and only phases close in time make fair pairs. The processes keep glibc's heap between steps, as
`replicator launch` makes replicas do (`--glibc-default` turns that off for every contender).

Each replicator contender has a Replicator of its own, as a training script has one for its
model. When replicator is driven both ways, a last table gives what `repl.run` costs over
calling step_fn directly: CPU ms per step summed over both processes, paired per repetition.
Every timed phase is one run() call of `--steps` steps, so it also pays run()'s fixed cost
once (the identity checks at its start and end, which read the model and optimizer state,
and the run record): `--steps 30` shows the per-step cost with less of it. Copies of the
model can differ by a few percent between themselves, so `--only loops` drives one model and
one Replicator both ways, in turns, for the figure of the loop alone:

    .venv/bin/python benchmarks/data_parallel.py --only loops --repeats 15 --steps 6 --batch 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import (
    Spread,
    add_json_argument,
    compare,
    in_turns,
    load_average,
    machine,
    machine_line,
    ratio_text,
    slowest_rank,
    write_json,
)

import replicator as rp
from replicator.launch import heap_kept_environment
from replicator.testing import run_replicas

Batch = tuple[torch.Tensor, torch.Tensor]
Runner = Callable[[list[Batch], list[float]], None]  # (batches, stamps): runs them, stamping each step's end


@dataclass(frozen=True)
class Config:
    repeats: int = 15
    steps: int = 6  # timed steps per phase
    warmup: int = 2  # untimed steps at the start of every phase
    batch: int = 64  # per replica
    features: int = 1024
    hidden: int = 2048
    classes: int = 10
    distinct_batches: int = 8
    threads: int = 1
    loops: tuple[str, ...] = ("run", "step_fn")  # how replicator is driven; see `_replicator_runner`
    # The default ('auto': shared memory on one CPU node), and 'flat': the same Gloo all-reduce DDP uses.
    reducers: tuple[str, ...] = ("auto", "flat")
    lr: float = 0.01
    seed: int = 0
    model: str = "mlp"  # or "resnet": the demo's ResNet on 32x32 single-channel images
    ceiling: bool = False  # also time 2 processes that train alone, never communicating


def make_model(config: Config) -> torch.nn.Module:
    """An MLP of ~8.4 M parameters (enough compute per step that overheads show as a share, not
    noise), or the demo's ResNet (0.2 M parameters, convolutions and batch norm)."""
    if config.model == "resnet":
        from replicator.demo.digits import ResNet

        return ResNet(num_classes=config.classes)
    return torch.nn.Sequential(
        torch.nn.Linear(config.features, config.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(config.hidden, config.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(config.hidden, config.features),
        torch.nn.ReLU(),
        torch.nn.Linear(config.features, config.classes),
    )


def make_batches(config: Config, shard: int) -> list[Batch]:
    """This shard's fixed batches: the same on every call, different between shards."""
    generator = torch.Generator().manual_seed(1000 * config.seed + shard)
    shape = (config.batch, 1, 32, 32) if config.model == "resnet" else (config.batch, config.features)
    return [
        (
            torch.randn(*shape, generator=generator),
            torch.randint(0, config.classes, (config.batch,), generator=generator),
        )
        for _ in range(config.distinct_batches)
    ]


def make_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)


class Contender:
    """One way of training one model copy; `phase(count)` runs `count` steps on the next batches.

    Each contender walks the shared batch list with its own cursor, so after the same
    number of steps every contender has seen exactly the same data.
    """

    def __init__(self, name: str, model: torch.nn.Module, batches: list[Batch], run: Runner) -> None:
        self.name = name
        self.model = model
        self.batches = batches
        self._run = run
        self.cursor = 0

    def phase(self, count: int, stamps: list[float] | None = None) -> None:
        """Run `count` steps; append the clock after each to `stamps`."""
        chosen = [self.batches[(self.cursor + i) % len(self.batches)] for i in range(count)]
        self.cursor += count
        self._run(chosen, [] if stamps is None else stamps)


def _plain_runner(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Runner:
    """The loop a researcher writes without any library (also drives the DDP-wrapped model)."""

    def run(batches: list[Batch], stamps: list[float]) -> None:
        for images, labels in batches:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            stamps.append(time.perf_counter())

    return run


def _replicator_runner(
    repl: rp.Replicator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loop: str
) -> Runner:
    """Drive replicator through `repl.run` (the public loop) or by calling step_fn directly.

    step_fn returns the local loss, not ctx.all_mean(loss): the peers do not reduce their
    loss either, so both sides issue exactly the gradient traffic and nothing else.
    """

    def step_fn(ctx: rp.ReplicaContext, batch: Batch) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    def run(batches: list[Batch], stamps: list[float]) -> None:
        if loop == "run":
            # run() counts steps over the whole training: ask for this many more.
            for _ in repl.run(step_fn, batches, steps=repl.global_step + len(batches), progress=False, warmup_steps=0):
                stamps.append(time.perf_counter())
        else:
            for batch in batches:
                step_fn(repl.context, batch)
                stamps.append(time.perf_counter())

    return run


def _flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _interleave(contenders: list[Contender], config: Config, barrier: Callable[[], None],
                slowest: Callable[[float], float]) -> dict[str, dict[str, list[float]]]:
    """Per repetition and contender: samples/s, median step time and this process's CPU ms per step.

    The order rotates every repetition. The median step filters out the odd step another
    user's burst of work stretched; CPU time (every thread of the process, Gloo's included)
    counts work done rather than time spent descheduled or waiting, so on a shared machine
    it tells extra work from extra waiting.
    """
    samples = config.batch * (dist.get_world_size() if dist.is_initialized() else 1) * config.steps
    figures: dict[str, dict[str, list[float]]] = {c.name: {"rate": [], "step_ms": [], "cpu_ms": []} for c in contenders}
    for _, contender in in_turns(contenders, config.repeats):
        contender.phase(config.warmup)
        barrier()  # every process starts the timed steps together
        stamps: list[float] = []
        cpu_started = time.process_time()
        started = time.perf_counter()
        contender.phase(config.steps, stamps)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        steps = [later - earlier for earlier, later in zip([started, *stamps], stamps)]
        figures[contender.name]["rate"].append(samples / slowest(elapsed))
        figures[contender.name]["step_ms"].append(1e3 * statistics.median(steps))
        figures[contender.name]["cpu_ms"].append(1e3 * cpu / config.steps)
    return figures


def _threads(config: Config) -> None:
    # One intra-op thread per process by default: two processes then own one core each, and
    # no contender gains from threads the others would have to share.
    torch.set_num_threads(config.threads)


NO_COMMUNICATION = "2 processes, no communication"


def two_process_job(config: Config) -> dict[str, Any]:
    """One of the 2 processes: replicator (each reducer and loop) and DDP take turns on identical model copies."""
    _threads(config)
    torch.manual_seed(config.seed)
    replicas: dict[str, tuple[rp.Replicator, str, torch.nn.Module, torch.optim.Optimizer]] = {}
    # One Replicator per contender, as a training script has one for its model: run() checks that
    # every model in its scope is identical across replicas, and a shared scope would make the
    # `run` contender check the `step_fn` contender's model too.
    pairs = [(reducer, loop) for reducer in config.reducers
             for loop in (config.loops if reducer == config.reducers[0] else config.loops[:1])]
    repls = [rp.Replicator(reducer=reducer) for reducer, _ in pairs]
    with repls[0].scope():  # broadcasts replica 0's weights, whatever each process drew
        reference = make_model(config)
    reference.requires_grad_(False)  # never trained: the models below start from its values
    for (reducer, loop), repl in zip(pairs, repls):
        with repl.scope():
            model = make_model(config)
            model.load_state_dict(reference.state_dict())
            name = f"replicator {reducer} ({repl.reducer.name}, {loop})"
            replicas[name] = (repl, loop, model, repl.wrap_optimizer(make_optimizer(model, config)))
    rank = dist.get_rank()
    initial = _flat_parameters(reference)
    ddp_model = make_model(config)
    ddp_model.load_state_dict(reference.state_dict())
    # DDP's defaults (25 MB buckets, 1 MB first bucket, copies into buckets) are the ones
    # replicator mirrors, so the comparison is of the machinery, not of tuning.
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    batches = make_batches(config, shard=rank)
    contenders = [
        Contender(name, model, batches, _replicator_runner(repl, model, optimizer, loop))
        for name, (repl, loop, model, optimizer) in replicas.items()
    ]
    if config.ceiling:
        alone = make_model(config)
        alone.load_state_dict(reference.state_dict())
        alone_runner = _plain_runner(alone, make_optimizer(alone, config))
        contenders.append(Contender(NO_COMMUNICATION, alone, batches, alone_runner))
    contenders.append(Contender("torch DDP", ddp_model, batches, _plain_runner(ddp, make_optimizer(ddp, config))))

    # The job is as fast as its slowest process.
    figures = _interleave(contenders, config, dist.barrier, slowest_rank)

    checks: dict[str, float] = {}
    ddp_flat = _flat_parameters(ddp_model)
    for contender in contenders:
        if not contender.name.startswith("replicator"):
            continue
        mine = _flat_parameters(contender.model)
        checks[f"{contender.name} vs torch DDP: max |diff|"] = float((mine - ddp_flat).abs().max())
        first = mine.clone()
        dist.broadcast(first, src=0)  # replicas of one contender must be identical, bit for bit
        if rank != 0:
            checks[f"{contender.name}: replica {rank} vs replica 0, max |diff|"] = float((mine - first).abs().max())
    # Without this, "no difference" could also mean "nobody trained".
    checks["torch DDP: max |change since start|"] = float((ddp_flat - initial).abs().max())
    backend = dist.get_backend()
    for repl in reversed(repls):
        repl.close()
    return {"figures": figures, "checks": checks, "backend": backend, "rank": rank}


def loops_job(config: Config) -> dict[str, Any]:
    """One of 2 processes: one Replicator and one model, trained in turns through repl.run and by calling step_fn.

    Both loops drive the very same model, optimizer and reducer, so what differs between their
    phases is the loop alone: separate copies, even of the same model, can differ by a few
    percent in speed between themselves, more than what run() adds per step.
    """
    _threads(config)
    torch.manual_seed(config.seed)
    repl = rp.Replicator(reducer=config.reducers[0])
    with repl.scope():
        model = make_model(config)
        optimizer = repl.wrap_optimizer(make_optimizer(model, config))
    rank = dist.get_rank()
    initial = _flat_parameters(model)
    batches = make_batches(config, shard=rank)
    contenders = [Contender(loop, model, batches, _replicator_runner(repl, model, optimizer, loop))
                  for loop in ("run", "step_fn")]
    figures = _interleave(contenders, config, dist.barrier, slowest_rank)
    mine = _flat_parameters(model)
    checks = {"max |change since start|": float((mine - initial).abs().max())}
    first = mine.clone()
    dist.broadcast(first, src=0)
    if rank != 0:
        checks["replica vs replica 0, max |diff|"] = float((mine - first).abs().max())
    repl.close()
    return {"figures": figures, "checks": checks, "rank": rank}


def one_process_job(config: Config) -> dict[str, Any]:
    """This process alone (no launcher variables): 1 replica (each loop) against a plain loop."""
    _threads(config)
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        os.environ.pop(name, None)  # "run plainly": replicator must see a single process
    repl = rp.Replicator()
    torch.manual_seed(config.seed)
    reference = make_model(config)
    with repl.scope():
        replicas = {}
        for loop in config.loops:
            model = make_model(config)
            model.load_state_dict(reference.state_dict())
            replicas[loop] = (model, repl.wrap_optimizer(make_optimizer(model, config)))
    plain = make_model(config)
    plain.load_state_dict(reference.state_dict())
    initial = _flat_parameters(reference)
    batches = make_batches(config, shard=0)
    contenders = [
        Contender(f"1 replica ({loop})", model, batches, _replicator_runner(repl, model, optimizer, loop))
        for loop, (model, optimizer) in replicas.items()
    ]
    plain_runner = _plain_runner(plain, make_optimizer(plain, config))
    contenders.append(Contender("plain PyTorch loop", plain, batches, plain_runner))
    figures = _interleave(contenders, config, lambda: None, lambda seconds: seconds)
    plain_flat = _flat_parameters(plain)
    checks = {
        f"{c.name} vs plain PyTorch loop: max |diff|": float((_flat_parameters(c.model) - plain_flat).abs().max())
        for c in contenders[:-1]
    }
    moved = float((plain_flat - initial).abs().max())
    return {"figures": figures, "checks": checks, "moved": moved, "distributed": dist.is_initialized()}


def _table(title: str, figures: dict[str, dict[str, list[float]]], peer: str, samples_per_step: int) -> list[str]:
    """Medians over repetitions. 'Paired' is the median of (this / peer) within each repetition,
    which cancels load that drifts more slowly than one repetition."""
    lines = [
        f"\n{title}", "",
        "| contender | samples/s (median of phases) | range | ratio of medians | median paired ratio "
        "| samples/s at median step | ratio | CPU ms/step (rank 0) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rates = compare({name: figure["rate"] for name, figure in figures.items()}, peer)
    peer_step = statistics.median(figures[peer]["step_ms"])
    for name, figure in figures.items():
        rate, step = rates[name], statistics.median(figure["step_ms"])
        step_ratio = "(peer)" if name == peer else f"{peer_step / step:.3f}"
        lines.append(
            f"| {name} | {rate.spread.median:,.0f} | {rate.spread.min:,.0f}–{rate.spread.max:,.0f} "
            f"| {ratio_text(rate.ratio_of_medians)} | {ratio_text(rate.paired)} "
            f"| {1e3 * samples_per_step / step:,.0f} | {step_ratio} | {statistics.median(figure['cpu_ms']):.1f} |"
        )
    return lines


def _describe(config: Config) -> str:
    if config.model == "resnet":
        return "the demo's ResNet (2 basic blocks per stage, 16-32-64 channels) on 1x32x32 images"
    return f"MLP {config.features}-{config.hidden}-{config.hidden}-{config.features}-{config.classes}"


def _against_ceiling(figures: dict[str, dict[str, list[float]]]) -> list[str]:
    """Each synchronizing contender as a share of processes that never communicate, paired per repetition."""
    shares = compare({name: figure["rate"] for name, figure in figures.items()}, NO_COMMUNICATION)
    lines = ["", f"Share of '{NO_COMMUNICATION}' (median paired ratio; the efficiency left after communication):"]
    for name, share in shares.items():
        if share.paired is not None:
            lines.append(f"  {name}: {share.paired:.3f}")
    return lines


def _loop_pairs(names: list[str]) -> list[tuple[str, str, str]]:
    """(label, run contender, step_fn contender) for each reducer timed both ways."""
    return [(name.removeprefix("replicator ").removesuffix(", run)") + ")", name,
             name.removesuffix(", run)") + ", step_fn)")
            for name in names if name.endswith(", run)") and name.removesuffix(", run)") + ", step_fn)" in names]


def _run_against_step_fn(per_rank: list[dict[str, dict[str, list[float]]]],
                         pairs: list[tuple[str, str, str]]) -> tuple[list[str], dict[str, Any]]:
    """What `repl.run` adds over calling step_fn directly: CPU ms per step summed over the processes.

    Both contenders train on the same batches with the same reducer, in turns; the ratio is paired
    within each repetition. CPU time, not wall time: on a shared machine it counts the work each
    loop does rather than the time it waited for the cores.
    """
    lines: list[str] = []
    figures: dict[str, Any] = {}
    for label, name, direct in pairs:
        run_cpu = [sum(rank[name]["cpu_ms"][i] for rank in per_rank) for i in range(len(per_rank[0][name]["cpu_ms"]))]
        direct_cpu = [sum(rank[direct]["cpu_ms"][i] for rank in per_rank)
                      for i in range(len(per_rank[0][direct]["cpu_ms"]))]
        ratios = [r / d for r, d in zip(run_cpu, direct_cpu, strict=True)]
        run_spread, direct_spread, ratio_spread = Spread.of(run_cpu), Spread.of(direct_cpu), Spread.of(ratios)
        figures[label] = {"run_cpu_ms": run_cpu, "step_fn_cpu_ms": direct_cpu, "paired_ratio": ratios}
        lines += [
            "",
            f"repl.run against step_fn called directly, {label}: CPU ms per step, all {len(per_rank)} processes summed",
            f"  repl.run: median {run_spread.median:.2f} ({run_spread.min:.2f}-{run_spread.max:.2f})",
            f"  step_fn:  median {direct_spread.median:.2f} ({direct_spread.min:.2f}-{direct_spread.max:.2f})",
            f"  run / step_fn, paired per repetition: median {ratio_spread.median:.3f} "
            f"({ratio_spread.min:.3f}-{ratio_spread.max:.3f}), {100 * (ratio_spread.median - 1):+.1f} %",
        ]
    return lines, figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=Config.repeats, help="interleaved repetitions per contender")
    parser.add_argument("--steps", type=int, default=Config.steps, help="timed steps per repetition")
    parser.add_argument("--warmup", type=int, default=Config.warmup, help="untimed steps before each timed phase")
    parser.add_argument("--batch", type=int, default=Config.batch, help="samples per replica per step")
    parser.add_argument("--hidden", type=int, default=Config.hidden, help="MLP width (parameters grow as its square)")
    parser.add_argument("--model", choices=("mlp", "resnet"), default=Config.model,
                        help="the MLP, or the demo's ResNet on 32x32 images (batch 128 is the demo's)")
    parser.add_argument("--ceiling", action="store_true",
                        help="also time 2 processes training alone, never communicating: "
                             "the most any contender can reach")
    parser.add_argument("--threads", type=int, default=Config.threads, help="torch threads per process")
    parser.add_argument("--loop", choices=("run", "step_fn", "both"), default="both",
                        help="drive replicator with repl.run(progress=False), by calling step_fn directly, or both")
    parser.add_argument("--reducers", default=",".join(Config.reducers),
                        help="comma-separated replicator reducers to time against DDP "
                             "(the first also with every --loop)")
    parser.add_argument("--only", choices=("2", "1", "both", "loops"), default="both",
                        help="which comparison to run; 'loops': repl.run against step_fn on one model and one "
                             "Replicator (2 processes)")
    add_json_argument(parser, "data_parallel")
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave glibc's heap settings at their defaults "
                             "instead of keeping the heap as the launcher does")
    options = parser.parse_args(argv)
    if options.repeats < 1 or options.steps < 1 or options.warmup < 0 or options.batch < 1:
        parser.error("--repeats, --steps and --batch must be positive and --warmup non-negative")
    config = Config(
        repeats=options.repeats, steps=options.steps, warmup=options.warmup, batch=options.batch,
        hidden=options.hidden, threads=options.threads, model=options.model, ceiling=options.ceiling,
        loops=("run", "step_fn") if options.loop == "both" else (options.loop,),
        reducers=tuple(name.strip() for name in options.reducers.split(",") if name.strip()),
    )
    parameters = sum(p.numel() for p in make_model(config).parameters())
    header = machine()
    drivers = ["repl.run(progress=False)" if loop == "run" else "step_fn called directly" for loop in config.loops]
    print(
        f"{machine_line(header)}\n"
        f"{_describe(config)} ({parameters / 1e6:.1f} M parameters), batch {config.batch} per replica, "
        f"{config.threads} thread(s) per "
        f"process, {config.repeats} repetitions x {config.steps} timed steps (+{config.warmup} warm-up), "
        f"replicator driven by: {', '.join(drivers)}",
        flush=True,
    )
    if not options.glibc_default:
        # The processes run as `replicator launch` runs replicas, the allocator included; DDP's
        # contender lives in the same processes, so it gets the same heap.
        heap = heap_kept_environment()
        os.environ.update(heap)  # before the first run_replicas starts its forkserver, which reads it
        print(f"glibc heap kept between steps, as `replicator launch` does: {heap or 'your own allocator settings'}")
    # Other people's work on the machine is the main source of noise; say how much there was.
    load_before = load_average()[0]
    report: dict[str, Any] = {
        "config": asdict(config), "parameters": parameters, "heap_kept": not options.glibc_default,
    }
    lines: list[str] = []
    healthy = True
    if options.only in ("2", "both"):
        started = time.perf_counter()
        # Generous timeout: the machine may be shared, and a hang still ends the run.
        results = run_replicas(two_process_job, 2, config, timeout_s=60.0 + 30.0 * config.repeats * config.steps)
        first = results[0]
        report["two_processes"] = {
            "figures_rank0": first["figures"],
            "cpu_ms_rank1": {k: v["cpu_ms"] for k, v in results[1]["figures"].items()},
            "checks": [r["checks"] for r in results], "backend": first["backend"],
        }
        lines += _table(f"2 processes ({first['backend']}, 127.0.0.1), global batch {2 * config.batch}:",
                        first["figures"], "torch DDP", 2 * config.batch)
        if config.ceiling:
            lines += _against_ceiling(first["figures"])
        overhead_lines, report["two_processes"]["run_against_step_fn"] = _run_against_step_fn(
            [result["figures"] for result in results], _loop_pairs(list(first["figures"])))
        lines += overhead_lines
        for result in results:
            for name, value in result["checks"].items():
                lines.append(f"  check, rank {result['rank']}: {name} = {value:.3g}")
        worst = max(v for r in results for k, v in r["checks"].items() if "diff" in k)
        ok = worst <= 1e-4 and all(r["checks"]["torch DDP: max |change since start|"] > 1e-6 for r in results)
        healthy &= ok
        lines.append(f"  parameters trained and agree after the timed runs (tolerance 1e-4): {'yes' if ok else 'NO'}")
        lines.append(f"  ({time.perf_counter() - started:.0f} s)")
    if options.only == "loops":
        started = time.perf_counter()
        results = run_replicas(loops_job, 2, config, timeout_s=60.0 + 30.0 * config.repeats * config.steps)
        label = f"one model and one Replicator ({config.reducers[0]}), driven both ways in turns"
        loop_lines, report["loops"] = _run_against_step_fn([result["figures"] for result in results],
                                                           [(label, "run", "step_fn")])
        lines += loop_lines
        for result in results:
            for name, value in result["checks"].items():
                lines.append(f"  check, rank {result['rank']}: {name} = {value:.3g}")
        ok = all(r["checks"]["max |change since start|"] > 1e-6 for r in results) and \
            all(r["checks"].get("replica vs replica 0, max |diff|", 0.0) == 0.0 for r in results)
        healthy &= ok
        lines.append(f"  parameters trained and identical on both replicas: {'yes' if ok else 'NO'}")
        lines.append(f"  ({time.perf_counter() - started:.0f} s)")
    if options.only in ("1", "both"):
        started = time.perf_counter()
        single = one_process_job(config)
        report["one_process"] = single
        where = "with a process group (unexpected)" if single["distributed"] else "run plainly, no process group"
        lines += _table(f"1 process ({where}), batch {config.batch}:",
                        single["figures"], "plain PyTorch loop", config.batch)
        for name, value in single["checks"].items():
            lines.append(f"  check: {name} = {value:.3g}")
        lines.append(f"  check: plain PyTorch loop: max |change since start| = {single['moved']:.3g}")
        ok = all(v == 0.0 for v in single["checks"].values()) and single["moved"] > 1e-6
        healthy &= ok
        lines.append(f"  parameters trained and identical to the plain loop's: {'yes' if ok else 'NO'}")
        lines.append(f"  ({time.perf_counter() - started:.0f} s)")
    load_after = load_average()[0]
    report["load_average_1min"] = {"before": load_before, "after": load_after}
    lines.append(
        f"\n1-minute load average: {load_before:.2f} before, {load_after:.2f} after, on {os.cpu_count()} cores "
        "(this job adds up to 2). Work of others competing for the cores makes wall-clock figures noisy; "
        "CPU ms/step is the steadier measure of the work each contender does."
    )
    print("\n".join(lines), flush=True)
    write_json(options.json, report, header)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
