"""Step time of shard="optimizer" / "gradients" / "parameters" against shard=None, ZeroRedundancyOptimizer + DDP, FSDP2.

Command (from the repository root; about a minute on 2 loaded cores; figures go to
benchmarks/results/sharding.json):

    .venv/bin/python benchmarks/sharding.py --repeats 15 --steps 4

The issue's targets: "optimizer" and "gradients" within 1.05x of shard=None and faster than ZeroRedundancyOptimizer +
DDP and than FSDP2 with reshard_after_forward=False (ZeRO-2's counterpart); "parameters" faster than FSDP2 with
reshard_after_forward=True (ZeRO-3's), the same units.

`--only parameters,fsdp2` times those contenders alone (keys: none, optimizer, gradients,
parameters, zero, ddp, fsdp2, fsdp2-kept), e.g. ZeRO-3 against FSDP2 in a shorter run.

Every contender (plain torch DDP too, for scale) trains its own copy of the same MLP with AdamW
inside the same N processes, on the same fixed batches, in short phases that take turns (the order rotates every
repetition); a paired ratio is the median over repetitions of the two contenders' step times
within one repetition. Replicator is driven by calling step_fn directly, as
benchmarks/data_parallel.py's "step_fn" loop does. Also reported: the optimizer-state bytes each
replica holds, counted from its local tensors, and whether each sharded contender ended bit for
bit equal to shard=None (it must: the same sums, the same element-wise update), and
shard="parameters" to torch's FSDP2 (`fully_shard` on every Linear, then the root: the same units).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import add_json_argument, compare, in_turns, machine, machine_line, ratio_text, slowest_rank, write_json
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import replicator as rp
from replicator.launch import heap_kept_environment
from replicator.testing import run_replicas

Batch = tuple[torch.Tensor, torch.Tensor]
BASELINE = "replicator shard=None"
TORCH_ZERO = "torch DDP + ZeroRedundancyOptimizer"
TORCH_DDP = "torch DDP"  # unsharded, for scale
ZERO3 = "replicator shard='parameters'"
TORCH_FSDP2 = "torch FSDP2 (fully_shard)"
# ZeRO-2's peer in FSDP2: parameters kept gathered from forward to backward, gradients reduce-scattered.
TORCH_FSDP2_KEPT = "torch FSDP2 (reshard_after_forward=False)"
KEYS = {BASELINE: "none", "replicator shard='optimizer'": "optimizer", "replicator shard='gradients'": "gradients",
        ZERO3: "parameters", TORCH_ZERO: "zero", TORCH_DDP: "ddp", TORCH_FSDP2: "fsdp2", TORCH_FSDP2_KEPT: "fsdp2-kept"}


@dataclass(frozen=True)
class Config:
    replicas: int = 2
    repeats: int = 7
    steps: int = 4  # timed steps per phase
    warmup: int = 1  # untimed steps at the start of every phase
    batch: int = 32  # per replica
    features: int = 512
    hidden: int = 1024
    classes: int = 10
    threads: int = 1
    lr: float = 1e-3


def make_model(config: Config) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(config.features, config.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(config.hidden, config.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(config.hidden, config.classes))


def make_batches(config: Config, shard: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(shard)
    return [(torch.randn(config.batch, config.features, generator=generator),
             torch.randint(0, config.classes, (config.batch,), generator=generator)) for _ in range(4)]


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(local(v).numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def trainer(forward: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Batch], None]:
    def step(batch: Batch) -> None:
        x, y = batch
        loss = F.cross_entropy(forward(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def _state_counter(repl: rp.Replicator, optimizer: torch.optim.Optimizer) -> Callable[[], int]:
    """The optimizer state this replica holds: its shard optimizer's when sharded (the user's then holds none)."""
    wrapped = repl.optimizers.wrapped[0]
    return lambda: wrapped.sharded.state_bytes() if wrapped.sharded is not None else state_bytes(optimizer)


def replica(config: Config, only: tuple[str, ...]) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    steps: dict[str, Callable[[Batch], None]] = {}
    models: dict[str, torch.nn.Module] = {}
    held: dict[str, Callable[[], int]] = {}
    for shard in (None, "optimizer", "gradients", "parameters"):
        name = f"replicator shard={shard!r}" if shard else BASELINE
        repl = rp.Replicator(shard=shard)
        with repl.scope():
            model = make_model(config)
            optimizer = repl.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=config.lr))
        models[name], steps[name] = model, trainer(model, optimizer)
        held[name] = _state_counter(repl, optimizer)
    plain = make_model(config)
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    zero = ZeroRedundancyOptimizer(plain.parameters(), optimizer_class=torch.optim.AdamW, lr=config.lr)
    models[TORCH_ZERO], steps[TORCH_ZERO] = plain, trainer(ddp, zero)
    held[TORCH_ZERO] = lambda: state_bytes(zero.optim)
    kept = make_model(config)  # the units shard="parameters" and the other FSDP2 arm use
    for layer in [*(layer for layer in kept if isinstance(layer, torch.nn.Linear)), kept]:
        fully_shard(layer, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"), reshard_after_forward=False)
    kept_optimizer = torch.optim.AdamW(kept.parameters(), lr=config.lr)
    models[TORCH_FSDP2_KEPT], steps[TORCH_FSDP2_KEPT] = kept, trainer(kept, kept_optimizer)
    held[TORCH_FSDP2_KEPT] = lambda: state_bytes(kept_optimizer)
    whole = make_model(config)
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=config.lr)
    whole_ddp = torch.nn.parallel.DistributedDataParallel(whole)
    models[TORCH_DDP], steps[TORCH_DDP] = whole, trainer(whole_ddp, whole_optimizer)
    held[TORCH_DDP] = lambda: state_bytes(whole_optimizer)
    fsdp2 = make_model(config)  # the same units as shard="parameters" (every direct child holding parameters)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in fsdp2:
        if isinstance(layer, torch.nn.Linear):  # gathered in forward, freed, gathered again in backward: ZeRO-3
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(fsdp2, mesh=mesh)
    fsdp2_optimizer = torch.optim.AdamW(fsdp2.parameters(), lr=config.lr)
    models[TORCH_FSDP2], steps[TORCH_FSDP2] = fsdp2, trainer(fsdp2, fsdp2_optimizer)
    held[TORCH_FSDP2] = lambda: state_bytes(fsdp2_optimizer)
    timed = [name for name in steps if KEYS[name] in only]
    batches = make_batches(config, dist.get_rank())
    cursor = dict.fromkeys(steps, 0)

    def phase(name: str, count: int, stamps: list[float] | None = None) -> None:
        for _ in range(count):
            steps[name](batches[cursor[name] % len(batches)])
            cursor[name] += 1
            if stamps is not None:
                stamps.append(time.perf_counter())

    figures: dict[str, dict[str, list[float]]] = {name: {"step_ms": [], "cpu_ms": []} for name in timed}
    for _, name in in_turns(timed, config.repeats):
        phase(name, config.warmup)
        dist.barrier()
        stamps: list[float] = []
        cpu, started = time.process_time(), time.perf_counter()
        phase(name, config.steps, stamps)
        cpu = time.process_time() - cpu
        times = [later - earlier for earlier, later in zip([started, *stamps], stamps)]
        figures[name]["step_ms"].append(1e3 * slowest_rank(statistics.median(times)))
        figures[name]["cpu_ms"].append(1e3 * cpu / config.steps)
    # The timed contenders took the same steps on the same batches: those can be compared bit for bit.
    flat = {name: torch.cat([gathered(p).reshape(-1) for p in models[name].parameters()]) for name in timed}
    same = {name: bool(torch.equal(flat[name], flat[BASELINE])) for name in flat
            if name.startswith("replicator") and BASELINE in flat}
    if ZERO3 in flat and TORCH_FSDP2 in flat:
        same[f"{ZERO3} to {TORCH_FSDP2}"] = bool(torch.equal(flat[ZERO3], flat[TORCH_FSDP2]))
    return {"figures": figures, "state_bytes": {name: count() for name, count in held.items() if name in timed},
            "bit_equal_to_unsharded": same, "parameters": sum(p.numel() for p in models[BASELINE].parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field, default in asdict(Config()).items():
        parser.add_argument(f"--{field}", type=type(default), default=default)
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave glibc's heap settings at their defaults (replicator launch keeps the heap)")
    parser.add_argument("--only", default=",".join(KEYS.values()),
                        help=f"the contenders to time, comma-separated among {', '.join(KEYS.values())}")
    add_json_argument(parser, "sharding")
    arguments = parser.parse_args()
    only = tuple(arguments.only.split(","))
    unknown = sorted(set(only) - set(KEYS.values()))
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose among {', '.join(KEYS.values())}")
    config = Config(**{k: v for k, v in vars(arguments).items() if k not in ("json", "glibc_default", "only")})
    header = machine()
    print(machine_line(header))
    if not arguments.glibc_default:  # as `replicator launch` runs replicas; every contender shares the processes
        os.environ.update(heap_kept_environment())
    results = run_replicas(replica, config.replicas, config, only, timeout_s=1800)
    first = results[0]
    step_ms = {name: series["step_ms"] for name, series in first["figures"].items()}
    # Lower is better for times: compare() ratios are value / peer, so < 1 means faster than the peer.
    report: dict[str, Any] = {"config": asdict(config), "parameters": first["parameters"], "contenders": {},
                              "heap_kept": not arguments.glibc_default, "only": list(only)}
    for peer in [name for name in (BASELINE, TORCH_ZERO, TORCH_FSDP2_KEPT, TORCH_FSDP2) if name in step_ms]:
        comparison = compare(step_ms, peer)
        print(f"\nstep time (ms, slowest replica; median [min, max] over {config.repeats} turns) against {peer}:")
        for name, figures in comparison.items():
            cpu = statistics.median(first["figures"][name]["cpu_ms"])
            print(f"  {name:40s} {figures.spread.median:8.1f} [{figures.spread.min:.1f}, {figures.spread.max:.1f}]"
                  f"  paired ratio {ratio_text(figures.paired)}  cpu {cpu:.1f} ms/step")
            report["contenders"].setdefault(name, {})[f"against {peer}"] = {
                "step_ms": asdict(figures.spread), "paired_ratio": figures.paired,
                "ratio_of_medians": figures.ratio_of_medians, "cpu_ms_per_step": cpu}
    print("\noptimizer state per replica (bytes, from the local tensors; replica 0's):")
    for name, count in first["state_bytes"].items():
        print(f"  {name:40s} {count:>12,d}  ({count / (8 * first['parameters']):.3f} x 8 bytes per parameter)")
    print(f"\nbit for bit equal to {BASELINE}: {results[0]['bit_equal_to_unsharded']}")
    report["state_bytes"] = [result["state_bytes"] for result in results]
    report["bit_equal_to_unsharded"] = first["bit_equal_to_unsharded"]
    write_json(arguments.json, report, header)


if __name__ == "__main__":
    main()
