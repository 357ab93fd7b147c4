"""examples/transformer_pipeline.py under `replicator launch -n 4`: 2 stages x 2 replicas train as one process would."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from _numerics import assert_within, bound

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "transformer_pipeline.py"
# A model small enough that 4 processes on 2 cores finish in seconds; 2 micro-batches per replica.
ARGS = ["--steps", "5", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
        "--batch-size", "8", "--chunks", "2", "--log-every", "1", "--eval-every", "5", "--eval-batches", "1"]


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("transformer_pipeline", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def one_process_losses(example: ModuleType, replicas: int) -> list[float]:
    """The same model, data and optimizer in this process, on the replicas' batches joined."""
    args = example.parse_args(ARGS)
    chars, train_data, _ = example.load_data(args.block_size)
    config = example.GPTConfig(len(chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(*example.gpt_layers(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loaders = []
    for replica in range(replicas):
        sampler = torch.utils.data.DistributedSampler(train_data, num_replicas=replicas, rank=replica, shuffle=True,
                                                      seed=args.seed, drop_last=True)
        loaders.append(iter(torch.utils.data.DataLoader(train_data, batch_size=args.batch_size // replicas,
                                                        sampler=sampler, drop_last=True)))
    losses = []
    for _ in range(args.steps):
        batches = [next(loader) for loader in loaders]
        inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        loss = example.loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.timeout(120)
def test_example_trains_on_two_stages_by_two_replicas(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "replicator.cli", "launch", "-n", "4", str(EXAMPLE), *ARGS,
               "--report", str(tmp_path), "--trace", str(tmp_path / "trace")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=ROOT,
                            env={"REPLICATOR_PROGRESS": "0", "REPLICATOR_DEVICE": "cpu", "PATH": "/usr/bin:/bin",
                                 "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 replica(s) x 2 stage(s)" in result.stdout
    assert "tokens/s" in result.stdout and "val loss" in result.stdout

    # The last step's timeline: on each stage, every micro-batch went forward and backward once.
    trace = json.loads((tmp_path / "trace" / "pipeline_trace.json").read_text())["traceEvents"]
    actions = sorted((e["tid"], e["name"]) for e in trace if e["ph"] == "X" and e["name"][0] in "FB")
    assert actions == sorted((stage, f"{op} {i}") for stage in (0, 1) for op in "FB" for i in range(2))
    assert (tmp_path / "trace" / "pipeline_gantt.png").stat().st_size > 0

    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("stage*_replica*.json"))]
    assert sorted((r["stage"], r["replica"]) for r in reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["stages"] == 2 and r["replicas"] == 2 for r in reports)
    # Each stage holds a real share of the model (the split is by parameter count).
    sizes = {r["stage"]: r["parameters"] for r in reports}
    assert min(sizes.values()) > 0.3 * sum(sizes.values())

    losses = reports[0]["losses"]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert all(r["losses"] == losses for r in reports), "every process reports the same averaged loss"
    assert losses[-1] < losses[0] - 0.05, f"the loss should fall: {losses}"
    for stage in (0, 1):
        replicas = [r["checksum"] for r in reports if r["stage"] == stage]
        # Bit for bit: both replicas of a stage apply the same averaged gradients to the same parameters, with the
        # same shapes and so the same kernels, and checksum them by the same operations.
        assert replicas[0] == replicas[1], f"stage {stage}: replicas diverged"

    # A pipeline that paired inputs with the wrong targets, routed a micro-batch or its
    # gradient wrongly, or lost one, drifts away from one process on the same global batches.
    # The same global batches in one process: each loss is a mean over 8 x 16 tokens through fan-ins of at most
    # 4 x 32 (the MLP) in 2 blocks of attention (32 wide) and MLP, after up to 5 AdamW steps on those sums.
    want = one_process_losses(load_example(), replicas=2)
    length = 8 * 16 + 2 * (32 + 4 * 32) + 4
    assert_within(torch.tensor(losses), torch.tensor(want), bound(torch.float32, max(want), length, steps=5), "losses")
