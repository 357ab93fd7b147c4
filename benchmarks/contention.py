"""How much does this machine slow a process down when a second one computes beside it?

Command (from the repository root; about 2.5 minutes on 2 cores; figures go to
benchmarks/results/contention.json):

    .venv/bin/python benchmarks/contention.py

The demo's weak-scaling efficiency compares 2 replicas against 1. Part of any shortfall
need not come from replicator at all: two processes computing at once share the machine's
caches and memory bandwidth, and on a virtual machine perhaps the host's cores. This
script measures that part alone. It runs the demo's ResNet training step (same model,
batch 128 per process, one thread, SGD) in plain PyTorch processes that never talk to each
other: one process alone, then two at once, in alternating phases. The ratio of their step
times is the efficiency that 2 replicas could reach with communication that cost nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from _harness import add_json_argument, in_turns, load_average, machine, machine_line, write_json

from replicator.demo.digits import ResNet, load_digits_split


def _train_steps(steps: int, warmup: int, start: Any, finished: Any, out: Any) -> None:
    """One plain process: wait for the start signal, time `steps` training steps, report medians,
    and keep computing (untimed) until every process of the phase has timed its steps, so that
    none times its last steps alone."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, _ = load_digits_split(32, seed=0)
    images, labels = train.tensors[0][:128], train.tensors[1][:128]
    model = ResNet(num_classes=10, blocks_per_stage=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start.wait()  # every process of the phase starts computing together
    walls, cpus = [], []
    for step in range(warmup + steps):
        wall, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if step >= warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    with finished.get_lock():
        finished.value += 1
    while finished.value < start.parties:
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    out.put((1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)))


def phase(processes: int, steps: int, warmup: int) -> list[tuple[float, float]]:
    """Run `processes` independent trainers at once; each one's (median step ms, median CPU ms)."""
    context = multiprocessing.get_context("spawn")
    start, finished, out = context.Barrier(processes), context.Value("i", 0), context.Queue()
    workers = [
        context.Process(target=_train_steps, args=(steps, warmup, start, finished, out)) for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="alternating pairs of phases (alone, together)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per process and phase")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every phase")
    add_json_argument(parser, "contention")
    options = parser.parse_args(argv)
    header = machine()
    load_before = header["load_average"][0]
    alone: list[tuple[float, float]] = []
    together: list[tuple[float, float]] = []
    # Alternate which comes first, so that load drifting during the run weighs on both.
    for _, processes in in_turns((1, 2), options.repeats):
        (alone if processes == 1 else together).extend(phase(processes, options.steps, options.warmup))
    step_alone = statistics.median(w for w, _ in alone)
    step_together = statistics.median(w for w, _ in together)
    cpu_alone = statistics.median(c for _, c in alone)
    cpu_together = statistics.median(c for _, c in together)
    ceiling = step_alone / step_together
    load_after = load_average()[0]
    print(machine_line(header))
    print(f"demo ResNet training step, batch 128, 1 thread per process, "
          f"{options.repeats} x (alone, together) phases of {options.steps} steps\n")
    print("| processes computing | step (ms, median) | CPU per step (ms, median) |")
    print("| --- | ---: | ---: |")
    print(f"| 1 alone | {step_alone:.1f} | {cpu_alone:.1f} |")
    print(f"| 2 at once (no communication) | {step_together:.1f} | {cpu_together:.1f} |")
    print(f"\n2 at once / 1 alone: step time x{step_together / step_alone:.3f}, CPU x{cpu_together / cpu_alone:.3f}")
    print(f"weak-scaling efficiency of 2 replicas with free communication: {100 * ceiling:.1f}%")
    print(f"1-minute load average {load_before:.2f} before, {load_after:.2f} after, on {header['cores']} cores")
    write_json(options.json, {"alone": alone, "together": together, "ceiling": ceiling,
                              "load_average_1min": [load_before, load_after]}, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
