"""ctx.gather_for_metrics: all 1,797 digits evaluated over 2 or 3 replicas, each once, in dataset order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import replicator as rp
from replicator.testing import run_replicas

from _numerics import assert_within, linear_bound

# Per-replica batch sizes whose last batches are uneven: 1,797 over 2 replicas is 899 + 898 samples, in
# batches of 64 (the last of 3 and 2); over 3 replicas 599 each, in batches of 50 (the last of 49).
BATCH = {2: 64, 3: 50}


def digits() -> TensorDataset:
    """scikit-learn's 1,797 handwritten digits (shipped with it, no download), standardized."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.data, dtype=torch.float32)
    return TensorDataset((images - images.mean()) / images.std(), torch.tensor(data.target))


def nearest_mean_classifier(dataset: TensorDataset) -> torch.nn.Linear:
    """A linear model that scores each class by closeness to its mean image: about 90% right, no training."""
    images, labels = dataset.tensors
    means = torch.stack([images[labels == digit].mean(0) for digit in range(10)])
    model = torch.nn.Linear(64, 10)
    with torch.no_grad():
        model.weight.copy_(means)
        model.bias.copy_(-0.5 * (means * means).sum(1))
    return model


@torch.no_grad()
def predict(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> dict[str, torch.Tensor]:
    logits, labels = [], []
    for images, targets in loader:
        logits.append(model(images.to(device)))
        labels.append(targets.to(device))
    return {"logits": torch.cat(logits), "labels": torch.cat(labels)}


def evaluate() -> dict[str, Any]:
    repl = rp.Replicator()
    dataset = digits()
    with repl.scope():
        model = nearest_mean_classifier(dataset)
    ctx, batch = repl.context, BATCH[repl.num_replicas]
    found: dict[str, Any] = {}
    # The split without padding: the replicas' rows, concatenated, are the dataset's.
    loader = DataLoader(dataset, batch_size=batch, sampler=ctx.evaluation_sampler(dataset))
    found["split"] = ctx.gather_for_metrics(predict(model, loader, repl.device))
    found["split, counted"] = ctx.gather_for_metrics(predict(model, loader, repl.device), sampler=loader)
    # DDP's recipe pads (drop_last=False) and shuffles; given the loader, the gather drops the padding.
    padded = DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(
        dataset, repl.num_replicas, repl.replica_id, shuffle=True, seed=3, drop_last=False))
    values = predict(model, padded, repl.device)
    found["padded"] = ctx.gather_for_metrics(values, sampler=padded)
    found["padded, plain all_gather"] = ctx.all_gather(values["labels"])
    accuracy = (found["split"]["logits"].argmax(1) == found["split"]["labels"]).double().mean()
    found["accuracy"] = float(accuracy)
    try:  # gathering one batch with the whole evaluation's sampler: every replica must refuse
        ctx.gather_for_metrics(predict(model, [next(iter(padded))], repl.device), sampler=padded)
    except rp.ReplicatorUsageError as error:
        found["error"] = str(error)
    return found


@pytest.mark.numerics  # a row's logits come from a GEMM whose kernel follows the batch's shape and the CPU
@pytest.mark.parametrize("replicas", [2, 3])
def test_gather_for_metrics_counts_1797_of_1797_in_dataset_order(replicas: int) -> None:
    dataset = digits()
    model = nearest_mean_classifier(dataset)
    with torch.no_grad():
        want_logits = model(dataset.tensors[0])
    want_labels = dataset.tensors[1]
    want_accuracy = float((want_logits.argmax(1) == want_labels).double().mean())
    assert want_accuracy > 0.85
    # The replicas compute each row in batches of 64 or 50 rows (the last of 2 or 3), the reference in one batch of
    # 1,797: MKL may take another GEMM kernel for each shape, on each CPU, so a row agrees only up to rounding: a
    # 65-roundings dot product (64 pixels, the bias) of terms summing to 85 at most, about 6.6e-4 at most. A row out
    # of place would be off by the distance between two digits' logits, O(1).
    tolerance = linear_bound(dataset.tensors[0], model.weight.detach(), model.bias.detach())
    # The predicted digits, and so the accuracy, must then come out the same on every CPU: the smallest gap between
    # a row's two best logits (3.1e-3 in this data set) is wider than two of those bounds, so no rounding flips it.
    best_two = want_logits.topk(2, dim=1).values
    assert bool((best_two[:, 0] - best_two[:, 1] > 2 * tolerance.amax(1)).all()), "a near tie: argmax may flip"
    for replica, found in enumerate(run_replicas(evaluate, replicas, timeout_s=180)):
        for case in ("split", "split, counted", "padded"):
            logits, labels = found[case]["logits"], found[case]["labels"]
            assert len(labels) == 1797, f"{case}: replica {replica} counted {len(labels)}"
            assert torch.equal(labels, want_labels), f"{case}: replica {replica}'s labels are out of order"
            assert_within(logits, want_logits, tolerance, f"{case}: replica {replica}'s logits")
            assert torch.equal(logits.argmax(1), want_logits.argmax(1)), case
        assert found["accuracy"] == want_accuracy
        # What gather_for_metrics fixes: a plain gather of the padded shards counts a sample twice.
        assert len(found["padded, plain all_gather"]) == 1797 + (-1797) % replicas
        assert "raised on every replica" in found["error"] and "concatenate every batch" in found["error"]
