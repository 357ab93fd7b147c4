"""GPU smoke test: one NCCL replica training ResNet-50 in mixed precision against a plain PyTorch loop.

Command (from the repository root, on a machine with a CUDA GPU; figures go to
benchmarks/results/gpu_smoke.json):

    .venv/bin/python benchmarks/gpu_smoke.py --repeats 5 --steps 30 --batch 64 --precision bf16

`--precision bf16` compares `rp.Replicator(precision="bf16")` with a loop under `torch.autocast`;
`--precision fp16` compares `precision="fp16"` (its loss scale on CUDA) with autocast and
`torch.amp.GradScaler`.

Without CUDA it prints why it skips and exits 0. `--cpu-dry-run` runs the same code path on
the CPU with Gloo and tiny images, only to check the script itself where no GPU exists.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import Spread, add_json_argument, in_turns, machine, machine_line, paired_ratio, write_json
from torch import nn

import replicator as rp
from replicator.launch import free_port

Batch = tuple[torch.Tensor, torch.Tensor]


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: the stride sits on the 3x3 convolution, as in torchvision."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        width = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, width, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != width:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, width, 1, stride=stride, bias=False), nn.BatchNorm2d(width)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50(nn.Module):
    """ResNet-50 (Bottleneck blocks [3, 4, 6, 3], 25.6 M parameters), defined here so torchvision is
    optional."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        inplanes = 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layers = []
            for index in range(blocks):
                layers.append(Bottleneck(inplanes, planes, stride if index == 0 else 1))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1), 1))


def _join_as_single_replica() -> None:
    """torchrun's variables for a world of one, so rp.Replicator() initialises a real process group."""
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
    )


def _plain_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, device_type: str, precision: str
) -> Callable[[Batch], torch.Tensor]:
    """The loop a user writes without replicator: autocast, and for fp16 GradScaler."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None

    def step(batch: Batch) -> torch.Tensor:
        images, labels = batch
        optimizer.zero_grad()
        with torch.autocast(device_type, dtype=dtype):
            loss = F.cross_entropy(model(images), labels)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return step


def _replicated_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Batch], torch.Tensor]:
    """The step_fn body: single-device fp32 code; precision= adds autocast and fp16's loss scale."""

    def step(batch: Batch) -> torch.Tensor:
        images, labels = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions per contender")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per repetition")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before each timed phase (>= 1)")
    parser.add_argument("--batch", type=int, default=64, help="images per step")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16",
                        help="mixed precision of both contenders (fp16: replicator's loss scale against GradScaler)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU: exercise the script on CPU/Gloo with tiny inputs")
    add_json_argument(parser, "gpu_smoke")
    options = parser.parse_args(argv)
    if options.repeats < 1 or options.steps < 1 or options.warmup < 1 or options.batch < 1:
        parser.error("--repeats, --steps, --warmup and --batch must be positive")

    if not torch.cuda.is_available() and not options.cpu_dry_run:
        print(f"gpu_smoke: skipped, CUDA is not available (torch {torch.__version__}); nothing was measured.")
        return 0
    if options.cpu_dry_run:
        if torch.cuda.is_available():
            parser.error("--cpu-dry-run is for machines without CUDA; on this one run the real smoke test")
        options.image_size, options.batch = min(options.image_size, 64), min(options.batch, 4)
    expected_backend, expected_device = ("gloo", "cpu") if options.cpu_dry_run else ("nccl", "cuda")
    header = machine()

    _join_as_single_replica()
    repl = rp.Replicator(precision=options.precision)
    device = repl.device
    backend = dist.get_backend(repl.groups.replica) if repl.groups.replica is not None else "none"
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick its fastest kernels once

    torch.manual_seed(0)
    with repl.scope():
        model = ResNet50().to(memory_format=torch.channels_last)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-5))
    plain = ResNet50().to(device, memory_format=torch.channels_last)
    plain.load_state_dict(model.state_dict())
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-5)

    generator = torch.Generator().manual_seed(1)
    images = torch.randn(options.batch, 3, options.image_size, options.image_size, generator=generator)
    labels = torch.randint(0, 1000, (options.batch,), generator=generator)
    batch = (images.to(device).contiguous(memory_format=torch.channels_last), labels.to(device))

    # The proof that this is the real thing: an NCCL collective on CUDA tensors over the
    # replicas' group, and every parameter and input on the GPU. (With one replica, ctx.all_sum
    # returns its input without communicating, so the probe calls the group directly.)
    probe = torch.ones(4, device=device)
    if repl.groups.replica is not None:
        dist.all_reduce(probe, group=repl.groups.replica)
    checks = {
        "backend": backend,
        "replicator device": str(device),
        "parameters on": sorted({str(p.device) for p in model.parameters()}),
        "batch on": str(batch[0].device),
        "all_reduce probe on the replica group": f"{probe.tolist()} on {probe.device}",
    }
    verified = (
        backend == expected_backend and device.type == expected_device
        and all(p.device.type == expected_device for p in model.parameters())
        and batch[0].device.type == expected_device and probe.device.type == expected_device
    )

    replicated_step = _replicated_step(model, optimizer)

    def step_fn(ctx: rp.ReplicaContext, data: Batch) -> torch.Tensor:
        return replicated_step(data)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run_walls: list[float] = []  # each whole run() call: its steps plus its start and end

    def run_replicator(warmup: int, count: int) -> float:
        """Seconds for `count` steps inside one run(), after `warmup` steps of it: the steady state a long
        training sees. run()'s start and end (its agreement, checks and record) are timed apart."""
        total, timed_from, timed_to = warmup + count, 0.0, 0.0
        started = time.perf_counter()
        # run() counts steps over the whole training: ask for `total` more.
        steps = repl.run(step_fn, [batch] * total, steps=repl.global_step + total, progress=False, warmup_steps=0)
        for index, _ in enumerate(steps):
            if index in (warmup - 1, total - 1):  # the step's work is queued when run() yields it
                synchronize()
                timed_from, timed_to = (time.perf_counter(), timed_to) if index == warmup - 1 else (
                    timed_from, time.perf_counter())
        run_walls.append(time.perf_counter() - started)
        return timed_to - timed_from

    plain_step = _plain_step(plain, plain_optimizer, device.type, options.precision)
    plain_steps = 0

    def run_plain(warmup: int, count: int) -> float:
        nonlocal plain_steps
        for _ in range(warmup):
            plain_step(batch)
        synchronize()
        started = time.perf_counter()
        for _ in range(count):
            plain_step(batch)
        synchronize()  # the GPU must have finished the work being timed
        plain_steps += warmup + count
        return time.perf_counter() - started

    contenders: dict[str, Callable[[int, int], float]] = {
        "replicator, 1 replica (repl.run)": run_replicator, "plain PyTorch loop": run_plain,
    }
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for _, name in in_turns(names, options.repeats):  # alternate who goes first
        seconds = contenders[name](options.warmup, options.steps)
        rates[name].append(options.batch * options.steps / seconds)
    # What a run() call adds once, besides its steps at the steady rate.
    per_step = options.batch / Spread.of(rates[names[0]]).median
    run_fixed_ms = [1000 * (wall - (options.warmup + options.steps) * per_step) for wall in run_walls]

    # Same weights, same data, same number of steps: a large gap would mean different work.
    checks["steps, replicator / plain"] = f"{repl.global_step} / {plain_steps}"
    verified = verified and repl.global_step == plain_steps
    worst = max(float((a.detach().float() - b.detach().float()).abs().max())
                for a, b in zip(model.parameters(), plain.parameters()))
    scale = max(float(p.detach().abs().max()) for p in plain.parameters())

    spreads = {name: Spread.of(values) for name, values in rates.items()}
    medians = {name: spread.median for name, spread in spreads.items()}
    ratio = medians[names[0]] / medians[names[1]]
    paired = paired_ratio(rates[names[0]], rates[names[1]])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: figures mean nothing)"
    print(machine_line(header))
    print(f"ResNet-50, {options.image_size}x{options.image_size}, batch {options.batch}, {options.precision} autocast, "
          f"channels_last, on {where}")
    print(f"{options.repeats} repetitions x {options.steps} timed steps (+{options.warmup} warm-up)")
    for key, value in checks.items():
        print(f"  {key}: {value}")
    what = "Gloo and CPU verified (dry run)" if options.cpu_dry_run else "NCCL and CUDA verified"
    print(f"  {what}: {'yes' if verified else 'NO'}")
    print("\n| contender | median images/s | min | max |\n| --- | ---: | ---: | ---: |")
    for name, spread in spreads.items():
        print(f"| {name} | {spread.median:,.1f} | {spread.min:,.1f} | {spread.max:,.1f} |")
    print(f"\nratio replicator / plain loop: {ratio:.3f} (ratio of medians), {paired:.3f} (median paired)")
    print(f"each run() call's start and end, beyond its steps: median {Spread.of(run_fixed_ms).median:.1f} ms")
    print(f"parameter max |diff| after the runs: {worst:.3g} (largest parameter {scale:.3g}; mixed precision "
          "and cuDNN's non-deterministic kernels allow small differences)")
    write_json(options.json, {
        "device": where, "options": vars(options), "checks": checks, "verified": verified, "rates": rates,
        "run_fixed_ms": run_fixed_ms,
        "medians": medians, "ratio": ratio, "paired_ratio": paired, "parameter_max_diff": worst,
    }, header)
    repl.close()
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
