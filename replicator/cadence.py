"""What a run does every N steps of the training, counted in global steps so that a resumed run keeps the beat."""

from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

from replicator.errors import ReplicatorUsageError
from replicator.loop import Observer

__all__ = ["Every", "Checkpointer", "Cadence", "Hooks"]

Hooks = Mapping[int, Callable[[int], object]]  # run(every=): steps -> hook(global_step)


class Every:
    """Calls `hook(global_step)` after every `period`-th step of the training, an observer of the step loop.

    The count is the training's (restored steps included), so after a resume the hook fires at the
    steps an uninterrupted run would have, and never for the steps the checkpoint skipped.
    """

    def __init__(self, period: int, hook: Callable[[int], object]) -> None:
        self.period, self.hook = period, hook

    def on_input_wait(self, seconds: float) -> None:
        pass

    def on_agreement_wait(self, seconds: float) -> None:
        pass

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        if (step + 1) % self.period == 0:
            self.hook(step + 1)

    def on_run_end(self) -> None:
        pass


class Checkpointer:
    """Saves the training after every `every`-th step through `save(step)`; `finish` saves where the run ended.

    A save due while `mid_accumulation()` waits for the update's end: with epoch_end="flush" an epoch's
    end shortens an update, and the updates after it no longer end at multiples of the accumulation.
    """

    def __init__(self, every: int, save: Callable[[int], object],
                 mid_accumulation: Callable[[], bool] = lambda: False) -> None:
        self.every, self.save, self.mid_accumulation = every, save, mid_accumulation
        self.trained = False  # did this run train a step?
        self.saved: int | None = None  # the step of the latest checkpoint it wrote
        self._due = False

    def on_input_wait(self, seconds: float) -> None:
        pass

    def on_agreement_wait(self, seconds: float) -> None:
        pass

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        self.trained = True
        self._due = self._due or (step + 1) % self.every == 0
        if self._due and not self.mid_accumulation():
            self._due = False
            self.save(step + 1)
            self.saved = step + 1

    def on_run_end(self) -> None:
        pass

    def finish(self, step: int) -> None:
        """The run completed at global step `step`: save it, unless its last step just did or it trained none.

        A later run that extends the training (more epochs or steps) then resumes here instead
        of training up to `every - 1` steps again.
        """
        if self.trained and self.saved != step:
            self.save(step)
            self.saved = step


class Cadence:
    """A run's periodic work: the user's `every={N: hook}` hooks, then the checkpoints of `checkpoint_every`.

    The hooks come first, so a checkpoint written at the same step holds whatever the hook did to
    the random generators: a run resumed from it continues exactly as the uninterrupted one.
    """

    def __init__(self, every: Hooks | None, checkpoint_every: int | None,
                 checkpoint_dir: str | os.PathLike[str] | None, save: Callable[..., object], keep: int,
                 mid_accumulation: Callable[[], bool] = lambda: False) -> None:
        check_every(every)
        self.hooks: list[Observer] = [Every(int(period), hook) for period, hook in (every or {}).items()]
        self.checkpointer: Checkpointer | None = None
        if checkpoint_every and checkpoint_dir is not None:  # save(directory, step, keep=keep)
            self.checkpointer = Checkpointer(checkpoint_every, functools.partial(save, checkpoint_dir, keep=keep),
                                             mid_accumulation)

    @property
    def observers(self) -> list[Observer]:
        return [*self.hooks, *([self.checkpointer] if self.checkpointer is not None else [])]

    def finish(self, step: int, regime_saves: bool, mid_accumulation: bool, say: Callable[[str], None]) -> None:
        """The run completed at `step`: its final checkpoint, where checkpointing is on and the regime saves there."""
        if self.checkpointer is None or not self.checkpointer.trained or not regime_saves:
            return
        if mid_accumulation:  # a checkpoint falls between updates; the next run resumes from the last one
            say(f"replicator: no checkpoint where run() ended (step {step}): it ended in the middle of a gradient "
                "accumulation; a run that extends this training resumes from the last checkpoint before it")
            return
        self.checkpointer.finish(step)


def check_every(every: object) -> None:
    """Raise on an `every=` that is not a mapping of positive step counts to callables (the same on every replica)."""
    if every is None:
        return
    if not isinstance(every, Mapping):
        raise ReplicatorUsageError(
            f"run(every={every!r}) must map step counts to functions, e.g. every={{500: evaluate}}: evaluate(step) "
            "is then called on every replica after every 500th step of the training")
    for period, hook in every.items():
        if isinstance(period, bool) or not isinstance(period, numbers.Integral) or period < 1:
            raise ReplicatorUsageError(
                f"run(every=...) has the key {period!r}: each key is a number of steps, a whole number >= 1")
        if not callable(hook):
            raise ReplicatorUsageError(
                f"run(every={{{period}: {hook!r}}}): the value must be a function, called as hook(global_step)")
