"""DeferredBatchNorm: per-micro-batch normalisation, running statistics of the whole mini-batch.

GPipe's handling of batch norm in a pipeline: during training each micro-batch is
normalised with its own statistics (all a stage ever sees at once), but the running mean
and variance are updated once per mini-batch, from the statistics of all its
micro-batches combined, so they equal those of the unsplit model. Recomputed forwards
(re-materialisation) are not counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from replicator.pipeline.recompute import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batchnorm", "commit_deferred_batchnorm"]


class DeferredBatchNorm(_BatchNorm):
    """Batch norm whose running statistics are committed once per mini-batch by `commit()`."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self._pending: list[tuple[float, torch.Tensor, torch.Tensor]] = []  # count, mean, sum of squared deviations

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        if not is_recomputing():
            with torch.no_grad():
                dims = [0, *range(2, input.dim())]
                count = input.numel() // input.shape[1]
                data = input.detach().to(torch.float64)
                mean = data.mean(dim=dims)
                m2 = data.var(dim=dims, unbiased=False) * count
                self._pending.append((float(count), mean, m2))
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def commit(self) -> None:
        """Fold the micro-batches seen since the last commit into the running statistics."""
        if not self._pending:
            return
        counts = torch.tensor([p[0] for p in self._pending], dtype=torch.float64, device=self._pending[0][1].device)
        means = torch.stack([p[1] for p in self._pending])
        m2s = torch.stack([p[2] for p in self._pending])
        self._pending.clear()
        total = counts.sum()
        mean = (counts[:, None] * means).sum(0) / total
        m2 = (m2s + counts[:, None] * (means - mean) ** 2).sum(0)
        unbiased = m2 / (total - 1).clamp_min(1)
        with torch.no_grad():
            assert self.num_batches_tracked is not None
            assert self.running_mean is not None and self.running_var is not None
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)

    def discard(self) -> None:
        """Forget the micro-batches seen since the last commit (after a failed step)."""
        self._pending.clear()


def convert_deferred_batchnorm(module: nn.Module) -> nn.Module:
    """`module` with its batch norms (nn.BatchNorm1d/2d/3d, exactly) made deferred; converts in place."""
    return _convert(module, {})


def _convert(module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
    """convert_deferred_batchnorm, each module once: a batch norm used twice stays one module."""
    if id(module) in done:
        return done[id(module)]
    done[id(module)] = module
    if type(module) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        assert isinstance(module, _BatchNorm)
        like = module.running_mean if module.running_mean is not None else module.weight
        deferred = DeferredBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                     module.track_running_stats,
                                     device=None if like is None else like.device,
                                     dtype=None if like is None else like.dtype)
        deferred.load_state_dict(module.state_dict())
        if module.affine:
            deferred.weight, deferred.bias = module.weight, module.bias  # keep the parameter objects
        deferred.train(module.training)
        done[id(module)] = deferred
        return deferred
    for name, child in list(module._modules.items()):  # named_children() would skip a repeat
        if child is None:
            continue
        converted = _convert(child, done)
        if converted is not child:
            setattr(module, name, converted)
    return module


def commit_deferred_batchnorm(module: nn.Module, keep: bool = True) -> None:
    """Commit (or, with keep=False, discard) what every DeferredBatchNorm in `module` accumulated."""
    for layer in module.modules():
        if isinstance(layer, DeferredBatchNorm):
            layer.commit() if keep else layer.discard()
