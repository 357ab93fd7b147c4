"""Peak memory of a pipeline stage: one process training the whole model, against 2 stages built whole or on meta.

Command (from the repository root; under a minute on 2 cores):

    .venv/bin/python benchmarks/pipeline_memory.py --layers 16 --width 1448

A stack of `--layers` Linear(width, width) + ReLU (16 x 1448: 33.6 M parameters, 134 MB in
fp32) trains `--steps` Adam steps, in one plain process, and as `--stages` stages of one replica
(balance="params") with the model built whole in every process, then on the meta device.
Each case runs in fresh processes. Memory is the process's resident set (RSS, from
/proc/self/status), above its level before the model is built: its peak (VmHWM, reset through
/proc/self/clear_refs once torch and the process group are up) by the end of the build
(`repl.pipeline()`), by the end of training, and the level after the last step.
RSS counts memory the C allocator keeps after torch freed it: glibc raises its mmap threshold
when a large block is freed, and later blocks of that size then come from a heap that rarely
shrinks. The script fixes the threshold (MALLOC_MMAP_THRESHOLD_, 128 KiB, in the processes
it starts) so that a freed tensor leaves the RSS and the figures count tensors. Training the whole model holds
4 copies of the parameters' bytes (parameters, gradients, Adam's two moments); a stage should
hold 4 copies of its own.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_replicas


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> float:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status_mb("VmRSS")


def _layers(depth: int, width: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [module for _ in range(depth) for module in (torch.nn.Linear(width, width), torch.nn.ReLU())]


def _batches(width: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, width, generator=generator), torch.randint(0, width, (8,), generator=generator))
            for _ in range(steps)]


def one_process(depth: int, width: int, steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    base = _reset_peak()
    model = torch.nn.Sequential(*_layers(depth, width))
    built = _status_mb("VmHWM") - base
    optimizer = torch.optim.Adam(model.parameters())
    for x, y in _batches(width, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    gc.collect()
    return {"build_mb": built, "peak_mb": _status_mb("VmHWM") - base, "after_mb": _status_mb("VmRSS") - base,
            "params_mb": sum(p.nbytes for p in model.parameters()) / 2**20}


def pipeline_stage(depth: int, width: int, steps: int, stages: int, meta: bool) -> dict[str, float]:
    torch.set_num_threads(1)
    repl = rp.Replicator(stages=stages, chunks=2)
    base = _reset_peak()
    with repl.scope():
        with torch.device("meta" if meta else "cpu"):
            layers = _layers(depth, width)
        pipe = repl.pipeline(layers, balance="params")
        del layers
        built = _status_mb("VmHWM") - base
        optimizer = repl.wrap_optimizer(torch.optim.Adam(pipe.parameters()))

    def step_fn(ctx: rp.ReplicaContext, batch):
        optimizer.zero_grad()
        loss = pipe.train_step(batch[0], batch[1], F.cross_entropy)
        optimizer.step()
        return loss

    for _ in repl.run(step_fn, _batches(width, steps), progress=False):
        pass
    gc.collect()
    return {"build_mb": built, "peak_mb": _status_mb("VmHWM") - base, "after_mb": _status_mb("VmRSS") - base,
            "params_mb": sum(p.nbytes for p in pipe.parameters()) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1448)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # read by the processes started below
    shape = (args.layers, args.width, args.steps)
    rows = [("one process, whole model", run_replicas(one_process, 1, *shape, timeout_s=600))]
    for meta in (False, True):
        label = f"{args.stages} stages, built {'on meta' if meta else 'whole'}"
        rows.append((label, run_replicas(pipeline_stage, args.stages, *shape, args.stages, meta, timeout_s=600)))
    print(f"{'case':<28} {'process':>7} {'params MB':>10} {'build peak MB':>14} {'peak RSS MB':>12} "
          f"{'RSS after MB':>13}")
    for label, results in rows:
        for rank, figures in enumerate(results):
            print(f"{label:<28} {rank:>7} {figures['params_mb']:>10.1f} {figures['build_mb']:>14.1f} "
                  f"{figures['peak_mb']:>12.1f} {figures['after_mb']:>13.1f}")


if __name__ == "__main__":
    main()
