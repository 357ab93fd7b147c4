"""SN-GAN step time with cross-replica batch norm against local batch norm, 2 processes, same per-replica batch.

Command (from the repository root; a few minutes on 2 cores; figures go to
benchmarks/results/sngan_batchnorm.json):

    .venv/bin/python benchmarks/sngan_batchnorm.py --repeats 12 --steps 5 --batch 64

Both contenders are examples/sngan.py's generator and discriminator trained by its step_fn
(n_dis discriminator updates and one generator update per step) through `repl.run`, in the
same 2 processes, from the same weights, on the same real digits. They differ only in the
generator's conditional batch norm: statistics over the global batch (one differentiable
all-gather per norm layer and forward, and one in backward) or over each replica's own batch
(the generator then sees per-replica statistics, as BigGAN-PyTorch's accumulation does).
Phases take turns, the order rotating; figures are median step times, paired ratios per
repetition (see _harness.py).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from _harness import add_json_argument, compare, in_turns, load_average, machine, machine_line, slowest_rank, write_json

import replicator as rp
from replicator.testing import run_replicas


@functools.cache
def example() -> ModuleType:
    """examples/sngan.py, the workload (imported from its directory, where its scores module lives)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    return importlib.import_module("sngan")

CROSS, LOCAL = "cross-replica batch norm", "local batch norm"


@dataclass(frozen=True)
class Config:
    repeats: int = 12
    steps: int = 5  # timed steps per phase
    warmup: int = 2
    batch: int = 64  # per replica, per discriminator update
    n_dis: int = 2
    image_size: int = 8
    width: int = 16
    threads: int = 1
    seed: int = 0


def _localized(generator: torch.nn.Module) -> torch.nn.Module:
    """A copy whose conditional batch norms normalize with this replica's batch only (plain BatchNorm2d inside)."""
    local = copy.deepcopy(generator)
    for module in local.modules():
        if isinstance(module, rp.nn.CrossReplicaConditionalBatchNorm):
            norm = torch.nn.BatchNorm2d(module.num_features, affine=False)
            norm.load_state_dict(module.norm.state_dict())
            module.norm = norm
    return local


def two_process_job(config: Config) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    repl = rp.Replicator()
    sngan = example()
    (images, labels), _ = sngan.load_digits(config.image_size)
    reals = config.batch * config.n_dis
    generator = torch.Generator().manual_seed(repl.replica_id)
    batches = []
    for _ in range(8):
        chosen = torch.randint(0, len(images), (reals,), generator=generator)
        batches.append((images[chosen], labels[chosen]))
    steps_of: dict[str, Any] = {}
    with repl.scope():
        cross = sngan.Generator(32, config.width, config.image_size)
        for name, g in ((CROSS, cross), (LOCAL, _localized(cross))):
            d = sngan.Discriminator(config.width, config.image_size)
            g_opt = repl.wrap_optimizer(torch.optim.Adam(g.parameters(), lr=1e-3, betas=(0.0, 0.9)))
            d_opt = repl.wrap_optimizer(torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.0, 0.9)))
            noise = sngan.GlobalNoise(32, config.seed, repl.replica_id, repl.num_replicas)
            steps_of[name] = sngan.make_step(repl, g, d, g_opt, d_opt, noise, config.n_dis)
    figures: dict[str, dict[str, list[float]]] = {name: {"step_ms": [], "cpu_ms": []} for name in steps_of}

    def phase(name: str, count: int, stamps: list[float]) -> None:
        chosen = [batches[(repl.global_step + i) % len(batches)] for i in range(count)]
        for _ in repl.run(steps_of[name], chosen, steps=repl.global_step + count, progress=False, warmup_steps=0):
            stamps.append(time.perf_counter())

    for _, name in in_turns(list(steps_of), config.repeats):
        phase(name, config.warmup, [])
        dist.barrier()
        stamps: list[float] = []
        cpu, started = time.process_time(), time.perf_counter()
        phase(name, config.steps, stamps)
        cpu = time.process_time() - cpu
        # The median step, slowest process's: run()'s start and end checks fall outside the steps.
        step = statistics.median(later - earlier for earlier, later in zip([started, *stamps], stamps))
        figures[name]["step_ms"].append(1e3 * slowest_rank(step))
        figures[name]["cpu_ms"].append(1e3 * cpu / config.steps)
    return {"figures": figures, "rank": dist.get_rank()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=Config.repeats)
    parser.add_argument("--steps", type=int, default=Config.steps, help="timed steps per phase")
    parser.add_argument("--warmup", type=int, default=Config.warmup)
    parser.add_argument("--batch", type=int, default=Config.batch, help="samples per replica per discriminator update")
    parser.add_argument("--image-size", type=int, default=Config.image_size)
    parser.add_argument("--width", type=int, default=Config.width)
    add_json_argument(parser, "sngan_batchnorm")
    options = parser.parse_args(argv)
    config = Config(repeats=options.repeats, steps=options.steps, warmup=options.warmup, batch=options.batch,
                    image_size=options.image_size, width=options.width)
    header = machine()
    print(f"{machine_line(header)}\nSN-GAN step (n_dis {config.n_dis} + 1 generator update), 2 processes, "
          f"batch {config.batch} per replica, {config.image_size}x{config.image_size}, width {config.width}, "
          f"{config.repeats} repetitions x {config.steps} steps (+{config.warmup} warm-up)", flush=True)
    load_before = load_average()[0]
    results = run_replicas(two_process_job, 2, config, timeout_s=120.0 + 20.0 * config.repeats * config.steps)
    figures = results[0]["figures"]
    # Lower step time is better: compare the reciprocals so that ratios above 1 favour cross-replica.
    step_ratio = compare({name: [1 / v for v in f["step_ms"]] for name, f in figures.items()}, LOCAL)[CROSS]
    cpu = {name: statistics.median(f["cpu_ms"]) for name, f in figures.items()}
    slowdown = 1 / (step_ratio.paired or 1.0)
    lines = [f"{'contender':<26} {'median step ms [min, max]':>28} {'CPU ms/step':>12}"]
    for name, f in figures.items():
        lines.append(f"{name:<26} {statistics.median(f['step_ms']):>10.1f} [{min(f['step_ms']):.1f}, "
                     f"{max(f['step_ms']):.1f}] {cpu[name]:>12.1f}")
    lines.append(f"cross-replica / local step time (median of paired ratios): {slowdown:.3f} (target <= 1.15)")
    load_after = load_average()[0]
    lines.append(f"1-minute load average {load_before:.2f} before, {load_after:.2f} after, on 2+ cores shared")
    print("\n".join(lines), flush=True)
    write_json(options.json, {"config": asdict(config), "figures_rank0": figures, "cross_over_local": slowdown,
                              "load_average_1min": {"before": load_before, "after": load_after}}, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
