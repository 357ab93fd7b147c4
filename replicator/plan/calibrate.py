"""Measure this machine: matmul FLOP/s, and α, β of a loopback Gloo all-reduce between 2 processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Calibration", "measure_matmul_flops", "measure_all_reduce", "fit_alpha_beta", "calibrate"]

# Calls a function in N local processes and returns their results by rank (run_replicas).
ProcessRunner = Callable[..., list[Any]]

# From latency-bound to bandwidth-bound, small enough to finish in seconds on a laptop.
DEFAULT_SIZES: tuple[int, ...] = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


@dataclass(frozen=True)
class Calibration:
    """What this machine measured: achieved FLOP/s, all-reduce latency α (s) and bandwidth β (bytes/s)."""

    matmul_flops: float
    alpha: float
    beta: float
    world_size: int
    samples: tuple[tuple[int, float], ...]


def measure_matmul_flops(size: int = 512, repeats: int = 10, threads: int | None = None) -> float:
    """FLOP/s of the fastest of `repeats` fp32 size×size matmuls (2·size³ FLOPs) on this process's threads."""
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size)
        b = torch.randn(size, size)
        torch.mm(a, b)  # first call pays for allocation and kernel selection
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / min(seconds)


def _all_reduce_worker(sizes: Sequence[int], repeats: int) -> list[tuple[int, list[float]]]:
    """Runs in each replica: seconds of every timed Gloo all-reduce (fp32), per size."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = []
    for nbytes in sizes:
        buffer = torch.zeros(max(1, nbytes // 4))
        dist.all_reduce(buffer)  # warm the connection and the buffers
        seconds = []
        for _ in range(repeats):
            # Start together so one rank's lateness is not billed as communication.
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            seconds.append(time.perf_counter() - start)
        results.append((buffer.numel() * 4, seconds))
    return results


def measure_all_reduce(run: ProcessRunner, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7,
                       world_size: int = 2, timeout_s: float = 60.0) -> list[tuple[int, float]]:
    """(bytes, seconds) of a loopback Gloo all-reduce among `world_size` local processes.

    `run` starts the processes (replicator.testing.run_replicas): the planner itself starts
    none, so that the core never depends on the rooms that spawn processes. A repeat lasts as
    long as its slowest rank. We keep the fastest repeat: it is what the machine can deliver,
    while slower ones measure whoever else shares the cores.
    """
    per_rank = run(_all_reduce_worker, world_size, list(sizes), repeats, timeout_s=timeout_s)
    samples = []
    for i, (nbytes, _) in enumerate(per_rank[0]):
        slowest = [max(rank[i][1][r] for rank in per_rank) for r in range(repeats)]
        samples.append((nbytes, min(slowest)))
    return samples


def fit_alpha_beta(samples: Sequence[tuple[int, float]], world_size: int = 2) -> tuple[float, float]:
    """Fit T = 2(n-1)α + 2(n-1)/n · S/β (the ring all-reduce) to measured (S, T).

    Least squares on relative error (weights 1/T²): plain least squares would let the
    largest message decide everything and leave α to noise.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least 2 (bytes, seconds) samples to fit α and β, got {len(samples)}")
    if world_size < 2:
        raise ValueError(f"an all-reduce fit needs world_size >= 2, got {world_size}")
    sizes = [float(s) for s, _ in samples]
    times = [float(t) for _, t in samples]
    if min(times) <= 0:
        raise ValueError("measured times must be > 0 s")
    weights = [1.0 / t**2 for t in times]
    total = sum(weights)
    mean_s = sum(w * s for w, s in zip(weights, sizes)) / total
    mean_t = sum(w * t for w, t in zip(weights, times)) / total
    spread = sum(w * (s - mean_s) ** 2 for w, s in zip(weights, sizes))
    if spread == 0:
        raise ValueError("the samples need at least two different sizes")
    slope = sum(w * (s - mean_s) * (t - mean_t) for w, s, t in zip(weights, sizes, times)) / spread
    intercept = mean_t - slope * mean_s
    if slope <= 0:
        raise ValueError(f"time did not grow with message size (slope {slope:.3g} s/byte); measure larger sizes")
    steps = 2 * (world_size - 1)
    # Noise can push the intercept a little below zero; a latency is never negative.
    alpha = max(0.0, intercept) / steps
    beta = steps / world_size / slope
    return alpha, beta


def calibrate(run: ProcessRunner, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7, world_size: int = 2,
              matmul_size: int = 512, timeout_s: float = 60.0) -> Calibration:
    """Measure matmul FLOP/s here and fit α, β to a loopback all-reduce among `world_size` processes."""
    flops = measure_matmul_flops(matmul_size)
    samples = measure_all_reduce(run, sizes, repeats, world_size, timeout_s)
    alpha, beta = fit_alpha_beta(samples, world_size)
    return Calibration(flops, alpha, beta, world_size, tuple(samples))
