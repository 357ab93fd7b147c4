"""Measure this machine: matmul FLOP/s, casts to fp16, and α, β (and fp16 sums) of a loopback Gloo all-reduce."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Calibration", "measure_matmul_flops", "measure_cast", "measure_all_reduce", "fit_alpha_beta",
           "fit_fp16_sum_rate", "calibrate"]

# Calls a function in N local processes and returns their results by rank (run_replicas).
ProcessRunner = Callable[..., list[Any]]

# From latency-bound to bandwidth-bound, small enough to finish in seconds on a laptop.
DEFAULT_SIZES: tuple[int, ...] = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)
# fp32 bytes of a cast: a bucket's share of a few MB, as the runtime's reducers cast them.
CAST_BYTES = 4 << 20
# How many times calibrate measures the all-reduce before it gives up on a fit that says time shrinks with size.
MEASURE_ATTEMPTS = 3


@dataclass(frozen=True)
class Calibration:
    """What this machine measured: achieved FLOP/s, all-reduce latency α (s) and bandwidth β (bytes/s), the
    fp32 bytes/s a cast to fp16 converts, and the elements/s an fp16 all-reduce sums beyond its bytes."""

    matmul_flops: float
    alpha: float
    beta: float
    world_size: int
    samples: tuple[tuple[int, float], ...]
    cast_bandwidth: float = math.inf
    fp16_sum_rate: float = math.inf
    fp16_samples: tuple[tuple[int, float], ...] = ()


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


def measure_cast(nbytes: int = CAST_BYTES, repeats: int = 10, threads: int | None = None) -> float:
    """Bytes of fp32 per second the fastest of `repeats` casts of `nbytes` to fp16 converts (into a new tensor,
    as a reducer's cast does)."""
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        source = torch.randn(max(1, nbytes // 4))
        source.to(torch.float16)  # first call pays for allocation and kernel selection
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            source.to(torch.float16)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return source.numel() * 4 / max(min(seconds), 1e-9)


def _all_reduce_worker(sizes: Sequence[int], repeats: int, dtype_name: str = "float32"
                       ) -> list[tuple[int, list[float]]]:
    """Runs in each replica: seconds of every timed Gloo all-reduce (of `sizes` bytes of fp32 elements, sent in
    `dtype_name`), per size."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dtype = getattr(torch, dtype_name)
    results = []
    for nbytes in sizes:
        buffer = torch.zeros(max(1, nbytes // 4), dtype=dtype)
        dist.all_reduce(buffer)  # warm the connection and the buffers
        seconds = []
        for _ in range(repeats):
            # Start together so one rank's lateness is not billed as communication.
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            seconds.append(time.perf_counter() - start)
        results.append((buffer.numel() * buffer.element_size(), seconds))
    return results


def _both_worker(sizes: Sequence[int], fp16_sizes: Sequence[int], repeats: int
                 ) -> tuple[list[tuple[int, list[float]]], list[tuple[int, list[float]]]]:
    return _all_reduce_worker(sizes, repeats), _all_reduce_worker(fp16_sizes, repeats, "float16")


def _fastest(per_rank: list[list[tuple[int, list[float]]]], repeats: int) -> list[tuple[int, float]]:
    """(bytes, seconds) per size: a repeat lasts as long as its slowest rank; the fastest repeat is kept."""
    samples = []
    for i, (nbytes, _) in enumerate(per_rank[0]):
        slowest = [max(rank[i][1][r] for rank in per_rank) for r in range(repeats)]
        samples.append((nbytes, min(slowest)))
    return samples


def _faster_of(first: list[tuple[int, float]], second: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Per size, the faster of two measurements of the same sizes."""
    return [(nbytes, min(a, b)) for (nbytes, a), (_, b) in zip(first, second)]


def measure_all_reduce(run: ProcessRunner, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7,
                       world_size: int = 2, timeout_s: float = 60.0, fp16_sizes: Sequence[int] = ()
                       ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(bytes, seconds) of a loopback Gloo all-reduce among `world_size` local processes, in fp32 and, for
    `fp16_sizes` (fp32 bytes of the same elements), in fp16.

    `run` starts the processes (replicator.testing.run_replicas): the planner itself starts
    none, so that the core never depends on the rooms that spawn processes. A repeat lasts as
    long as its slowest rank. We keep the fastest repeat: it is what the machine can deliver,
    while slower ones measure whoever else shares the cores.
    """
    per_rank = run(_both_worker, world_size, list(sizes), list(fp16_sizes), repeats, timeout_s=timeout_s)
    return _fastest([rank[0] for rank in per_rank], repeats), _fastest([rank[1] for rank in per_rank], repeats)


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


def fit_fp16_sum_rate(fp16_samples: Sequence[tuple[int, float]], alpha: float, beta: float,
                      world_size: int = 2) -> float:
    """Elements per second an fp16 all-reduce sums beyond what its bytes cost, from measured (fp16 bytes, T).

    The bytes cost what the fp32 fit (α, β) says a ring all-reduce of that many bytes
    costs; what is left over is the summing: (n-1)/n of the elements on every rank. Gloo on
    CPU widens every fp16 element to fp32 and back in scalar code, so this is slower than
    the wire inside a machine. Infinite when fp16 costs no more than its bytes.
    """
    if world_size < 2:
        raise ValueError(f"an all-reduce fit needs world_size >= 2, got {world_size}")
    steps = 2 * (world_size - 1)
    summed = extra = 0.0
    for nbytes, seconds in fp16_samples:
        summed += nbytes / 2 * (world_size - 1) / world_size
        extra += seconds - (steps * alpha + steps / world_size * nbytes / beta)
    return summed / extra if extra > 0 and summed > 0 else math.inf


def calibrate(run: ProcessRunner, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7, world_size: int = 2,
              matmul_size: int = 512, timeout_s: float = 60.0, fp16_sizes: Sequence[int] | None = None,
              cast_bytes: int = CAST_BYTES) -> Calibration:
    """Measure matmul FLOP/s and casts to fp16 here, fit α, β to a loopback all-reduce among `world_size`
    processes, and what fp16 all-reduces of the largest sizes (`fp16_sizes`, fp32 bytes) cost beyond their bytes."""
    flops = measure_matmul_flops(matmul_size)
    # One thread: a cast of a few MB split over busy cores waits for the slowest of them (measured here at
    # 0.5-80 GB/s from one run to the next with two threads, 47 GB/s steadily with one).
    cast = measure_cast(cast_bytes, threads=1)
    fp16_sizes = sorted(sizes)[-2:] if fp16_sizes is None else fp16_sizes
    samples, fp16_samples = measure_all_reduce(run, sizes, repeats, world_size, timeout_s, fp16_sizes)
    for attempt in range(1, MEASURE_ATTEMPTS + 1):
        try:
            alpha, beta = fit_alpha_beta(samples, world_size)
            break
        except ValueError:
            # On shared cores a burst of other work can make every repeat of a larger message no faster
            # than a smaller one. Measure again and keep each size's fastest time: more repeats, same rule.
            if attempt == MEASURE_ATTEMPTS:
                raise
            again, fp16_again = measure_all_reduce(run, sizes, repeats, world_size, timeout_s, fp16_sizes)
            samples, fp16_samples = _faster_of(samples, again), _faster_of(fp16_samples, fp16_again)
    rate = fit_fp16_sum_rate(fp16_samples, alpha, beta, world_size) if fp16_samples else math.inf
    return Calibration(flops, alpha, beta, world_size, tuple(samples), cast, rate, tuple(fp16_samples))
