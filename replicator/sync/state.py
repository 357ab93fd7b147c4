"""GradientState: accumulation and no_sync as one named object that the synchronizers read."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GradientState", "UpdateCount"]


@dataclass
class GradientState:
    """How the job's backward passes relate to its updates, shared by every wrapped optimizer.

    `accumulation` micro-steps (step_fn calls) make one update; inside `no_sync()` blocks
    (`no_sync_depth > 0`) backward passes accumulate locally. `step` counts the training's
    completed steps (`repl.global_step`; during step_fn, the step being run): the step loop
    advances it, and skipped updates and error messages name it.
    """

    accumulation: int = 1
    no_sync_depth: int = 0
    step: int = 0

    def last_micro_step(self, count: UpdateCount) -> bool:
        """Is the micro-step now running the last of an update of `count`'s optimizer?"""
        return count.calls % self.accumulation == self.accumulation - 1

    def completes_update(self, count: UpdateCount) -> bool:
        """Does the backward pass now running end an update of `count`'s optimizer (and communicate)?"""
        return self.no_sync_depth == 0 and self.last_micro_step(count)

    def mid_accumulation(self, count: UpdateCount) -> bool:
        """Has `count`'s optimizer taken some, but not all, micro-steps of an update?"""
        return count.calls % self.accumulation != 0


@dataclass
class UpdateCount:
    """One wrapped optimizer's progress: its step() calls (micro-steps included) and the last outcome."""

    calls: int = 0
    stepped: bool = False  # did the last step() update the parameters?
