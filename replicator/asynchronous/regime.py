"""A mode's regime as run(), save() and restore() see it: this base does nothing (synchronous training)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from replicator import checkpoint
from replicator.context import InputContext
from replicator.loop import Observer
from replicator.telemetry import StepTimes
from replicator.timeline import recorder as timeline

__all__ = ["Regime"]


class Regime:
    """What run() hands off to around the step loop; this base does nothing (synchronous training)."""

    serves = False  # does this process serve instead of stepping?
    prints_report = False  # does finish() print the run's report (its step-time table included)?
    restores = True  # does run(checkpoint_dir=) resume this process from a checkpoint?
    saves_at_the_end = True  # does a run with checkpoint_every= end with a checkpoint of its last step?
    replicas_share_optimizer_state = True  # must every replica hold the same optimizer state?

    def input_fn(self, input_fn: Callable[[InputContext], Iterable[Any]]) -> Callable[[InputContext], Iterable[Any]]:
        return input_fn

    def serve(self) -> dict[str, Any]:
        raise NotImplementedError

    def begin(self, on_wait: Callable[[float], None]) -> None:
        """Before the first step; `on_wait` is told seconds spent waiting on peers."""

    def observers(self, on_after_step: Callable[[float], None], checkpoint_every: int | None) -> list[Observer]:
        """Observers of the run's steps that come before every other (DiLoCo's outer step is part of the step it
        follows, which the others see end); `on_after_step` is told the seconds they add to a step."""
        return []

    def end_steps(self, show: bool) -> dict[str, Any]:
        """After the last step, before the run's final checkpoint: figures for repl.last_run."""
        return {}

    def checkpoint_objects(self, objects: dict[str, Any], restoring: str | os.PathLike[str] | None) -> dict[str, Any]:
        """checkpoint.save's (or, `restoring` that path, restore's) keyword arguments for this regime."""
        return objects

    def finish(self, times: StepTimes, show: bool) -> dict[str, Any]:
        """After the last step (`times`: this process's step times; `show`: print a report): figures for
        repl.last_run."""
        return {}

    def save(self, path: str | os.PathLike[str], objects: dict[str, Any], step: int, input_state: dict[str, Any],
             extra: dict[str, Any] | None, keep: int | None) -> Path:
        """Write a checkpoint (`objects`: checkpoint.save's keyword arguments); every process calls it."""
        with timeline.span("checkpoint save", "checkpoint", step=step):
            return checkpoint.save(path, **objects, step=step, input_state=input_state, extra=extra, keep=keep)

    def restore(self, path: str | os.PathLike[str], objects: dict[str, Any]) -> checkpoint.Restored:
        """Load a checkpoint into `objects` (checkpoint.restore's keyword arguments); every process calls it."""
        return checkpoint.restore(path, **objects)
