"""Every pipeline schedule against torch.distributed.pipelining's same-named one, and its bubble against theory.

Command (from the repository root; a few minutes on 2 cores; figures go to
benchmarks/results/pipeline_schedules.json; `benchmarks/pipeline.py --schedules` runs it too):

    .venv/bin/python benchmarks/pipeline_schedules.py --repeats 5 --steps 5

One job of 2 processes (Gloo on 127.0.0.1, 1 intra-op thread each) trains a deep MLP in
K = 2 stages with M = 8 micro-batches. Pairs, each on the same split of the same layers,
the same micro-batches and the same loss (cross-entropy averaged per micro-batch):

    gpipe                  <-> ScheduleGPipe
    1f1b                   <-> Schedule1F1B
    interleaved, V = 2     <-> ScheduleInterleaved1F1B (2 stages per rank)
    zero_bubble, V = 2     <-> ScheduleInterleavedZeroBubble (2 stages per rank)
    zero_bubble, V = 1     (ZB-H1; torch's zero-bubble schedules need 2 stages per rank)

With V = 2 the model is cut into 4 pieces and rank r holds pieces r and r + 2, for both
contenders. The contenders take turns phase after phase, the order rotating every
repetition; throughput figures are medians over repetitions and ratios are paired within a
repetition (benchmarks/_harness.py). The measured bubble is read from replicator's
timeline: 1 - (the stages' compute time) / (2 x the span from the first action to the
last), per timed step. The theoretical bubble is what the same schedule gives in
`timed_simulation` with this step's measured per-stage forward, backward (or input- and
weight-gradient) times and instant messages; the formula with unit costs is shown too.
First, from identical weights and one batch, every pair computes the same loss (checked).
"""

from __future__ import annotations

import argparse
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
    in_turns,
    load_average,
    machine,
    machine_line,
    paired_ratio,
    slowest_rank,
    write_json,
)
from torch import nn

import replicator as rp
from replicator.pipeline import build_pipeline
from replicator.pipeline.schedule import Op, make_schedule, simulated_bubble, timed_simulation
from replicator.pipeline.timeline import Event, measured_bubble
from replicator.testing import run_replicas

STAGES = 2
Batch = tuple[torch.Tensor, torch.Tensor]
# (our schedule, virtual stages, torch's class or None)
PAIRS = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"), ("interleaved", 2, "ScheduleInterleaved1F1B"),
         ("zero_bubble", 2, "ScheduleInterleavedZeroBubble"), ("zero_bubble", 1, None)]


@dataclass(frozen=True)
class Config:
    repeats: int = 5
    steps: int = 5  # timed steps per phase
    warmup: int = 1
    chunks: int = 8
    microbatch: int = 64
    width: int = 512
    blocks: int = 16
    classes: int = 10
    lr: float = 0.01

    def balance(self, pieces: int) -> list[int]:
        layers = self.blocks + 1
        counts = [layers // pieces] * pieces
        counts[-1] += layers - sum(counts)
        return counts


def make_layers(config: Config) -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(config.width, config.width), nn.ReLU()) for _ in range(config.blocks)]
    return [*blocks, nn.Linear(config.width, config.classes)]


def make_batches(config: Config) -> list[Batch]:
    generator = torch.Generator().manual_seed(1000)
    size = config.chunks * config.microbatch
    return [(torch.randn(size, config.width, generator=generator),
             torch.randint(0, config.classes, (size,), generator=generator)) for _ in range(3)]


def pieces_of(config: Config, virtual_stages: int, rank: int) -> list[nn.Sequential]:
    counts = config.balance(STAGES * virtual_stages)
    layers, starts = make_layers(config), [sum(counts[:p]) for p in range(len(counts))]
    return [nn.Sequential(*layers[starts[p]:starts[p] + counts[p]]) for p in range(rank, len(counts), STAGES)]


class Contender:
    def __init__(self, name: str, step: Callable[[Batch], float]) -> None:
        self.name, self.step, self.cursor = name, step, 0

    def phase(self, batches: list[Batch], count: int) -> None:
        for _ in range(count):
            self.step(batches[self.cursor % len(batches)])
            self.cursor += 1


recording = [False]


def ours(repl: rp.Replicator, config: Config, schedule: str, virtual_stages: int,
         steps: list[list[Event]]) -> Contender:
    pipe = build_pipeline(make_layers(config), stage_id=repl.stage_id, num_stages=STAGES,
                          balance=config.balance(STAGES * virtual_stages), stage_ranks=repl.groups.stage_ranks,
                          stage_group=repl.groups.stage, chunks=config.chunks, schedule=schedule, recompute="never",
                          virtual_stages=virtual_stages)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=config.lr, momentum=0.9)

    def step(batch: Batch) -> float:
        optimizer.zero_grad()
        loss = float(pipe.train_step(batch[0], batch[1], F.cross_entropy))
        optimizer.step()
        if recording[0]:
            steps.append(list(pipe.timeline.events))
        return loss

    return Contender(f"replicator {schedule}" + (f" V={virtual_stages}" if virtual_stages > 1 else ""), step)


def theirs(config: Config, cls: str, virtual_stages: int) -> Contender:
    from torch.distributed import pipelining

    rank = dist.get_rank()
    modules = pieces_of(config, virtual_stages, rank)
    stages = [pipelining.PipelineStage(module, rank + STAGES * v, STAGES * virtual_stages, torch.device("cpu"))
              for v, module in enumerate(modules)]
    kind = getattr(pipelining, cls)
    schedule = kind(stages if virtual_stages > 1 else stages[0], n_microbatches=config.chunks,
                    loss_fn=F.cross_entropy, scale_grads=True)
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=config.lr, momentum=0.9)

    def step(batch: Batch) -> float:
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(batch[0])
        else:
            schedule.step(target=batch[1], losses=losses)
        optimizer.step()
        return float(torch.stack(losses).detach().mean()) if losses else 0.0

    return Contender(f"torch {cls}", step)


def stage_times(events: list[Event], chunks: int) -> dict[str, float]:
    """Seconds per micro-batch of each compute kind, through all of this stage's chunks."""
    return {op.value: sum(e.end - e.start for e in events if e.op == op.value) / chunks
            for op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)}


def job(config: Config) -> dict[str, Any]:
    torch.set_num_threads(1)
    repl = rp.Replicator(stages=STAGES, chunks=config.chunks)
    rank = dist.get_rank()
    batches = make_batches(config)
    timelines: dict[str, list[list[Event]]] = {}
    contenders: list[Contender] = []
    peer_of: dict[str, str] = {}
    for schedule, V, cls in PAIRS:
        mine = ours(repl, config, schedule, V, timelines.setdefault(f"{schedule} V={V}", []))
        contenders.append(mine)
        if cls is not None:
            contenders.append(theirs(config, cls, V))
            peer_of[mine.name] = contenders[-1].name
    # The same first step from identical weights: each pair's loss (the last rank computes it).
    sanity = {c.name: c.step(batches[0]) for c in contenders}
    rates: dict[str, list[float]] = {c.name: [] for c in contenders}
    for _, contender in in_turns(contenders, config.repeats):
        contender.phase(batches, config.warmup)
        dist.barrier()
        recording[0] = True
        started = time.perf_counter()
        contender.phase(batches, config.steps)
        elapsed = slowest_rank(time.perf_counter() - started)
        recording[0] = False
        rates[contender.name].append(config.chunks * config.microbatch * config.steps / elapsed)
    gathered: list[Any] = [None] * STAGES
    dist.all_gather_object(gathered, timelines)
    repl.close()
    return {"rank": rank, "rates": rates, "peer_of": peer_of, "sanity": sanity,
            "timelines": gathered if rank == 0 else None}


def bubbles(config: Config, per_rank: list[dict[str, list[list[Event]]]], name: str) -> dict[str, float]:
    schedule_name, V = name.split(" V=")
    schedule = make_schedule(schedule_name, STAGES, config.chunks, int(V))
    measured, simulated = [], []
    idle: dict[str, list[float]] = {"receives": [], "sends": [], "between actions": [], "before and after": []}
    for steps in zip(*(timelines[name] for timelines in per_rank), strict=True):
        events = [e for stage_events in steps for e in stage_events]
        measured.append(measured_bubble(events))
        for part, share in idle_parts(events, len(steps)).items():
            idle[part].append(share)
        times = [stage_times(stage_events, config.chunks) for stage_events in steps]
        placed = timed_simulation(
            schedule, [t["forward"] for t in times], [t["backward"] for t in times],
            input_time=[t["backward_input"] for t in times], weight_time=[t["backward_weight"] for t in times])
        simulated.append(simulated_bubble(placed))
    unit = simulated_bubble(timed_simulation(schedule, 1.0, 2.0))
    return {"measured": statistics.median(measured), "theory (measured stage times)": statistics.median(simulated),
            "theory (unit costs)": unit, "min measured": min(measured), "max measured": max(measured),
            **{f"idle in {part}": statistics.median(shares) for part, shares in idle.items()}}


def idle_parts(events: list[Event], stages: int) -> dict[str, float]:
    """Where a step's time outside forwards and backwards went, as shares of (stages x span).

    Before and after: a stage's time in the span before its first action or after its last
    (part of the schedule's own bubble: the last stage starts late, the first ends late).
    """
    first, last = min(e.start for e in events), max(e.end for e in events)
    span = stages * (last - first)
    rows = {e.stage for e in events}
    edges = sum(min(e.start for e in events if e.stage == s) - first + last - max(e.end for e in events if e.stage == s)
                for s in rows) / span
    receives = sum(e.end - e.start for e in events if e.op.startswith("recv")) / span
    sends = sum(e.end - e.start for e in events if e.op.startswith("send")) / span
    compute = sum(e.end - e.start for e in events if e.is_compute) / span
    return {"receives": receives, "sends": sends, "between actions": 1 - compute - receives - sends - edges,
            "before and after": edges}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=Config.repeats)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--warmup", type=int, default=Config.warmup)
    parser.add_argument("--microbatch", type=int, default=Config.microbatch)
    parser.add_argument("--width", type=int, default=Config.width)
    add_json_argument(parser, "pipeline_schedules")
    options = parser.parse_args(argv)
    config = Config(repeats=options.repeats, steps=options.steps, warmup=options.warmup,
                    microbatch=options.microbatch, width=options.width)
    header = machine()
    print(f"{machine_line(header)}\nMLP of {config.blocks} Linear({config.width}, {config.width})+ReLU blocks and a "
          f"head, {STAGES} stages x {config.chunks} micro-batches of {config.microbatch}; 1 thread per process",
          flush=True)
    load_before, started = load_average(), time.perf_counter()
    results = run_replicas(job, STAGES, config, timeout_s=3600.0)
    elapsed, load_after = time.perf_counter() - started, load_average()
    first = results[0]
    rates, peer_of = first["rates"], first["peer_of"]
    lines = ["", f"throughput, {config.steps} steps x {config.repeats} repetitions (samples/s, medians):", "",
             "| contender | median | min | max | vs torch's same-named (median paired) | target >= 1.05 |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    summary: dict[str, Any] = {"rates": {}, "ratios": {}, "bubbles": {}}
    for name, values in rates.items():
        spread = Spread.of(values)
        summary["rates"][name] = asdict(spread)
        ratio = paired_ratio(values, rates[peer_of[name]]) if name in peer_of else None
        verdict = "" if ratio is None else ("met" if ratio >= 1.05 else "MISSED")
        if ratio is not None:
            summary["ratios"][name] = ratio
        lines.append(f"| {name} | {spread.median:,.0f} | {spread.min:,.0f} | {spread.max:,.0f} | "
                     f"{'' if ratio is None else f'{ratio:.3f}'} | {verdict} |")
    lines += ["", "bubble (replicator; medians over timed steps; target: measured within 5 points of theory):", "",
              "| schedule | measured | min | max | theory, measured stage times | theory, unit costs | target |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for schedule, V, _ in PAIRS:
        name = f"{schedule} V={V}"
        b = bubbles(config, first["timelines"], name)
        summary["bubbles"][name] = b
        gap = abs(b["measured"] - b["theory (measured stage times)"])
        lines.append(f"| {name} | {b['measured']:.1%} | {b['min measured']:.1%} | {b['max measured']:.1%} | "
                     f"{b['theory (measured stage times)']:.1%} | {b['theory (unit costs)']:.1%} | "
                     f"{'met' if gap <= 0.05 else 'MISSED'} ({100 * gap:.1f} points) |")
    lines += ["", "where the measured bubble goes (medians, shares of the stages' time): waiting in receives, "
              "packing and starting sends, between actions (posting receives, Python), before a stage's first "
              "action and after its last:", ""]
    for schedule, V, _ in PAIRS:
        b = summary["bubbles"][f"{schedule} V={V}"]
        lines.append(f"  {schedule} V={V}: receives {b['idle in receives']:.1%}, sends {b['idle in sends']:.1%}, "
                     f"between actions {b['idle in between actions']:.1%}, "
                     f"before and after {b['idle in before and after']:.1%}")
    lower = summary["bubbles"]["interleaved V=2"]["measured"] < summary["bubbles"]["1f1b V=1"]["measured"]
    lines += ["", f"interleaving (V = 2) lowers the measured bubble against 1F1B at M = {config.chunks}: "
              f"{summary['bubbles']['interleaved V=2']['measured']:.1%} vs "
              f"{summary['bubbles']['1f1b V=1']['measured']:.1%} -> {'met' if lower else 'MISSED'}"]
    last = results[-1]["sanity"]
    agree = all(abs(last[name] - last[peer]) < 1e-4 for name, peer in peer_of.items())
    lines += ["", "first step, same weights and batch, loss (last stage): "
              + ", ".join(f"{name} {value:.6f}" for name, value in last.items()),
              f"every pair agrees (1e-4): {'yes' if agree else 'NO'}",
              f"\n{elapsed:.0f} s; load average (1, 5, 15 min) before " + "/".join(f"{x:.1f}" for x in load_before)
              + ", after " + "/".join(f"{x:.1f}" for x in load_after)]
    print("\n".join(lines), flush=True)
    summary["machine"] = {"load before": load_before, "load after": load_after, "seconds": elapsed}
    write_json(options.json, {"config": asdict(config), "summary": summary, "sanity": last}, header)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
