"""Train a CIFAR-style ResNet on scikit-learn's handwritten digits: one replica or many, same code.

    python -m replicator.demo.digits                                # 1 replica
    replicator launch -n 2 -m replicator.demo.digits --epochs 12    # 2 replicas, same global batch
    replicator launch --max-restarts 3 -n 2 -m replicator.demo.digits --checkpoint-dir ckpt --checkpoint-every 20
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp

__all__ = ["BasicBlock", "ResNet", "load_digits_split", "main"]


# -- the model: the CIFAR ResNet of He et al. 2016 (section 4.2), 6n+2 layers -----------------
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection; a 1x1 projection where the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Three stages of basic blocks (16, 32, 64 channels), each stage after the first halving the
    resolution; global average pooling and a linear classifier. blocks_per_stage=3 is ResNet-20."""

    def __init__(
        self, num_classes: int = 10, blocks_per_stage: int = 2, widths: tuple[int, ...] = (16, 32, 64)
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers: list[nn.Module] = []
        in_channels = widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                layers.append(BasicBlock(in_channels, width, stride=2 if stage > 0 and block == 0 else 1))
                in_channels = width
        self.stages = nn.Sequential(*layers)
        self.classifier = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(x))
        return self.classifier(features.mean(dim=(2, 3)))


# -- the data: 1,797 real handwritten digits, shipped with scikit-learn (no download) -------
def load_digits_split(
    image_size: int = 8, test_fraction: float = 0.2, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Stratified train/test split of the digits as (N, 1, size, size) images, standardized on train."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    if image_size != images.shape[-1]:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    train_x, test_x = images[train_idx], images[test_idx]
    # Test images are scaled with the training set's statistics: nothing leaks from the test set.
    mean, std = train_x.mean(), train_x.std()
    return (
        TensorDataset((train_x - mean) / std, labels[train_idx]),
        TensorDataset((test_x - mean) / std, labels[test_idx]),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12, help="passes over the training set")
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps instead (timing runs)")
    parser.add_argument("--global-batch", type=int, default=256, help="samples per step over all replicas")
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate (one-cycle schedule)")
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--blocks", type=int, default=2, help="basic blocks per stage")
    # The digits are 8x8; the CIFAR ResNet was designed for 32x32. At 8x8 a step is so short (~25 ms
    # for 64 images on one core) that fixed per-step collective latency would dominate it.
    parser.add_argument("--image-size", type=int, default=32, help="resize the 8x8 digits to this (bilinear)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the steady-state figures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reducer", default="auto", help="how gradients are summed (see rp.Replicator)")
    parser.add_argument("--result", default=None, help="replica 0 writes the figures here as JSON")
    parser.add_argument("--checkpoint-dir", default=None, help="resume from and save checkpoints in this directory")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="save a checkpoint every N steps")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or breakdown table")
    return parser.parse_args(argv)


@torch.no_grad()
def evaluate(model: nn.Module, test_set: TensorDataset, ctx: rp.ReplicaContext) -> float:
    """Test accuracy over the whole test set, each replica scoring a disjoint slice.

    Every replica evaluates one and the same model: run() ended by averaging the batch-norm
    running statistics, which each replica had tracked over its own shard."""
    model.eval()
    images, labels = test_set.tensors
    mine = slice(ctx.replica_id, None, ctx.num_replicas)  # strided: every sample scored exactly once
    correct = int((model(images[mine]).argmax(dim=1) == labels[mine]).sum())
    correct_total, scored_total = ctx.all_sum(torch.tensor([correct, len(labels[mine])], dtype=torch.float64)).tolist()
    model.train()
    return correct_total / scored_total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, evaluate, and return (on replica 0 also write) the run's figures."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = load_digits_split(args.image_size, seed=args.seed)

    repl = rp.Replicator(reducer=args.reducer)
    with repl.scope():
        model = ResNet(num_classes=10, blocks_per_stage=args.blocks)
        optimizer = repl.wrap_optimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=args.weight_decay)
        )

    def input_fn(ctx: rp.InputContext) -> DataLoader:
        # Each replica reads a disjoint shard; equal shards and drop_last keep every step's batch full.
        sampler = ctx.sampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
        return DataLoader(train_set, batch_size=ctx.per_replica_batch_size(args.global_batch), sampler=sampler,
                          drop_last=True)

    inputs = repl.prepare_input(input_fn)
    # Every replica's shard holds len/N samples and yields (len/N) // (global_batch/N) full batches.
    steps = args.steps if args.steps is not None else args.epochs * (len(train_set) // args.global_batch)
    # One-cycle: a short warm-up tames the first steps of a freshly initialized BN net.
    scheduler = repl.wrap_scheduler(
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(steps, 1), pct_start=0.15)
    )

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()  # all-reduces gradients bucket by bucket; ends with their average
        optimizer.step()  # updates, as on one device
        scheduler.step()
        return ctx.all_mean(loss.detach())

    losses: list[float] = []
    started = time.perf_counter()
    # epochs= passes over the input, each reshuffled (the sampler is told the epoch); a timing run
    # gives steps= alone and goes through as many epochs as that takes.
    epochs = None if args.steps is not None else args.epochs
    # With --checkpoint-dir a restarted run resumes in the middle of its epoch, exactly, without re-reading.
    for _, loss in repl.run(step_fn, inputs, steps=steps, epochs=epochs, progress=not args.quiet,
                            warmup_steps=args.warmup_steps, checkpoint_dir=args.checkpoint_dir,
                            checkpoint_every=args.checkpoint_every):
        losses.append(float(loss))
    train_seconds = time.perf_counter() - started
    run = repl.last_run

    accuracy = evaluate(model, test_set, repl.context)
    head = losses[: min(5, len(losses))]
    tail = losses[-min(5, len(losses)) :]
    result = {
        "replicas": repl.num_replicas,
        "global_batch": args.global_batch,
        "per_replica_batch": args.global_batch // repl.num_replicas,
        "steps": run["steps"],
        "epochs": None if args.steps is not None else args.epochs,
        "test_accuracy": accuracy,
        "images_per_second": run["samples_per_second"],  # global, after the warm-up steps
        "communication_share": run["communication_share"],
        "step_time_ms": 1e3 * args.global_batch / max(run["samples_per_second"], 1e-9),  # steady state
        "first_loss": sum(head) / max(len(head), 1),
        "last_loss": sum(tail) / max(len(tail), 1),
        "train_seconds": train_seconds,
        "threads": torch.get_num_threads(),
        "run_dir": run.get("run_dir"),  # the run's record (replicator report reads it)
    }
    speed = (f"{result['images_per_second']:,.0f} images/s, "
             f"communication {100 * result['communication_share']:.1f}% of step time")
    if args.steps is None:
        repl.print(f"test accuracy {100 * accuracy:.2f}% after {run['steps']} steps on {repl.num_replicas} replica(s); "
                   f"{speed}")
    else:  # a timing run: too short for batch-norm statistics to settle, so accuracy means little
        repl.print(f"timing run of {run['steps']} steps on {repl.num_replicas} replica(s): {speed}")
    if args.result and repl.is_main:
        with open(args.result, "w") as handle:
            json.dump(result, handle, indent=2)
    if math.isnan(result["last_loss"]):
        raise FloatingPointError("the training loss became NaN; lower --lr")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
