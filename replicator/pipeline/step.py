"""The state of one pipeline step on one stage, and the error every stage raises when the step fails."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from replicator.errors import ReplicatorError
from replicator.pipeline.split_backward import WeightGradient

__all__ = ["PipelineError", "StepState", "checked_normalizer"]


class PipelineError(ReplicatorError):
    """A pipeline step failed on some stage; every stage of that pipeline raises it.

    `reason` is the failure as the stage that failed described it (the same on every stage).
    """

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


@dataclass
class StepState:
    """What one train or eval step on one stage holds between its actions, by slot (chunk x M + micro-batch)."""

    training: bool
    failure: str | None = None  # what went wrong, as every stage will report it
    cause: BaseException | None = None  # the exception, when it was raised on this stage
    batch_size: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    loss_total: torch.Tensor | None = None  # the last stage's sum of the micro-batch losses
    loss_relayed: float | None = None  # the same, as the next stage's last gradient message carried it
    grads_in: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    grads_out: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    targets: list[Any] | None = None
    normalizer: float | None = None  # reduction="sum": what the summed loss is divided by
    losses_counted: int = 0  # micro-batch losses in loss_total so far
    weight_passes: dict[int, WeightGradient] = field(default_factory=dict)  # split backwards' deferred halves
    sent_before: dict[int, int] = field(default_factory=dict)  # transfers each neighbour had been sent before

    @property
    def ok(self) -> bool:
        return self.failure is None

    def fail(self, error: BaseException | str, where: str) -> None:
        """Record the step's first failure (an exception here, or a text from a neighbour) and drop its tensors."""
        if self.failure is not None:
            return
        if isinstance(error, BaseException):
            self.failure = f"{where} failed: {type(error).__name__}: {error}"
            self.cause = error
        else:
            self.failure = error
        self.drop_state()

    def loss_weight(self, i: int, reduction: str) -> float:
        """What micro-batch i's loss is multiplied by, so that the step's loss is the unsplit batch's."""
        if reduction == "mean":
            return self.sizes[i] / self.batch_size  # a mean over samples: the micro-batch's share of them
        return 1.0 if self.normalizer is None else 1.0 / self.normalizer

    def add_loss(self, slot: int, i: int, loss: Any, reduction: str) -> None:
        """Keep micro-batch i's loss for its backward, weighted so that the step's loss is the unsplit batch's."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            if isinstance(loss, torch.Tensor):
                shown = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            else:
                shown = f"a {type(loss).__name__}"
            raise ValueError(
                f"loss_fn must return a scalar floating-point tensor (reduce it, e.g. with .mean()), but for "
                f"micro-batch {i} it returned {shown}"
            )
        weight = self.loss_weight(i, reduction)
        self.losses[slot] = loss.reshape(()) * weight
        contribution = loss.detach().reshape(()).to(torch.float64) * weight
        self.loss_total = contribution if self.loss_total is None else self.loss_total + contribution
        self.losses_counted += 1

    def drop_state(self) -> None:
        for store in (self.inputs, self.outputs, self.losses, self.grads_in, self.grads_out, self.weight_passes):
            store.clear()


def checked_normalizer(normalizer: float | torch.Tensor, reduction: str) -> float:
    """The positive number a summed loss is divided by, or a ValueError saying what is wrong."""
    if reduction != "sum":
        raise ValueError('normalizer= divides a summed loss: pass reduction="sum" with it (and a loss_fn that sums)')
    if isinstance(normalizer, torch.Tensor) and normalizer.numel() != 1:
        raise ValueError(f"normalizer must be a number or a one-element tensor, got shape {tuple(normalizer.shape)}")
    try:
        value = float(normalizer)
    except (TypeError, ValueError):
        raise ValueError(f"normalizer must be a number or a one-element tensor, got {normalizer!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"normalizer must be a positive, finite count (what the loss is averaged over), got {value}")
    return value
