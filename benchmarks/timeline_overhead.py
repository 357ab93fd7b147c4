"""What recording a timeline costs: the same 2-replica training with and without run(timeline=...).

Command (from the repository root; about a minute on 2 cores; figures go to
benchmarks/results/timeline_overhead.json):

    .venv/bin/python benchmarks/timeline_overhead.py --repeats 10 --steps 30

Two processes train one small MLP (a few gradient buckets per step, so every kind of span is
recorded: steps, forward, backward, buckets, optimizer steps, input and agreement waits) in
short phases that take turns, the order rotating every repetition: `repl.run(...)` plain, then
`repl.run(..., timeline=path)`. Within a phase every step is timed (from one yielded step to
the next, the slowest rank's); the figure is each phase's median step, compared as a paired
ratio (recorded / plain within one repetition), medians over the repetitions. Wall time on a
shared machine moves with the other jobs' load by more than the timeline costs, so the CPU time
each process spends per step (all its threads) is compared the same way. Apart from the
steps, a recorded run ends by merging every process's spans into one file: that hand-in is
timed too (the phase's wall time past its last step). Last, in one process, what recording adds
where it adds anything, in figures the machine's load hardly moves: one span as the library's
rooms record it (`replicator.timeline.span`), with no recording under way and with one; and the
forward and backward hooks on the model, as the fastest of many alternating forward+backward
passes with and without them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from _harness import add_json_argument, compare, in_turns, machine, machine_line, ratio_text, slowest_rank, write_json

import replicator as rp
from replicator.testing import run_replicas
from replicator.timeline import recorder
from replicator.timeline.hooks import ModelSpans

CONTENDERS = ["plain", "timeline"]


def _batches(replica: int, features: int, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(replica)
    fixed = [(torch.randn(batch, features, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
             for _ in range(8)]
    while True:
        yield from fixed


def _measure(repeats: int, steps: int, features: int, hidden: int, batch: int, directory: str,
             reducer: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    repl = rp.Replicator(bucket_cap_mb=0.25, reducer=reducer)
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                    torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    buckets = len(repl.optimizers.wrapped[0].synchronizer.buckets)

    def step_fn(ctx: rp.ReplicaContext, data: Any) -> torch.Tensor:
        x, y = data
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    inputs = _batches(repl.replica_id, features, batch)
    list(repl.run(step_fn, inputs, steps=steps, progress=False))  # warm-up, not timed
    step_s: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    cpu_s: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    hand_in_s: list[float] = []
    spans: list[int] = []
    for repetition, name in in_turns(CONTENDERS, repeats):
        path = os.path.join(directory, f"trace-{repetition}.json") if name == "timeline" else False
        stamps, cpu = [time.perf_counter()], [time.process_time()]
        for _ in repl.run(step_fn, inputs, steps=repl.global_step + steps, progress=False, timeline=path):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
        ended = time.perf_counter()
        durations = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the first step's end: no start-up
        step_s[name].append(slowest_rank(statistics.median(durations)))
        cpu_s[name].append(slowest_rank((cpu[-1] - cpu[1]) / (len(cpu) - 2)))
        if name == "timeline":
            hand_in_s.append(slowest_rank(ended - stamps[-1]))
            if repl.is_main:
                with open(str(path), encoding="utf-8") as file:
                    spans.append(sum(1 for e in json.load(file)["traceEvents"] if e["ph"] == "X"))
    return {"step_s": step_s, "cpu_s": cpu_s, "hand_in_s": hand_in_s, "spans": spans, "buckets": buckets}


def span_cost_us(spans: int = 200_000) -> dict[str, float]:
    """Microseconds per `with span(...)` block (median of 5 batches): off (no recording), and on."""

    def batch() -> float:
        started = time.perf_counter()
        for step in range(spans):
            with recorder.span("optimizer step", "optimizer", step=step):
                pass
        return 1e6 * (time.perf_counter() - started) / spans

    off = statistics.median(batch() for _ in range(5))
    recorder.activate(recorder.Recorder(limit=spans))
    try:
        on = statistics.median(batch() for _ in range(5))
    finally:
        recorder.activate(None)
    return {"off": off, "on": on}


def hook_cost_us(features: int, hidden: int, batch: int, passes: int = 3000) -> dict[str, float]:
    """Microseconds of one forward+backward of the benchmark's model, without and with the timeline's hooks
    (the fastest of `passes` alternating ones: the least disturbed by other jobs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    x, y = torch.randn(batch, features), torch.randint(0, 10, (batch,))
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for number in range(passes):
        hooked = number % 2 == 1
        spans = ModelSpans(recorder.Recorder(), [model]) if hooked else None
        started = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        seconds[hooked].append(time.perf_counter() - started)
        if spans is not None:
            spans.remove()
    return {"plain": 1e6 * min(seconds[False]), "hooked": 1e6 * min(seconds[True]),
            "added": 1e6 * (min(seconds[True]) - min(seconds[False]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="repetitions; each runs every contender once")
    parser.add_argument("--steps", type=int, default=30, help="steps per phase")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="per replica")
    parser.add_argument("--reducer", default="auto", help="rp.Replicator(reducer=...): auto is shared memory here")
    add_json_argument(parser, "timeline_overhead")
    args = parser.parse_args()
    header = machine()
    with tempfile.TemporaryDirectory() as directory:
        figures = run_replicas(_measure, 2, args.repeats, args.steps, args.features, args.hidden, args.batch,
                               directory, args.reducer, timeout_s=1800)[0]
    # Higher is better for compare(): steps per second.
    rates = {name: [1.0 / s for s in values] for name, values in figures["step_s"].items()}
    comparison = compare(rates, peer="plain")
    per_step = {name: 1e3 * statistics.median(values) for name, values in figures["step_s"].items()}
    overhead = 1.0 / (comparison["timeline"].paired or 1.0) - 1.0
    cpu = {name: 1e3 * statistics.median(values) for name, values in figures["cpu_s"].items()}
    cpu_overhead = statistics.median(t / p for p, t in zip(figures["cpu_s"]["plain"], figures["cpu_s"]["timeline"])) - 1
    spans_per_step = statistics.median(figures["spans"]) / args.steps if figures["spans"] else 0.0
    print(machine_line(header))
    print(f"2 replicas, MLP {args.features}-{args.hidden}-{args.hidden}-10, batch {args.batch} per replica, "
          f"{figures['buckets']} gradient buckets; {args.repeats} repetitions x {args.steps} steps\n")
    print("| run | median step ms | steps/s vs plain (paired) | CPU ms per step (slowest process) |")
    print("| --- | ---: | ---: | ---: |")
    for name in CONTENDERS:
        print(f"| {name} | {per_step[name]:.2f} | {ratio_text(comparison[name].paired)} | {cpu[name]:.2f} |")
    hand_in_ms = 1e3 * statistics.median(figures["hand_in_s"])
    per_span = span_cost_us()
    torch.set_num_threads(1)
    hooks = hook_cost_us(args.features, args.hidden, args.batch)
    print(f"\nrecording costs {100 * overhead:+.1f}% per step in wall time, {100 * cpu_overhead:+.1f}% in CPU time "
          f"({spans_per_step:.0f} spans per step over both processes); merging them into one file at the end of run() "
          f"takes {hand_in_ms:.0f} ms")
    print(f"one span costs {per_span['on']:.2f} µs while recording, {per_span['off']:.3f} µs when nothing records; "
          f"the model's hooks add {hooks['added']:.0f} µs to a forward+backward of {hooks['plain']:.0f} µs")
    write_json(args.json, {
        "config": {key: value for key, value in vars(args).items() if key != "json"} | {"buckets": figures["buckets"]},
        "median_step_ms": per_step,
        "steps_per_s": {name: {"median": c.spread.median, "min": c.spread.min, "max": c.spread.max,
                               "paired_vs_plain": c.paired} for name, c in comparison.items()},
        "overhead_per_step": overhead,
        "cpu_ms_per_step": cpu,
        "cpu_overhead_per_step": cpu_overhead,
        "spans_per_step": spans_per_step,
        "span_cost_us": per_span,
        "hook_cost_us": hooks,
        "hand_in_ms": {"median": hand_in_ms, "min": 1e3 * min(figures["hand_in_s"]),
                       "max": 1e3 * max(figures["hand_in_s"])},
    }, header)


if __name__ == "__main__":
    main()
