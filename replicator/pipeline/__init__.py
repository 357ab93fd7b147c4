"""GPipe-style pipeline model parallelism: partition, micro-batches, schedules, stages over p2p.

    groups = build_process_groups(discover(), stages=K)
    pipe = build_pipeline(layers, stage_id=groups.stage_ranks.index(rank), num_stages=K, balance="params",
                          stage_ranks=groups.stage_ranks, stage_group=groups.stage, chunks=M, schedule="1f1b")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    optimizer.zero_grad(); loss = pipe.train_step(x, y, F.cross_entropy); optimizer.step()
"""

import warnings
from typing import Any

from replicator.pipeline.batchnorm import DeferredBatchNorm, convert_deferred_batchnorm
from replicator.pipeline.build import agreed_balance, build_pipeline
from replicator.pipeline.hooks import StageHooks, job_hooks
from replicator.pipeline.microbatch import gather, scatter
from replicator.pipeline.partition import partition
from replicator.pipeline.recompute import RECOMPUTE_MODES, is_recomputing
from replicator.pipeline.schedule import (
    SCHEDULES,
    VIRTUAL_SCHEDULES,
    Action,
    Op,
    Schedule,
    check_schedule,
    make_schedule,
    simulate,
)
from replicator.pipeline.stage import PipelineError, PipelineStage
from replicator.pipeline.timeline import Event, Timeline, plot_gantt, write_chrome_trace
from replicator.pipeline.virtual_stage import VirtualPipelineStage

__all__ = [
    "build_pipeline",
    "agreed_balance",
    "PipelineStage",
    "VirtualPipelineStage",
    "PipelineError",
    "StageHooks",
    "job_hooks",
    "partition",
    "scatter",
    "gather",
    "Schedule",
    "Action",
    "Op",
    "SCHEDULES",
    "VIRTUAL_SCHEDULES",
    "make_schedule",
    "check_schedule",
    "simulate",
    "RECOMPUTE_MODES",
    "is_recomputing",
    "DeferredBatchNorm",
    "convert_deferred_batchnorm",
    "Event",
    "Timeline",
    "write_chrome_trace",
    "plot_gantt",
]


def __getattr__(name: str) -> Any:
    """CHECKPOINT_MODES, the old name of RECOMPUTE_MODES, still imports (with a DeprecationWarning)."""
    if name == "CHECKPOINT_MODES":
        warnings.warn("replicator.pipeline.CHECKPOINT_MODES is deprecated: use RECOMPUTE_MODES", DeprecationWarning,
                      stacklevel=2)
        return RECOMPUTE_MODES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
