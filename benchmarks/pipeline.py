"""GPipe throughput, bubble and memory: replicator against torch.distributed.pipelining and one process.

Command (from the repository root; a few minutes on 2 cores; figures go to
benchmarks/results/pipeline.json):

    .venv/bin/python benchmarks/pipeline.py --repeats 5 --steps 10
    .venv/bin/python benchmarks/pipeline.py --schedules   # each schedule vs torch's (pipeline_schedules.py)

One job of 2 processes (Gloo on 127.0.0.1, 1 intra-op thread each) trains a deep MLP split
into 2 stages with M = 8 micro-batches per mini-batch. Inside that job the contenders take
turns, phase after phase, the order rotating every repetition, so background load hits
them alike; figures are medians over the repetitions:

- replicator, recompute="never" (the throughput contender) and recompute="always";
- torch.distributed.pipelining: PipelineStage + ScheduleGPipe on the same split modules,
  the same micro-batches and the same loss (cross-entropy averaged per micro-batch);
- one process, 1 thread, the whole model: on the whole mini-batch, and on its 8
  micro-batches one after another (gradient accumulation) — rank 1 idles meanwhile.

First, from identical weights and one batch, the three compute the same loss and gradients
(checked). The bubble is read from replicator's timeline (the forward/backward actions each
stage recorded): a stage's idle share of the step. Memory is the peak of tensor bytes held
by PyTorch's CPU allocator during one forward+backward, above the level at its start, from
the profiler's allocation events (torch.profiler, profile_memory=True), each case in a fresh
pair of processes. CPU time per step (all threads, Gloo's I/O threads shown apart) and how
busy the machine was (with the load average before and after) tell how much of the 2 cores
the job really had; replicator's point-to-point messages per step are counted too.
"""

from __future__ import annotations

import argparse
import gc
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
    busy_cpu_seconds,
    gloo_thread_seconds,
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
from replicator.pipeline.schedule import gpipe, simulated_bubble, timed_simulation
from replicator.pipeline.timeline import Event
from replicator.testing import run_replicas

Batch = tuple[torch.Tensor, torch.Tensor]
STAGES = 2


@dataclass(frozen=True)
class Config:
    repeats: int = 5
    steps: int = 10  # timed steps per phase
    warmup: int = 2  # untimed steps at the start of every phase
    chunks: int = 8  # M
    microbatch: int = 128  # samples per micro-batch; the mini-batch is chunks * microbatch
    width: int = 512
    blocks: int = 16  # Linear+ReLU blocks; the two stages get half each (the last also the head)
    classes: int = 10
    distinct_batches: int = 4
    lr: float = 0.01
    seed: int = 0
    split: tuple[int, ...] | None = None  # layers per stage; None: half the blocks each, the head on the last

    @property
    def batch(self) -> int:
        return self.chunks * self.microbatch

    @property
    def balance(self) -> list[int]:
        if self.split is not None:
            return list(self.split)
        return [self.blocks // 2, self.blocks - self.blocks // 2 + 1]


def make_layers(config: Config) -> list[nn.Module]:
    """The whole model as a list of layers (each takes the previous one's output), identical on every call."""
    torch.manual_seed(config.seed)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(config.width, config.width), nn.ReLU()) for _ in range(config.blocks)
    ]
    return [*blocks, nn.Linear(config.width, config.classes)]


def make_batches(config: Config) -> list[Batch]:
    """Fixed synthetic mini-batches, the same in every process (stage 0 reads x, stage 1 reads y)."""
    generator = torch.Generator().manual_seed(1000 + config.seed)
    return [
        (torch.randn(config.batch, config.width, generator=generator),
         torch.randint(0, config.classes, (config.batch,), generator=generator))
        for _ in range(config.distinct_batches)
    ]


def stage_slice(config: Config, stage: int) -> slice:
    start = sum(config.balance[:stage])
    return slice(start, start + config.balance[stage])


class Contender:
    """One way of training; `phase(count)` runs `count` steps on the next batches (its own cursor)."""

    def __init__(self, name: str, step: Callable[[Batch], None], processes: int) -> None:
        self.name = name
        self.step = step
        self.processes = processes
        self.cursor = 0

    def phase(self, batches: list[Batch], count: int) -> None:
        for _ in range(count):
            self.step(batches[self.cursor % len(batches)])
            self.cursor += 1


# -- the contenders --------------------------------------------------------------------------

recording = [False]  # set while a timed phase runs, so warm-up steps are not recorded


def make_optimizer(module: Any, config: Config) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=config.lr, momentum=0.9)


def replicator_contender(pipe: Any, optimizer: torch.optim.Optimizer, name: str,
                         record: list[tuple[float, float, list[Event]]] | None) -> Contender:
    """The body of a user's step_fn; `record` collects each timed step's window and timeline events."""

    def step(batch: Batch) -> None:
        started = time.time()
        optimizer.zero_grad()
        pipe.train_step(batch[0], batch[1], F.cross_entropy)
        optimizer.step()
        if record is not None and recording[0]:
            record.append((started, time.time(), list(pipe.timeline.events)))

    return Contender(name, step, processes=2)


def torch_contender(module: nn.Module, stage_index: int, config: Config) -> tuple[Contender, Any, Any]:
    """torch.distributed.pipelining's ScheduleGPipe over the same stage module."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = PipelineStage(module, stage_index, STAGES, torch.device("cpu"))
    # scale_grads=True divides by M: with a loss averaged per micro-batch the gradients are
    # those of the whole mini-batch, as in replicator's reduction="mean".
    schedule = ScheduleGPipe(stage, n_microbatches=config.chunks, loss_fn=F.cross_entropy, scale_grads=True)
    optimizer = make_optimizer(module, config)

    def step(batch: Batch) -> None:
        optimizer.zero_grad()
        if stage_index == 0:
            schedule.step(batch[0])
        else:
            schedule.step(target=batch[1], losses=[])
        optimizer.step()

    return Contender("torch ScheduleGPipe", step, processes=2), schedule, optimizer


def single_contender(model: nn.Module, config: Config, split: bool) -> Contender:
    """One process, the whole model: the plain loop, on the mini-batch or on its micro-batches in turn."""
    optimizer = make_optimizer(model, config)

    def step(batch: Batch) -> None:
        optimizer.zero_grad()
        if split:
            for x, y in zip(batch[0].chunk(config.chunks), batch[1].chunk(config.chunks)):
                (F.cross_entropy(model(x), y) / config.chunks).backward()
        else:
            F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()

    name = f"1 process, {config.chunks} micro-batches accumulated" if split else "1 process, whole batch"
    return Contender(name, step, processes=1)


# -- checks ----------------------------------------------------------------------------------


def first_step_sanity(repl: rp.Replicator, config: Config, batch: Batch) -> dict[str, float]:
    """From identical weights and the same batch: the loss and this stage's gradients of every contender."""
    mine = stage_slice(config, repl.stage_id)
    pipe = build_pipeline(
        make_layers(config), stage_id=repl.stage_id, num_stages=STAGES, balance=config.balance,
        stage_ranks=repl.groups.stage_ranks, stage_group=repl.groups.stage, chunks=config.chunks, recompute="never",
    )
    loss = float(pipe.train_step(batch[0], batch[1], F.cross_entropy))
    ours = [p.grad.clone() for p in pipe.parameters()]

    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    module = nn.Sequential(*make_layers(config)[mine])
    schedule = ScheduleGPipe(PipelineStage(module, repl.stage_id, STAGES, torch.device("cpu")),
                             n_microbatches=config.chunks,
                             loss_fn=F.cross_entropy)
    losses: list[torch.Tensor] = []
    if repl.stage_id == 0:
        schedule.step(batch[0])
    else:
        schedule.step(target=batch[1], losses=losses)
    theirs = [p.grad.clone() for p in module.parameters()]
    peer_loss = torch.tensor([float(torch.stack(losses).detach().mean()) if losses else 0.0], dtype=torch.float64)
    dist.all_reduce(peer_loss)  # only the last stage holds the micro-batch losses

    whole = nn.Sequential(*make_layers(config))
    single = F.cross_entropy(whole(batch[0]), batch[1])
    single.backward()
    single_loss = float(single.detach())
    reference = [p.grad for p in whole[mine].parameters()]
    return {
        "replicator loss": loss,
        "torch ScheduleGPipe loss": float(peer_loss),
        "1 process loss": single_loss,
        "|replicator - ScheduleGPipe| loss": abs(loss - float(peer_loss)),
        "|replicator - 1 process| loss": abs(loss - single_loss),
        "max |grad replicator - ScheduleGPipe|": _largest_difference(ours, theirs),
        "max |grad replicator - 1 process|": _largest_difference(ours, reference),
    }


def _largest_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))


def peak_memory(step: Callable[[], None]) -> float:
    """MB: the peak of live CPU-allocator bytes during `step()`, above the level when it started.

    Call it once per process: the allocator keeps the sizes of blocks allocated while profiling
    and, freed later outside the profiler, their stale entries can make a later session report
    frees of other blocks at the same addresses. Garbage collection is held off meanwhile so
    that no earlier object dies inside the window.
    """
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            step()
    finally:
        gc.enable()
    events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak / 2**20


MEMORY_CASES = ("replicator recompute=never", "replicator recompute=except_last", "replicator recompute=always",
                "torch ScheduleGPipe")


def memory_job(config: Config, case: str) -> dict[str, float]:
    """In a fresh pair of processes: this stage's peak memory of one forward+backward for one case."""
    torch.set_num_threads(1)
    repl = rp.Replicator(stages=STAGES, chunks=config.chunks)
    batch = make_batches(config)[0]
    if case.startswith("replicator"):
        pipe = build_pipeline(
            make_layers(config), stage_id=repl.stage_id, num_stages=STAGES, balance=config.balance,
            stage_ranks=repl.groups.stage_ranks, stage_group=repl.groups.stage, chunks=config.chunks,
            recompute=case.split("=")[1], record=False,
        )
        module = pipe.module

        def run() -> None:
            pipe.train_step(batch[0], batch[1], F.cross_entropy)
    else:
        module = nn.Sequential(*make_layers(config)[stage_slice(config, repl.stage_id)])
        _, schedule, _ = torch_contender(module, repl.stage_id, config)

        def run() -> None:
            if repl.stage_id == 0:
                schedule.step(batch[0])
            else:
                schedule.step(target=batch[1], losses=[])

    run()  # first-touch allocations (Gloo buffers, lazy initialisation) stay out of the figure
    module.zero_grad(set_to_none=True)  # the gradients are then allocated inside the measured step
    dist.barrier()
    peak = peak_memory(run)
    parameters = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
    repl.close()
    return {"stage": repl.stage_id, "peak": peak, "parameters": parameters}


# -- the job -----------------------------------------------------------------------------------


def two_process_job(config: Config) -> dict[str, Any]:
    """One of the 2 processes: stage `rank` of every pipeline, and the single-process baseline on rank 0."""
    torch.set_num_threads(1)  # two processes then own one core each
    repl = rp.Replicator(stages=STAGES, chunks=config.chunks, schedule="gpipe", recompute="never")
    rank = dist.get_rank()
    batches = make_batches(config)
    sanity = first_step_sanity(repl, config, batches[0])

    with repl.scope():  # the facade's path: this process's stage and a wrapped optimizer
        pipe = repl.pipeline(make_layers(config), balance=config.balance)
        optimizer = repl.wrap_optimizer(make_optimizer(pipe, config))
    timed_steps: list[tuple[float, float, list[Event]]] = []
    contenders = [replicator_contender(pipe, optimizer, 'replicator, recompute="never"', timed_steps)]
    always = build_pipeline(
        make_layers(config), stage_id=repl.stage_id, num_stages=STAGES, balance=config.balance,
        stage_ranks=repl.groups.stage_ranks, stage_group=repl.groups.stage, chunks=config.chunks, recompute="always",
        record=False,
    )
    contenders.append(
        replicator_contender(always, make_optimizer(always, config), 'replicator, recompute="always"', None)
    )
    peer_module = nn.Sequential(*make_layers(config)[stage_slice(config, repl.stage_id)])
    contenders.append(torch_contender(peer_module, repl.stage_id, config)[0])
    contenders.append(single_contender(nn.Sequential(*make_layers(config)), config, split=False))
    contenders.append(single_contender(nn.Sequential(*make_layers(config)), config, split=True))

    figures: dict[str, dict[str, list[float]]] = {c.name: {"rate": [], "cpu_ms": [], "gloo_ms": []} for c in contenders}
    messages: list[float] = []  # point-to-point messages per timed step of the throughput contender
    for _, contender in in_turns(contenders, config.repeats):
        active = contender.processes == 2 or rank == 0  # rank 1 idles through single-process phases
        if active:
            contender.phase(batches, config.warmup)
        dist.barrier()  # the timed steps start together
        recording[0] = True
        cpu_started, gloo_started, started = time.process_time(), gloo_thread_seconds(), time.perf_counter()
        posted = pipe.message_count
        if active:
            contender.phase(batches, config.steps)
        elapsed = time.perf_counter() - started if active else 0.0
        if contender is contenders[0]:
            messages.append((pipe.message_count - posted) / config.steps)
        cpu, gloo = time.process_time() - cpu_started, gloo_thread_seconds() - gloo_started
        recording[0] = False
        slowest = slowest_rank(elapsed)  # the job is as fast as its slowest process
        figures[contender.name]["rate"].append(config.batch * config.steps / slowest)
        figures[contender.name]["cpu_ms"].append(1e3 * cpu / config.steps)
        figures[contender.name]["gloo_ms"].append(1e3 * gloo / config.steps)

    gathered: list[Any] = [None] * STAGES
    dist.all_gather_object(gathered, timed_steps)
    repl.close()
    return {"rank": rank, "stage": repl.stage_id, "figures": figures, "sanity": sanity, "messages": messages,
            "steps": gathered if rank == 0 else None, "cpu_seconds": time.process_time()}


# -- reading the results -----------------------------------------------------------------------


def bubbles(per_stage_steps: list[list[tuple[float, float, list[Event]]]], chunks: int) -> dict[str, list[float]]:
    """Per timed step: each stage's idle share, and what explains it.

    "of the schedule span": 1 - (the stage's forward+backward time) / (first recorded action
    of either stage to the last), the timeline's definition. "of the whole step": the same
    over the step's wall time, which adds zero_grad, splitting the batch, the end-of-step
    status message and optimizer.step. "simulated": the bubble GPipe would have with this
    step's measured per-stage forward and backward times and instant messages
    (schedule.timed_simulation): the part due to the schedule and unequal stages alone.
    "waiting to receive": the stage's time inside receive actions, as a share of the span.
    "transfer ms when the receiver already waits": from the start of a send action to the end
    of the matching receive, for the transfers whose receive began first, so that neither end
    was busy computing: packing, Gloo and unpacking, the cost a faster transport could save.
    """
    out: dict[str, list[float]] = {}
    for steps in zip(*per_stage_steps, strict=True):
        events = [e for _, _, stage_events in steps for e in stage_events]
        span = max(e.end for e in events) - min(e.start for e in events)
        wall = max(end for _, end, _ in steps) - min(start for start, _, _ in steps)
        forward, backward = [], []
        for stage, (_, _, stage_events) in enumerate(steps):
            busy = sum(e.end - e.start for e in stage_events if e.is_compute)
            waiting = sum(e.end - e.start for e in stage_events if e.op.startswith("recv"))
            out.setdefault(f"idle stage {stage}, of the schedule span", []).append(1.0 - busy / span)
            out.setdefault(f"idle stage {stage}, of the whole step", []).append(1.0 - busy / wall)
            out.setdefault(f"stage {stage} waiting to receive, of the span", []).append(waiting / span)
            forward.append(sum(e.end - e.start for e in stage_events if e.op == "forward") / chunks)
            backward.append(sum(e.end - e.start for e in stage_events if e.op == "backward") / chunks)
        latencies = [receive.end - send.start for (_, _, sender), (_, _, receiver) in zip(steps, steps[1:])
                     for send, receive in _matching_transfers(sender, receiver) if receive.start <= send.start]
        if latencies:
            out.setdefault("transfer ms when the receiver already waits", []).append(1e3 * statistics.median(latencies))
        out.setdefault("idle, mean of the stages, of the schedule span", []).append(
            statistics.mean(out[f"idle stage {s}, of the schedule span"][-1] for s in range(len(steps))))
        simulated = timed_simulation(gpipe(len(steps), chunks), forward_time=forward, backward_time=backward)
        out.setdefault("bubble simulated from the measured stage times", []).append(simulated_bubble(simulated))
        for stage in range(len(steps)):
            out.setdefault(f"stage {stage} forward ms per micro-batch", []).append(1e3 * forward[stage])
            out.setdefault(f"stage {stage} backward ms per micro-batch", []).append(1e3 * backward[stage])
    return out


def _matching_transfers(earlier: list[Event], later: list[Event]) -> list[tuple[Event, Event]]:
    """(send, receive) pairs between neighbouring stages: activations down, gradients up."""
    def by_microbatch(events: list[Event], op: str) -> dict[int, Event]:
        return {e.microbatch: e for e in events if e.op == op}

    pairs = []
    for sender, receiver, sent, received in ((earlier, later, "send_activation", "recv_activation"),
                                             (later, earlier, "send_gradient", "recv_gradient")):
        receives = by_microbatch(receiver, received)
        pairs += [(send, receives[m]) for m, send in by_microbatch(sender, sent).items() if m in receives]
    return pairs


def report(config: Config, results: list[dict[str, Any]], memory: dict[str, list[dict[str, float]]]
           ) -> tuple[list[str], dict[str, Any], bool]:
    first = results[0]
    figures = first["figures"]
    medians = {name: statistics.median(f["rate"]) for name, f in figures.items()}
    peer, ours = "torch ScheduleGPipe", 'replicator, recompute="never"'
    whole, micro = "1 process, whole batch", f"1 process, {config.chunks} micro-batches accumulated"
    K, M = STAGES, config.chunks
    ideal = K * M / (M + K - 1)
    lines = [
        "",
        f"throughput, mini-batch {config.batch} = {M} x {config.microbatch}, {config.steps} steps x {config.repeats} "
        "repetitions (medians):",
        "",
        "| contender | processes | median samples/s | min | max | vs ScheduleGPipe (median paired) "
        "| CPU ms/step rank 0 | rank 1 | of which Gloo threads, rank 0 | rank 1 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    def paired(name: str, other: str) -> float:
        return paired_ratio(figures[name]["rate"], figures[other]["rate"])

    for name, figure in figures.items():
        rates = Spread.of(figure["rate"])
        processes = 1 if name.startswith("1 process") else 2
        lines.append(f"| {name} | {processes} | {rates.median:,.0f} | {rates.min:,.0f} | {rates.max:,.0f} | "
                     f"{paired(name, peer):.3f} | {statistics.median(figure['cpu_ms']):.0f} | "
                     f"{statistics.median(results[1]['figures'][name]['cpu_ms']):.0f} | "
                     f"{statistics.median(figure['gloo_ms']):.0f} | "
                     f"{statistics.median(results[1]['figures'][name]['gloo_ms']):.0f} |")
    speedup_whole, speedup_micro, ratio_peer = paired(ours, whole), paired(ours, micro), paired(ours, peer)
    lines += [
        "",
        "speedups (median paired ratios of samples/s):",
        f"  ideal pipeline speedup K*M/(M+K-1) = {K}*{M}/{M + K - 1} = {ideal:.3f}",
        f"  replicator (never) over 1 process, whole batch:        {speedup_whole:.3f} = "
        f"{speedup_whole / ideal:.0%} of ideal",
        f"  replicator (never) over 1 process, same micro-batches: {speedup_micro:.3f} = "
        f"{speedup_micro / ideal:.0%} of ideal",
        f"  torch ScheduleGPipe over 1 process, whole batch:       {paired(peer, whole):.3f}",
        f"  replicator (never) over torch ScheduleGPipe:           {ratio_peer:.3f}",
        "",
        "point-to-point messages per step (replicator, never; sends and receives, median of the phases): "
        + ", ".join(f"stage {r['stage']} {statistics.median(r['messages']):.1f}" for r in results)
        + f" (one per transfer: {M} activations + {M} gradients + 1 status)",
    ]
    steps = [results[0]["steps"][s] for s in range(STAGES)]
    bubble = bubbles(steps, M)
    expected = (K - 1) / (M + K - 1)
    timed = len(bubble["idle, mean of the stages, of the schedule span"])
    lines += ["", f"bubble (replicator, recompute=\"never\", {timed} "
              f"timed steps; medians), expected (K-1)/(M+K-1) = {expected:.1%}:"]
    for name, values in bubble.items():
        shown = f"{statistics.median(values):.2f}" if "ms" in name.split() else f"{statistics.median(values):.1%}"
        lines.append(f"  {name}: {shown}")
    span_bubble = statistics.median(bubble["idle, mean of the stages, of the schedule span"])
    lines += [
        "",
        "targets:",
        f"  throughput >= 1.0 x ScheduleGPipe: {ratio_peer:.3f} -> {'met' if ratio_peer >= 1.0 else 'MISSED'}",
        f"  speedup over 1 process >= 90% of ideal (whole batch): {speedup_whole / ideal:.0%} -> "
        f"{'met' if speedup_whole >= 0.9 * ideal else 'MISSED'}",
        f"  bubble within 10 points of {expected:.1%}: {span_bubble:.1%} -> "
        f"{'met' if abs(span_bubble - expected) <= 0.10 else 'MISSED'}",
    ]
    lines += ["", "peak memory of one forward+backward above its start (MB; CPU allocator, torch.profiler; "
              "a fresh pair of processes per row):", "",
              "| | " + " | ".join(f"stage {s}" for s in range(STAGES)) + " |", "| --- |" + " ---: |" * STAGES]
    for case, per_stage in memory.items():
        lines.append(f"| {case} | " + " | ".join(f"{r['peak']:.1f}" for r in per_stage) + " |")
    lines.append("| parameters (and so their gradients) | "
                 + " | ".join(f"{r['parameters']:.1f}" for r in next(iter(memory.values()))) + " |")
    lines += ["", "first-step sanity (identical weights and batch):"]
    healthy = True
    for result in results:
        for key, value in result["sanity"].items():
            lines.append(f"  stage {result['stage']}: {key} = {value:.6g}")
        diffs = [v for k, v in result["sanity"].items() if k.startswith(("|", "max"))]
        healthy &= max(diffs) <= 1e-5
    lines.append(f"  replicator, ScheduleGPipe and 1 process agree (1e-5): {'yes' if healthy else 'NO'}")
    summary = {
        "ideal_speedup": ideal, "speedup_over_whole_batch": speedup_whole, "speedup_over_microbatches": speedup_micro,
        "ratio_vs_schedule_gpipe": ratio_peer, "expected_bubble": expected,
        "bubble_medians": {k: statistics.median(v) for k, v in bubble.items()}, "median_rates": medians,
        "peak_memory_mb": {case: [r["peak"] for r in per_stage] for case, per_stage in memory.items()},
        "messages_per_step": [statistics.median(r["messages"]) for r in results],
    }
    return lines, summary, healthy


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if "--schedules" in arguments:  # every schedule against torch's same-named one: its own benchmark
        import pipeline_schedules

        return pipeline_schedules.main([a for a in arguments if a != "--schedules"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=Config.repeats, help="interleaved repetitions per contender")
    parser.add_argument("--steps", type=int, default=Config.steps, help="timed steps per repetition")
    parser.add_argument("--warmup", type=int, default=Config.warmup, help="untimed steps before each timed phase")
    parser.add_argument("--microbatch", type=int, default=Config.microbatch, help="samples per micro-batch")
    parser.add_argument("--width", type=int, default=Config.width, help="MLP width")
    parser.add_argument("--balance", default=None,
                        help="layers per stage, e.g. 9,8 (16 blocks + head = 17 layers; default: 8,9); "
                             "every contender gets the same split")
    add_json_argument(parser, "pipeline")
    options = parser.parse_args(argv)
    if options.repeats < 1 or options.steps < 1 or options.warmup < 0 or options.microbatch < 1:
        parser.error("--repeats, --steps and --microbatch must be positive and --warmup non-negative")
    split = None
    if options.balance is not None:
        split = tuple(int(count) for count in options.balance.split(","))
        if len(split) != STAGES or min(split) < 1 or sum(split) != Config.blocks + 1:
            parser.error(f"--balance needs {STAGES} positive layer counts summing to {Config.blocks + 1}, "
                         f"got {options.balance}")
    config = Config(repeats=options.repeats, steps=options.steps, warmup=options.warmup,
                    microbatch=options.microbatch, width=options.width, split=split)
    parameters = sum(p.numel() for p in nn.Sequential(*make_layers(config)).parameters())
    header = machine()
    print(
        f"{machine_line(header)}\n"
        f"MLP of {config.blocks} Linear({config.width}, {config.width})+ReLU blocks and a {config.classes}-way head "
        f"({parameters / 1e6:.1f} M parameters), {STAGES} stages (balance {config.balance}) x {config.chunks} "
        f"micro-batches of {config.microbatch}; 1 thread per process (the single-process baseline too)",
        flush=True,
    )
    load_before = load_average()
    started = time.perf_counter()
    busy_before = busy_cpu_seconds()
    per_phase = (config.warmup + config.steps) * 1.0
    results = run_replicas(two_process_job, STAGES, config, timeout_s=120.0 + 5 * config.repeats * per_phase * 5)
    elapsed = time.perf_counter() - started
    busy = busy_cpu_seconds() - busy_before
    ours = sum(r["cpu_seconds"] for r in results)
    memory = {case: sorted(run_replicas(memory_job, STAGES, config, case, timeout_s=300.0), key=lambda r: r["stage"])
              for case in MEMORY_CASES}
    lines, summary, healthy = report(config, results, memory)
    # How much of the machine the job really had: on a shared machine the other processes'
    # share is why 2 processes can fall short of 2 cores' worth of speedup.
    usage = {"cores busy (mean)": busy / elapsed, "of which this job": ours / elapsed,
             "of which other processes": (busy - ours) / elapsed}
    load_after = load_average()
    summary["machine"] = {**usage, "load average (1, 5, 15 min) before": load_before,
                          "load average (1, 5, 15 min) after": load_after}
    lines.append(f"\nduring the timed job ({elapsed:.0f} s): " + ", ".join(f"{k} {v:.2f}" for k, v in usage.items())
                 + f" of {os.cpu_count()} cores; load average (1, 5, 15 min) before "
                 + "/".join(f"{x:.1f}" for x in load_before) + ", after " + "/".join(f"{x:.1f}" for x in load_after))
    print("\n".join(lines), flush=True)
    write_json(options.json, {
        "config": asdict(config), "parameters": parameters, "summary": summary,
        "per_rank": [{k: v for k, v in r.items() if k != "steps"} for r in results],
    }, header)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
