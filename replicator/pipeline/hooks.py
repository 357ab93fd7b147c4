"""StageHooks: what a pipeline stage asks of the job around a training step (gradient averaging, agreement)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from replicator.comm.agreement import Agreement
from replicator.pipeline.outcome import Outcome, gather_outcomes, replicas_failed
from replicator.pipeline.sharded import ShardedUnits
from replicator.pipeline.step import PipelineError
from replicator.topology import Mesh

__all__ = ["StageHooks", "job_hooks", "around_training_step"]


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
    # This process's failure (None: success) in, every process's outcome out ([]: all succeeded).
    agree_on_outcome: Callable[[str | None], Sequence[Outcome]] | None = None
    release_gradients: Callable[[], None] | None = None  # after every replica succeeded
    abandon_gradients: Callable[[], None] | None = None  # after a failure anywhere, on every replica
    # fp16: entered around a training step; what it yields multiplies the losses by the loss scale before their
    # backward (a stage's other backward passes start from gradients received already scaled).
    scale_losses: Callable[[], AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]]] | None = None


class HoldsGradients(Protocol):
    """What job_hooks needs of the job's wrapped optimizers (replicator.sync.SyncedOptimizers)."""

    def hold_gradients(self) -> AbstractContextManager[None]: ...

    def release_gradients(self) -> None: ...

    def abandon_gradients(self) -> None: ...


def job_hooks(no_sync: Callable[[], AbstractContextManager[Any]], optimizers: HoldsGradients, agreement: Agreement,
              mesh: Mesh, scale_losses: Callable[[], AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]]]
              | None = None) -> StageHooks:
    """The hooks the Replicator gives its stage: with replicas, gradient averaging waits for every step's outcome.

    A step that fails on one replica fails on all; each then drops the averaging its step
    left pending, so that the next step starts from the same place everywhere.
    """
    if mesh.num_replicas == 1:
        return StageHooks(no_sync=no_sync, scale_losses=scale_losses)
    return StageHooks(no_sync=no_sync, scale_losses=scale_losses, hold_gradients=optimizers.hold_gradients,
                      agree_on_outcome=functools.partial(gather_outcomes, agreement, mesh.replica_id, mesh.stage_id),
                      release_gradients=optimizers.release_gradients,
                      abandon_gradients=optimizers.abandon_gradients)


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


def around_training_step(hooks: StageHooks, run: Callable[[], torch.Tensor],
                         units: ShardedUnits | None = None) -> torch.Tensor:
    """Run one training step (`run`, which raises PipelineError on failure) inside the job's hooks.

    The gradient averaging is held for the whole step; then every process of the job
    learns how every step went. After a success everywhere the held averaging is
    released; after a failure anywhere every replica drops it and raises the same
    PipelineError, so the replicas stay identical. A stage sharded with FSDP2 (`units`
    that hold some) is gathered before the step and reduce-scattered or dropped after it
    in the same way (replicator.pipeline.sharded).
    """
    sharded = units if units is not None and units.units else None
    failure: PipelineError | None = None
    with hooks.hold_gradients() if hooks.hold_gradients is not None else contextlib.nullcontext():
        if sharded is not None:
            sharded.begin()
        try:
            loss = run()
        except PipelineError as error:
            failure = error
    if hooks.agree_on_outcome is not None:
        outcomes = hooks.agree_on_outcome(None if failure is None else failure.reason)
        if outcomes:
            if sharded is not None:
                sharded.discard()
            if hooks.abandon_gradients is not None:
                hooks.abandon_gradients()
            raise replicas_failed(failure, list(outcomes)) from failure
    if failure is not None:
        if sharded is not None:
            sharded.discard()
        raise failure
    if sharded is not None:
        sharded.reduce()
    if hooks.release_gradients is not None:
        hooks.release_gradients()
    return loss
