"""StageHooks: what a pipeline stage asks of the job around a training step (gradient averaging, agreement)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["StageHooks"]


@dataclasses.dataclass
class StageHooks:
    """What a stage asks of the job around a training step; the facade fills these in.

    A stage of a replicated pipeline must average its gradients across replicas once per
    step, and a step that fails on one replica must fail on all of them instead of leaving
    the others waiting in that averaging. The stage does not know the synchronizer or the
    agreement; it calls these at the right moments (see PipelineStage.train_step). Any
    hook left None is skipped.
    """

    no_sync: Callable[[], AbstractContextManager[Any]] | None = None  # around every backward but the last
    hold_gradients: Callable[[], AbstractContextManager[Any]] | None = None  # around the whole train_step
    agree_on_outcome: Callable[[str], object] | None = None  # same text on every replica, or it raises
    release_gradients: Callable[[], None] | None = None  # after a successful agreement


def with_no_sync(
    hooks: StageHooks | None, no_sync: Callable[[], AbstractContextManager[Any]] | None
) -> StageHooks:
    """`hooks` (or empty ones) with the older `no_sync=` keyword folded in; both at once must agree."""
    hooks = hooks if hooks is not None else StageHooks()
    if no_sync is None or no_sync is hooks.no_sync:
        return hooks
    if hooks.no_sync is not None:
        raise ValueError("pass no_sync either as a keyword or in hooks=StageHooks(no_sync=...), not both")
    return dataclasses.replace(hooks, no_sync=no_sync)
