"""Scores for generated digits without downloads: a digits classifier stands in for Inception.

A small CNN trained once on scikit-learn's real digits (cached in the run directory) gives:

- conditional accuracy: the share of generated samples classified as the class they were asked for;
- an Inception-Score-like score: exp(E_x KL(p(y|x) || p(y))), from 1 (one class, or no
  confident class) to 10 (ten equally frequent classes, each sample confidently one);
- a Fréchet distance on the classifier's penultimate features between generated and held-out
  real digits (FID's formula; real-vs-real on disjoint real sets is the floor);
- a classification accuracy score (CAS, Ravuri & Vinyals 2019): a fresh classifier trained
  on generated digits only, tested on real ones;
- a PNG grid of samples, one row per class.

The metrics live next to the example rather than in `replicator`: they are about digits and
this classifier, not about distributing training.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DigitsClassifier", "train_classifier", "cached_classifier", "classify", "conditional_accuracy",
           "inception_score", "frechet_distance", "classification_accuracy_score", "save_grid", "scores"]


class DigitsClassifier(nn.Module):
    """Two convolutions and a 64-wide penultimate layer whose activations are the Fréchet distance's features."""

    def __init__(self, image_size: int, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(2 * width * ((image_size + 1) // 2) ** 2, 64), nn.ReLU(),
        )
        self.head = nn.Linear(64, num_classes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def train_classifier(images: torch.Tensor, labels: torch.Tensor, image_size: int, *, epochs: int = 30,
                     seed: int = 0) -> DigitsClassifier:
    """Adam on (images in [-1, 1], labels), batch 64, with one-pixel random shifts so generated digits,
    which are rarely centred as exactly as the scanned ones, are still recognised."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DigitsClassifier(image_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    with torch.enable_grad():  # callers may evaluate under no_grad
        _fit(model, optimizer, images, labels, epochs, generator)
    return model.eval()


def _fit(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor, epochs: int,
         generator: torch.Generator) -> None:
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), 64):
            chosen = order[start : start + 64]
            shift = torch.randint(-1, 2, (2,), generator=generator).tolist()
            batch = torch.roll(images[chosen], shifts=shift, dims=(2, 3))
            loss = F.cross_entropy(model(batch), labels[chosen])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


@torch.no_grad()
def classify(model: DigitsClassifier, images: torch.Tensor, batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(penultimate features, class probabilities) of `images`, in float64."""
    features = torch.cat([model.features(images[i : i + batch]) for i in range(0, len(images), batch)])
    return features.double(), F.softmax(model.head(features), dim=1).double()


def accuracy(model: DigitsClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    return conditional_accuracy(classify(model, images)[1], labels)


def cached_classifier(run_dir: str, image_size: int, train: tuple[torch.Tensor, torch.Tensor],
                      test: tuple[torch.Tensor, torch.Tensor], epochs: int = 30) -> tuple[DigitsClassifier, float]:
    """The evaluation classifier and its test accuracy: trained on the first call, read from `run_dir` after."""
    path = os.path.join(run_dir, f"digits_classifier_{image_size}px.pt")
    if os.path.exists(path):
        model = DigitsClassifier(image_size)
        model.load_state_dict(torch.load(path, weights_only=True))
        model.eval()
    else:
        model = train_classifier(*train, image_size, epochs=epochs)
        os.makedirs(run_dir, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"  # a concurrent run never reads half a file
        torch.save(model.state_dict(), partial)
        os.replace(partial, path)
    return model, accuracy(model, *test)


def conditional_accuracy(probabilities: torch.Tensor, requested: torch.Tensor) -> float:
    """The share of samples whose most probable class is the one requested."""
    return float((probabilities.argmax(dim=1) == requested).double().mean())


def inception_score(probabilities: torch.Tensor, eps: float = 1e-12) -> float:
    """exp(mean KL(p(y|x) || p(y))): 1 when every sample gets the same distribution, K for K classes met
    equally often, each confidently."""
    p = probabilities.double()
    marginal = p.mean(dim=0, keepdim=True)
    kl = (p * (torch.log(p + eps) - torch.log(marginal + eps))).sum(dim=1)
    return float(torch.exp(kl.mean()))


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||mu_a - mu_b||^2 + Tr(C_a + C_b - 2 (C_a C_b)^1/2) between Gaussians fitted to feature rows.

    Tr((C_a C_b)^1/2) is the sum of square roots of the eigenvalues of C_a^1/2 C_b C_a^1/2, a symmetric
    positive semi-definite matrix, so eigh suffices (no scipy, no complex round-off).
    """
    a, b = a.double(), b.double()
    mean_a, mean_b = a.mean(dim=0), b.mean(dim=0)
    cov_a, cov_b = torch.cov(a.T), torch.cov(b.T)
    values, vectors = torch.linalg.eigh(cov_a)
    root_a = vectors @ torch.diag(values.clamp_min(0).sqrt()) @ vectors.T
    middle = root_a @ cov_b @ root_a
    trace_root = torch.linalg.eigvalsh((middle + middle.T) / 2).clamp_min(0).sqrt().sum()
    distance = (mean_a - mean_b).square().sum() + torch.trace(cov_a) + torch.trace(cov_b) - 2 * trace_root
    return max(float(distance), 0.0)


def classification_accuracy_score(generated: tuple[torch.Tensor, torch.Tensor],
                                  real_test: tuple[torch.Tensor, torch.Tensor], image_size: int,
                                  epochs: int = 15) -> float:
    """Train a classifier on generated (images, requested labels) alone; its accuracy on real test digits."""
    model = train_classifier(*generated, image_size, epochs=epochs, seed=1)
    return accuracy(model, *real_test)


def save_grid(images: torch.Tensor, path: str, rows: int, title: str | None = None) -> None:
    """Images in [-1, 1] as a PNG grid of `rows` rows (one per class when sorted by class)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = math.ceil(len(images) / rows)
    size = images.shape[-1]
    canvas = torch.ones(rows * (size + 1) + 1, columns * (size + 1) + 1)
    for index, image in enumerate(images[:, 0].clamp(-1, 1)):
        row, column = divmod(index, columns)
        top, left = 1 + row * (size + 1), 1 + column * (size + 1)
        canvas[top : top + size, left : left + size] = (image + 1) / 2
    figure = plt.figure(figsize=(columns * 0.5, rows * 0.5 + (0.4 if title else 0)))
    plt.imshow(1 - canvas.numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    plt.axis("off")
    if title:
        plt.title(title, fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)


def scores(classifier: DigitsClassifier, generated: torch.Tensor, requested: torch.Tensor,
           real_test: tuple[torch.Tensor, torch.Tensor], image_size: int,
           real_reference: torch.Tensor | None = None, cas: bool = True) -> dict[str, float]:
    """Every score of one set of generated digits (and, given other real digits, the real-vs-real floor)."""
    features, probabilities = classify(classifier, generated)
    real_features, _ = classify(classifier, real_test[0])
    result = {
        "conditional_accuracy": conditional_accuracy(probabilities, requested),
        "inception_score": inception_score(probabilities),
        "fid_digits": frechet_distance(features, real_features),
    }
    if cas:
        result["cas"] = classification_accuracy_score((generated, requested), real_test, image_size)
    if real_reference is not None:
        result["fid_digits_real_vs_real"] = frechet_distance(classify(classifier, real_reference)[0], real_features)
    return result
