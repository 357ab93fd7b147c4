"""Layers whose statistics span all replicas."""

from replicator.nn.batchnorm import (
    CrossReplicaBatchNorm,
    CrossReplicaBatchNorm1d,
    CrossReplicaBatchNorm2d,
    CrossReplicaConditionalBatchNorm,
    convert_batchnorm,
)

__all__ = ["CrossReplicaBatchNorm", "CrossReplicaBatchNorm1d", "CrossReplicaBatchNorm2d",
           "CrossReplicaConditionalBatchNorm", "convert_batchnorm"]
