"""Cross-replica batch norm: statistics over the global batch, as one big batch would give."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from replicator.comm import collectives
from replicator.context import active_context

__all__ = ["CrossReplicaBatchNorm", "CrossReplicaBatchNorm1d", "CrossReplicaBatchNorm2d",
           "CrossReplicaConditionalBatchNorm", "convert_batchnorm"]


class CrossReplicaBatchNorm(_BatchNorm):
    """BatchNorm whose mean and variance are those of the whole global batch.

    Each replica computes its count, mean and sum of squared deviations; one differentiable
    all-gather shares them and Chan's parallel formula combines them (stable where
    E[x²]−E[x]² is not). With one replica, or in eval mode, it is ordinary batch norm and
    never communicates (as torch's SyncBatchNorm): eval uses the running statistics, or,
    without them (`track_running_stats=False`), this replica's own batch, so one replica
    can evaluate alone. The group is the replicas of the Replicator built last, unless
    `group` is given.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D")

    def _replica_group(self) -> dist.ProcessGroup | None:
        if self.group is not None:
            return self.group
        context = active_context()
        return None if context is None else context.group

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group = self._replica_group()
        if not self.training or collectives.group_size(group) == 1:
            return super().forward(input)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)

        channels = input.shape[1]
        reduce_dims = [0, *range(2, input.dim())]
        count = input.numel() // channels
        local_mean = input.mean(dim=reduce_dims)
        centred = input - local_mean.view(1, channels, *[1] * (input.dim() - 2))
        local_m2 = (centred * centred).sum(dim=reduce_dims)
        counts = torch.full((1, 1), float(count), dtype=input.dtype, device=input.device)
        stats = torch.cat([counts, local_mean.unsqueeze(0), local_m2.unsqueeze(0)], dim=1)
        gathered = collectives.all_gather(stats, group)  # (replicas, 1 + 2C)
        counts_r, means_r, m2_r = gathered[:, :1], gathered[:, 1 : 1 + channels], gathered[:, 1 + channels :]
        total = counts_r.sum()
        mean = (counts_r * means_r).sum(dim=0) / total
        m2 = (m2_r + counts_r * (means_r - mean) ** 2).sum(dim=0)
        var = m2 / total

        if self.training and self.track_running_stats:
            assert self.running_mean is not None and self.running_var is not None
            assert self.num_batches_tracked is not None
            # Without a momentum, a cumulative moving average (as nn.BatchNorm).
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            with torch.no_grad():
                unbiased = m2 / (total - 1).clamp_min(1)
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
        shape = (1, channels, *[1] * (input.dim() - 2))
        output = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output


class CrossReplicaBatchNorm1d(CrossReplicaBatchNorm):
    """For (N, C) or (N, C, L) inputs."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in (2, 3):
            raise ValueError(f"expected 2D or 3D input, got {input.dim()}D")


class CrossReplicaBatchNorm2d(CrossReplicaBatchNorm):
    """For (N, C, H, W) inputs."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D input, got {input.dim()}D")


class CrossReplicaConditionalBatchNorm(torch.nn.Module):
    """Class-conditional batch norm (de Vries et al. 2017; the generators of SN-GAN and BigGAN) over the global batch.

    The input is normalized with the statistics of the whole global batch, as
    CrossReplicaBatchNorm does (and with its running statistics in eval mode); each sample
    is then scaled and shifted by the gain and bias rows of its own class, two embeddings
    that start at 1 and 0. Gradients flow to the embeddings and, through the cross-replica
    statistics, to every replica's input, exactly as one process with the whole batch.
    `forward(input, labels)` takes (N, C, ...) inputs and N class indices.
    """

    def __init__(self, num_features: int, num_classes: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 track_running_stats: bool = True, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_features, self.num_classes = num_features, num_classes
        self.norm = CrossReplicaBatchNorm(num_features, eps, momentum, affine=False,
                                          track_running_stats=track_running_stats, group=group,
                                          device=device, dtype=dtype)
        self.gain = torch.nn.Embedding(num_classes, num_features, device=device, dtype=dtype)
        self.bias = torch.nn.Embedding(num_classes, num_features, device=device, dtype=dtype)
        torch.nn.init.ones_(self.gain.weight)
        torch.nn.init.zeros_(self.bias.weight)

    def forward(self, input: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.dim() != 1 or labels.shape[0] != input.shape[0] or labels.is_floating_point():
            raise ValueError(f"labels must be {input.shape[0]} integer class indices, one per sample of the input, "
                             f"got a {labels.dtype} tensor of shape {tuple(labels.shape)}")
        if input.dim() >= 2 and input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels (dim 1), got input of shape {tuple(input.shape)}")
        shape = (input.shape[0], self.num_features, *[1] * (input.dim() - 2))
        return self.norm(input) * self.gain(labels).view(shape) + self.bias(labels).view(shape)

    def extra_repr(self) -> str:
        return f"{self.num_features}, num_classes={self.num_classes}"


_REPLACEMENT: dict[type[torch.nn.Module], type[CrossReplicaBatchNorm]] = {
    torch.nn.BatchNorm1d: CrossReplicaBatchNorm1d,
    torch.nn.BatchNorm2d: CrossReplicaBatchNorm2d,
    torch.nn.BatchNorm3d: CrossReplicaBatchNorm,
    # A DDP user's model after convert_sync_batchnorm: torch's layer only runs on GPUs (and on its own group).
    torch.nn.SyncBatchNorm: CrossReplicaBatchNorm,
}


def convert_batchnorm(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> torch.nn.Module:
    """Replace every BatchNorm1d/2d/3d and SyncBatchNorm in `module` by its cross-replica twin,
    keeping its parameters (and which of them train), buffers, device, dtype and mode."""
    replacement = _REPLACEMENT.get(type(module))
    if replacement is not None:
        assert isinstance(module, _BatchNorm)
        state = module.state_dict()
        like = next(iter(state.values()), None)
        floating = next((value for value in state.values() if value.is_floating_point()), None)
        converted = replacement(module.num_features, module.eps, module.momentum, module.affine,
                                module.track_running_stats, group=group,
                                device=like.device if like is not None else None,
                                dtype=floating.dtype if floating is not None else None)
        converted.load_state_dict(state)
        converted.train(module.training)
        for name, parameter in module.named_parameters(recurse=False):
            getattr(converted, name).requires_grad_(parameter.requires_grad)
        return converted
    for name, child in module.named_children():
        setattr(module, name, convert_batchnorm(child, group))
    return module
