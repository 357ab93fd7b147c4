"""Alpha–beta scaling planner: collective costs, gradient profiles, the step model, the planner (`replicator plan`)."""

from replicator.plan.cost import Level, all_reduce_time
from replicator.plan.memory import SHARD_LEVELS, ShardMemory, shard_memory
from replicator.plan.planner import (
    REDUCERS,
    Cluster,
    Plan,
    Prediction,
    ReduceAlgorithm,
    Tier,
    best_bucket,
    gpu_counts,
    plan,
    predict,
)
from replicator.plan.profile import GradientProfile, Layer, from_factory, from_module
from replicator.plan.step import Accelerator, Pipeline, StepBreakdown, Workload, step_time
from replicator.plan.transports import TRANSPORTS, Transport

__all__ = [
    "Level",
    "all_reduce_time",
    "Workload",
    "Accelerator",
    "Pipeline",
    "StepBreakdown",
    "step_time",
    "Tier",
    "Cluster",
    "ReduceAlgorithm",
    "REDUCERS",
    "Prediction",
    "Plan",
    "predict",
    "best_bucket",
    "gpu_counts",
    "plan",
    "GradientProfile",
    "Layer",
    "from_module",
    "from_factory",
    "Transport",
    "TRANSPORTS",
    "SHARD_LEVELS",
    "ShardMemory",
    "shard_memory",
]
