"""GradientState: accumulation, no_sync, the running step and its samples, one named object for the synchronizers."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from replicator._tree import leading_size
from replicator.errors import ReplicatorUsageError

__all__ = ["GradientState", "UpdateCount", "UNEVEN_BATCHES", "EPOCH_ENDS", "sample_counter"]

UNEVEN_BATCHES = ("refuse", "weighted")
# What an epoch's end does to an accumulation that is part way through an update (repl.accumulate's epoch_end=).
EPOCH_ENDS = ("carry", "flush")


def sample_counter(uneven_batches: str | Callable[[Any], int]) -> Callable[[Any], int] | None:
    """How a batch's samples are counted for `uneven_batches`; None when batches must be equal ("refuse").

    "weighted" counts the leading size of the batch's first tensor (replicator._tree.leading_size);
    a function of the batch counts what the loss averages over (tokens, say) and implies weighting.
    """
    if callable(uneven_batches):
        return uneven_batches
    if uneven_batches not in UNEVEN_BATCHES:
        raise ReplicatorUsageError(
            f"uneven_batches={uneven_batches!r} is not one of {UNEVEN_BATCHES} or a function batch -> sample count")
    return leading_size if uneven_batches == "weighted" else None


@dataclass
class GradientState:
    """How the job's backward passes relate to its updates, shared by every wrapped optimizer.

    `accumulation` micro-steps (step_fn calls) make one update; inside `no_sync()` blocks
    (`no_sync_depth > 0`) backward passes accumulate locally. `step` counts the training's
    completed steps (`repl.global_step`; during step_fn, the step being run): the step loop
    advances it, and skipped updates and error messages name it.

    With `epoch_end="flush"` the step loop marks the step whose batch is its epoch's last
    (`closing`): that micro-step ends the update, which averages the micro-steps it holds
    (`micro_steps`), as Accelerate's accumulate() does at the end of a dataloader.

    The step loop also says when a run and its step_fn are under way (`in_run`, `in_step`)
    and, with `count_samples` (uneven_batches="weighted"), how many samples this replica and
    all of them hold in each step: gradients are then weighted by those counts.
    """

    accumulation: int = 1
    epoch_end: str = "carry"
    closing: bool = False  # the running step is its epoch's last and epoch_end="flush": it ends the update
    no_sync_depth: int = 0
    step: int = 0
    count_samples: Callable[[Any], int] | None = None
    sparse_as_dense: bool = False
    in_run: bool = False
    in_step: bool = False
    # What this step's gradients arrive multiplied by (fp16's loss scale over the replicas and micro-steps,
    # replicator.sync.precision): the averaging divides it out. 1 outside run()'s steps.
    grad_scale: float = 1.0
    # The modules built in repl.scope(): outside run(), their train/eval mode decides whether a
    # backward pass communicates. The scope extends this very list.
    modules: list[torch.nn.Module] = field(default_factory=list)
    # (step, this replica's samples, every replica's) of the latest steps, when weighting.
    _samples: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=4096))

    def configure(self, uneven_batches: str | Callable[[Any], int], sparse_as_dense: bool,
                  modules: list[torch.nn.Module]) -> None:
        """Take the Replicator's choices (see `sample_counter`) and the list its scope fills with modules."""
        self.count_samples = sample_counter(uneven_batches)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.modules = modules

    def last_micro_step(self, count: UpdateCount) -> bool:
        """Is the micro-step now running the last of an update of `count`'s optimizer?"""
        return self.closing or count.calls % self.accumulation == self.accumulation - 1

    def micro_steps(self, count: UpdateCount) -> int:
        """The micro-steps in `count`'s update now running: `accumulation`, or those an epoch's end closes early.

        `count.calls` counts the micro-steps before the running one (step() adds it when it returns).
        """
        return count.calls % self.accumulation + 1 if self.closing else self.accumulation

    def set_accumulation(self, micro_steps: int, epoch_end: str) -> None:
        if micro_steps < 1:
            raise ReplicatorUsageError(f"accumulate() needs a positive number of micro-steps, got {micro_steps}")
        if epoch_end not in EPOCH_ENDS:
            raise ReplicatorUsageError(
                f"accumulate(epoch_end={epoch_end!r}) is not one of {EPOCH_ENDS}: 'carry' keeps a partial "
                "accumulation going into the next epoch, 'flush' updates on it when the epoch ends (Accelerate's)")
        self.accumulation, self.epoch_end = micro_steps, epoch_end

    def completes_update(self, count: UpdateCount) -> bool:
        """Does the backward pass now running end an update of `count`'s optimizer (and communicate)?"""
        return self.no_sync_depth == 0 and self.last_micro_step(count)

    def mid_accumulation(self, count: UpdateCount) -> bool:
        """Has `count`'s optimizer taken some, but not all, micro-steps of an update?"""
        return count.calls % self.accumulation != 0

    # -- the running step -----------------------------------------------------------------
    def begin_step(self, mine: int, everyone: int) -> None:
        """step_fn is about to run step `step` over `mine` of the `everyone` samples all replicas hold."""
        self.in_step = True
        if self.count_samples is not None:
            self._samples.append((self.step, mine, everyone))

    def end_step(self) -> None:
        self.in_step = False

    def samples_since(self, first_step: int) -> list[tuple[int, int]]:
        """(this replica's, every replica's) samples of each step from `first_step` to the running one.

        Empty unless gradients are weighted and step_fn is running: gradients are then averaged evenly.
        """
        if self.count_samples is None or not self.in_step:
            return []
        # An update spans at most `accumulation` steps, whatever an optimizer's first step was.
        recent = [(mine, everyone) for step, mine, everyone in self._samples if step >= first_step]
        return recent[-self.accumulation :]

    def communicates(self) -> bool:
        """Should a backward pass that ends an update average its gradients as it runs?

        Inside run()'s step_fn every replica runs it: yes. Between a run's steps (the body of
        `for ... in repl.run(...)`) training belongs in step_fn, so no. Outside run(), a manual
        training loop does (every replica calls backward, as with DDP) unless the models are in
        eval mode: evaluation or saliency on one replica then needs no partner. A backward pass
        that stays local is still averaged by the optimizer's step(), if one follows.
        """
        if self.in_step:
            return True
        if self.in_run:
            return False
        trained = [module for module in self.modules if next(module.parameters(), None) is not None]
        return not trained or any(module.training for module in trained)


@dataclass
class UpdateCount:
    """One wrapped optimizer's progress: its step() calls (micro-steps included) and the last outcome."""

    calls: int = 0
    stepped: bool = False  # did the last step() update the parameters?
