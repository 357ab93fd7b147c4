"""The asynchronous benchmark's task: an MLP on scikit-learn's digits, the same for every contender."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replicator.demo.digits import load_digits_split

Batch = tuple[torch.Tensor, torch.Tensor]

TEST_FRACTION = 0.25  # 450 of the 1,797 images
SPLIT_SEED = 0  # one fixed split for every run


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training images, labels, test images, labels: 8x8 images flattened to 64 features, standardized on train."""
    train, test = load_digits_split(8, TEST_FRACTION, SPLIT_SEED)
    train_x, train_y = train.tensors
    test_x, test_y = test.tensors
    return train_x.flatten(1), train_y, test_x.flatten(1), test_y


def make_model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def make_optimizer(params: object, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)  # type: ignore[arg-type]


def shard_batches(x: torch.Tensor, y: torch.Tensor, batch: int, shard: int, shards: int, steps: int,
                  seed: int) -> list[Batch]:
    """`steps` batches of this shard (every `shards`-th training image), reshuffled every pass.

    The same arguments give the same batches in every contender, so every arm sees the same data.
    """
    mine = torch.arange(shard, len(x), shards)
    per_pass = len(mine) // batch
    out: list[Batch] = []
    epoch = 0
    while len(out) < steps:
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(
            1_000_000 * seed + 1000 * epoch + shard))]
        for start in range(0, per_pass * batch, batch):
            rows = order[start:start + batch]
            out.append((x[rows], y[rows]))
            if len(out) == steps:
                break
        epoch += 1
    return out


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def gradient_step(model: torch.nn.Module, batch: Batch) -> None:
    """Forward and backward of one batch: the gradients a parameter-server worker sends."""
    inputs, labels = batch
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(inputs), labels).backward()
