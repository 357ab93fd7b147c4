"""VirtualPipelineStage: a PipelineStage built from its V model chunks, for interleaved and zero-bubble schedules.

The model is cut into K x V pieces and piece p runs on stage p % K as its chunk p // K,
so activations travel round a ring of stages (the last stage passes them on to the first)
and gradients back round it. PipelineStage runs it all (one runner for every schedule);
this only gathers the chunks into StageChunks and picks the interleaved schedule by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from replicator.pipeline.stage import PipelineStage, StageChunks

__all__ = ["VirtualPipelineStage", "StageChunks"]


class VirtualPipelineStage(PipelineStage):
    """Stage `stage_id` of a K-stage pipeline holding V chunks, running any schedule (interleaved, zero bubble).

    Same interface and arguments as PipelineStage, except `chunk_modules`: this stage's V
    pieces of the model, chunk v being piece v * K + stage_id. `schedule` is "interleaved"
    (the default), "zero_bubble" (or any name of make_schedule) or a Schedule for (K, M, V).
    """

    def __init__(self, chunk_modules: Sequence[nn.Module], *, schedule: Any = "interleaved", **options: Any) -> None:
        super().__init__(StageChunks(chunk_modules), schedule=schedule, **options)
