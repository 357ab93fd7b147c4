"""Model-state memory per replica and bytes sent per step for each shard level (ZeRO-1/2/3), by formula."""

from __future__ import annotations

from dataclasses import dataclass

from replicator.plan._checks import raise_if

__all__ = ["SHARD_LEVELS", "OPTIMIZER_STATES", "ShardMemory", "shard_memory", "smallest_fitting"]

# What Replicator(shard=...) takes, least sharded first; None is written "none" in tables and JSON keys.
SHARD_LEVELS = ("none", "optimizer", "gradients", "parameters")
# Tensors the optimizer keeps per parameter, each the parameter's size and dtype (torch keeps them so):
# Adam(W) its two moments, SGD with momentum its momentum buffer, plain SGD none.
OPTIMIZER_STATES = {"adam": 2, "momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class ShardMemory:
    """One shard level at `replicas` replicas: model-state bytes each replica holds and bytes it sends per step.

    Model state is parameters + gradients + optimizer state, each in the model's dtype; activations, the
    allocator's slack and communication buffers come on top. `sent_bytes` is what one replica sends per step
    over a ring (a reduce-scatter or an all-gather sends (N-1)/N of its tensor): 2Ψ for an all-reduce (none,
    optimizer, gradients: a reduce-scatter of the gradients and an all-gather of the parameters or the
    gradients), 3Ψ for parameters (an all-gather in forward, another in backward, a reduce-scatter).
    """

    level: str
    replicas: int
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    gathered_bytes: float  # parameters only: the largest unit gathered whole at once
    sent_bytes: float

    @property
    def total(self) -> float:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.gathered_bytes

    def to_dict(self) -> dict[str, object]:
        return {"level": self.level, "replicas": self.replicas, "bytes": self.total,
                "parameter_bytes": self.parameter_bytes, "gradient_bytes": self.gradient_bytes,
                "optimizer_bytes": self.optimizer_bytes, "gathered_bytes": self.gathered_bytes,
                "sent_bytes_per_step": self.sent_bytes}


def shard_memory(level: str, params: float, replicas: int, optimizer: str = "adam", element_bytes: int = 4,
                 largest_unit: float | None = None) -> ShardMemory:
    """Bytes per replica for `params` parameters (Ψ) of `element_bytes` each, trained by `optimizer` at `replicas`.

    fp32 Adam: none 16Ψ; optimizer 4Ψ + 4Ψ + 8Ψ/N; gradients 4Ψ + 12Ψ/N; parameters 16Ψ/N plus the largest unit
    gathered whole (`largest_unit` parameters; the whole model when it is not known).
    """
    raise_if(level not in SHARD_LEVELS, f"shard level must be one of {', '.join(SHARD_LEVELS)}, got {level!r}")
    raise_if(optimizer not in OPTIMIZER_STATES,
             f"optimizer must be one of {', '.join(sorted(OPTIMIZER_STATES))}, got {optimizer!r}")
    raise_if(params <= 0, f"params must be > 0, got {params}")
    raise_if(replicas < 1, f"replicas must be >= 1, got {replicas}")
    whole = params * element_bytes  # one model-sized tensor
    states = OPTIMIZER_STATES[optimizer] * whole
    share = 1.0 / replicas
    sliced = {"none": (1.0, 1.0, 1.0), "optimizer": (1.0, 1.0, share), "gradients": (1.0, share, share),
              "parameters": (share, share, share)}[level]
    gathered = 0.0
    if level == "parameters" and replicas > 1:
        gathered = min(params, largest_unit if largest_unit is not None else params) * element_bytes
    ring = (replicas - 1) / replicas
    sent = (3.0 if level == "parameters" else 2.0) * whole * ring
    return ShardMemory(level, replicas, whole * sliced[0], whole * sliced[1], states * sliced[2], gathered, sent)


def smallest_fitting(levels: list[ShardMemory], budget: float) -> ShardMemory | None:
    """The least sharded of `levels` (in SHARD_LEVELS order) whose model state fits `budget` bytes, or None."""
    return next((memory for memory in levels if memory.total <= budget), None)
