"""DiLoCo (arXiv 2311.08105): sync groups train apart for H steps, then an outer optimizer applies their mean.

Inside a sync group of G replicas the job's synchronizer averages gradients every step, as in
synchronous mode; between groups nothing but the loop's small per-step agreement travels until
`outer_every` steps have run. Then every replica computes the pseudo-gradient (its group's
parameters at the round's start minus now), the groups sum it through the job's reducer (one
rank of each group at the same place in each, so G sums run side by side), and the outer
optimizer (Nesterov SGD, lr 0.7, momentum 0.9, as the paper) moves the round's starting
parameters by the mean; every replica continues from the result. An outer SGD with lr 1 and no
momentum is local SGD (parameter averaging); with H = 1 that is synchronous training.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replicator.asynchronous.regime import Regime
from replicator.checkpoint import Share, read_info
from replicator.checkpoint.state import named_modules, parameter_names
from replicator.errors import ReplicatorUsageError
from replicator.loop import Observer
from replicator.sync.bucket import Bucket, Reducer, assign_buckets
from replicator.sync.optimizer import SyncedOptimizers
from replicator.sync.reducers import make_reducer
from replicator.timeline import recorder as timeline
from replicator.topology import ProcessGroups, build_regrouped

__all__ = ["DiLoCoRegime", "OuterLoop", "OuterOptimizer", "check_diloco_keywords", "nesterov_outer_optimizer",
           "wire_bytes"]

OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
_BUCKET_BYTES = 25 << 20


def check_diloco_keywords(mode: str, sync_group_size: int, outer_every: int | None,
                          outer_optimizer: OuterOptimizer | None, rank: int) -> None:
    """Refuse DiLoCo's keywords (the deprecated form) given without mode="diloco", alike on every rank."""
    if mode not in ("sync", "async"):  # the parameter servers check their own (parameter_server.settings)
        return
    given = {"outer_every": outer_every, "outer_optimizer": outer_optimizer}
    if sync_group_size != 1 and mode == "sync":
        given["sync_group_size"] = sync_group_size
    stray = [name for name, value in given.items() if value is not None]
    if stray:
        raise ReplicatorUsageError(f"{', '.join(stray)} only apply to mode='diloco' (sync_group_size also to "
                                   f"mode='async'; raised on rank {rank}): pass the mode too, or leave them out")


def nesterov_outer_optimizer(parameters: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD with Nesterov momentum 0.9 and lr 0.7."""
    return torch.optim.SGD(parameters, lr=0.7, momentum=0.9, nesterov=True)


def wire_bytes(reducer: Reducer, bucket: Bucket) -> int:
    """Bytes `reducer` puts on the wire for one reduction of `bucket` (before the collective's own fan-out).

    A ring all-reduce then sends about 2 (n - 1) / n times this per process: the same factor for
    every regime, so ratios between regimes are the ratios of these counts.
    """
    wire_numel = getattr(reducer, "wire_numel", None)  # PowerSGD: its factors and exact parts
    numel = wire_numel(bucket) if callable(wire_numel) else bucket.buffer.numel()
    dtype = getattr(reducer, "dtype", bucket.buffer.dtype)  # half-precision reducers cast on the way
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else bucket.buffer.element_size()
    return numel * itemsize


@dataclass
class _Round:
    """The outer step's state over one list of trained parameters: the round's start and the outer optimizer."""

    params: list[torch.Tensor]
    anchors: list[torch.nn.Parameter]  # the parameters at the round's start: what the outer optimizer updates
    optimizer: torch.optim.Optimizer
    buckets: list[Bucket]  # the pseudo-gradient, laid out as the reducers expect
    round_bytes: int  # what one outer reduction sends from this process

    def param_of(self, anchor: torch.Tensor) -> torch.Tensor:
        return self.params[self._positions[id(anchor)]]

    def __post_init__(self) -> None:
        self._positions = {id(anchor): number for number, anchor in enumerate(self.anchors)}


class OuterLoop:
    """The outer loop of one job in mode="diloco": its groups, its reducer, and a run observer that steps it.

    Built collectively (every rank, same arguments) by `start`; `inner_groups` is the job's
    ProcessGroups with this replica's sync group as the replica group, for the synchronizer.
    """

    def __init__(self, groups: ProcessGroups, inner_groups: ProcessGroups, outer_groups: ProcessGroups,
                 reducer: Reducer, outer_every: int, outer_optimizer: OuterOptimizer) -> None:
        self.inner_groups = inner_groups
        self.outer_groups = outer_groups
        self.reducer = reducer
        self.outer_every = outer_every
        self.outer_optimizer = outer_optimizer
        self.sync_group_size = inner_groups.mesh.num_replicas
        self.num_groups = outer_groups.mesh.num_replicas
        self.replica_id = groups.mesh.replica_id
        self.group_id = self.replica_id // self.sync_group_size
        self.steps_since_outer = 0  # inner steps of the round under way (kept across runs)
        self.outer_steps = 0  # outer steps taken since the Replicator was built
        self._round: _Round | None = None
        self._run_steps = self._run_outer_steps = 0
        self._mid_accumulation: Callable[[], bool] = lambda: False
        self._on_wait: Callable[[float], None] = lambda seconds: None

    @classmethod
    def start(cls, groups: ProcessGroups, *, sync_group_size: int, outer_every: int | None,
              outer_optimizer: OuterOptimizer | None, reducer: str | Reducer, stages: int, uneven_batches: Any,
              timeout_s: float, device: torch.device) -> OuterLoop:
        """Check the arguments (the same error on every rank), then build the groups and the outer reducer."""
        world = groups.mesh.world_size
        where = f"raised on rank {groups.mesh.rank}"
        if stages != 1:
            raise ReplicatorUsageError(f"mode='diloco' with stages={stages} is not supported yet ({where}): "
                                       "use stages=1, or mode='sync' for pipeline parallelism")
        if outer_every is None or isinstance(outer_every, bool) or not isinstance(outer_every, int) \
                or outer_every < 1:
            raise ReplicatorUsageError(f"mode='diloco' needs outer_every=H, a whole number of inner steps >= 1 "
                                       f"between outer steps, got outer_every={outer_every!r} ({where})")
        if isinstance(sync_group_size, bool) or not isinstance(sync_group_size, int) or sync_group_size < 1 \
                or world % sync_group_size:
            raise ReplicatorUsageError(
                f"sync_group_size={sync_group_size!r} does not divide the {world} replicas into equal sync groups "
                f"({where}): use a divisor of {world}, or launch a multiple of {sync_group_size} processes")
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise ReplicatorUsageError(
                f"outer_optimizer must be a function from a list of tensors to an optimizer over them, e.g. "
                f"`lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`, got "
                f"{type(outer_optimizer).__name__} ({where})")
        if uneven_batches != "refuse":
            raise ReplicatorUsageError(f"mode='diloco' with uneven_batches={uneven_batches!r} is not supported yet "
                                       f"({where}): give every replica batches of one size")
        inner = build_regrouped(groups, groups.mesh.sync_group_partition(sync_group_size), timeout_s)
        outer = build_regrouped(groups, groups.mesh.across_sync_groups_partition(sync_group_size), timeout_s)
        outer_reducer = make_reducer(reducer, outer, timeout_s=timeout_s, device=device)
        return cls(groups, inner, outer, outer_reducer, outer_every, outer_optimizer or nesterov_outer_optimizer)

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_objects(self, objects: dict[str, Any], optimizers: SyncedOptimizers,
                           restoring: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """checkpoint.save's (or, `restoring` that path, restore's) arguments for a DiLoCo job.

        A DiLoCo checkpoint falls on an outer step, where every replica holds the same parameters
        (its model), the round's start equals them, and the outer optimizer's state is the same
        everywhere. Each sync group's inner optimizer state is saved beside the others' (under
        "group<g>/"), the outer optimizer's under "outer/". A job with another number of groups
        gives group g the inner state of saved group g modulo their number.
        """
        if restoring is None and self.steps_since_outer:
            raise ReplicatorUsageError(
                f"mode='diloco' saves checkpoints on outer steps only, but this is {self.steps_since_outer} steps into "
                f"a round of outer_every={self.outer_every} (raised on replica {self.replica_id}): give run() a "
                "checkpoint_every that is a multiple of outer_every, and call repl.save() after run() or right after "
                "an outer step")
        state = self._prepared(optimizers)
        saved_groups = self.num_groups
        if restoring is not None:
            saved_groups = int(read_info(Path(restoring)).get("regime", {}).get("sync_groups", self.num_groups))
            if saved_groups != self.num_groups and self.replica_id == 0:
                print(f"replicator: the checkpoint was written by {saved_groups} DiLoCo sync group(s), this job has "
                      f"{self.num_groups}: group g continues with saved group g mod {saved_groups}'s inner optimizer "
                      "state", flush=True)
            self.steps_since_outer = 0  # a checkpoint is a round's start
        names = parameter_names(named_modules(objects["modules"]))
        first = self.replica_id % self.sync_group_size == 0  # writes its group's records
        share = Share(prefixes=(f"group{self.group_id % saved_groups}/",) * len(objects["optimizers"]) + ("outer/",),
                      names={id(anchor): names[id(param)] for param, anchor in zip(state.params, state.anchors)
                             if id(param) in names},
                      record="stage0" if self.replica_id == 0 else f"group{self.group_id}" if first else None,
                      regime={"mode": "diloco", "sync_groups": self.num_groups, "outer_every": self.outer_every})
        return {**objects, "optimizers": [*objects["optimizers"], state.optimizer], "share": share}

    # -- a run -------------------------------------------------------------------------------
    def begin(self, optimizers: SyncedOptimizers, on_wait: Callable[[float], None],
              checkpoint_every: int | None = None) -> OuterLoop:
        """Get ready for a run over the wrapped optimizers' parameters (identical on every replica now); return
        the run's observer.

        The outer optimizer's state lives on from run to run while the parameters trained stay
        the same; `on_wait` is told the seconds each outer step takes (a step's communication).
        """
        if checkpoint_every and checkpoint_every % self.outer_every:
            raise ReplicatorUsageError(
                f"checkpoint_every={checkpoint_every} is not a multiple of outer_every={self.outer_every} (raised on "
                f"replica {self.replica_id}): mode='diloco' saves checkpoints on outer steps, where every replica "
                "holds the same parameters")
        self._mid_accumulation, self._on_wait = optimizers.mid_accumulation, on_wait
        self._run_steps = self._run_outer_steps = 0
        state = self._prepared(optimizers)
        for param, anchor in zip(state.params, state.anchors):
            anchor.detach().copy_(param.detach())  # the user may have changed (or restored) the weights between runs
        return self

    def _prepared(self, optimizers: SyncedOptimizers) -> _Round:
        """The round over the wrapped optimizers' parameters, new when they changed."""
        unique = [p for p in {id(p): p for p in optimizers.parameters()}.values() if p.requires_grad]
        if self._round is None or [id(p) for p in self._round.params] != [id(p) for p in unique]:
            self._round = self._new_round(unique)
        return self._round

    def _new_round(self, params: list[torch.Tensor]) -> _Round:
        anchors = [torch.nn.Parameter(param.detach().clone()) for param in params]
        tensors: list[torch.Tensor] = [*anchors]
        optimizer = self.outer_optimizer(tensors)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ReplicatorUsageError(f"outer_optimizer returned {type(optimizer).__name__}, not a "
                                       "torch.optim.Optimizer over the tensors it was given")
        given = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if given != {id(a) for a in anchors}:
            raise ReplicatorUsageError("outer_optimizer must build its optimizer over exactly the list of tensors it "
                                       "is given (the parameters at the round's start), not the model's parameters")
        buckets = assign_buckets(anchors, _BUCKET_BYTES, _BUCKET_BYTES, getattr(self.reducer, "allocate", None))
        round_bytes = sum(wire_bytes(self.reducer, bucket) for bucket in buckets) if self.num_groups > 1 else 0
        return _Round(params, anchors, optimizer, buckets, round_bytes)

    def on_input_wait(self, seconds: float) -> None:
        pass

    def on_agreement_wait(self, seconds: float) -> None:
        pass

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        self._run_steps += 1
        self.steps_since_outer += 1
        if self.steps_since_outer >= self.outer_every:
            self.outer_step(f"after step {step}")

    def on_run_end(self) -> None:
        pass

    def finish(self, inner_reducer: Reducer, optimizers: SyncedOptimizers, show: bool) -> dict[str, Any]:
        """At the end of a run: close a round cut short, so every replica leaves with the same parameters;
        return the run's traffic (see `report`), printed where `show`."""
        if self.steps_since_outer and self._round is not None:
            self.outer_step("at the end of run()")
        buckets = [bucket for wrapped in optimizers.wrapped for bucket in wrapped.synchronizer.buckets]
        figures = self.report(inner_reducer, buckets, optimizers.state.accumulation)
        if show and self._run_steps:
            print(f"replicator: DiLoCo, {self.num_groups} sync group(s) of {self.sync_group_size}, outer step every "
                  f"{self.outer_every} steps ({figures['outer_steps']} this run): "
                  f"{figures['bytes_per_step']:,.0f} bytes per step and replica, synchronous training "
                  f"{figures['synchronous_bytes_per_step']:,.0f} ({figures['bytes_reduction']:.1f}x)", flush=True)
        return figures

    # -- the outer step ----------------------------------------------------------------------
    def outer_step(self, when: str) -> None:
        """Average the pseudo-gradients over the groups and apply the outer optimizer; every replica calls it."""
        with timeline.span("outer step", "diloco", outer_step=self.outer_steps, groups=self.num_groups):
            self._outer_step(when)

    def _outer_step(self, when: str) -> None:
        state = self._round
        assert state is not None, "begin() comes first"
        if self._mid_accumulation():
            raise ReplicatorUsageError(
                f"DiLoCo's outer step {when} fell in the middle of a gradient accumulation: make outer_every="
                f"{self.outer_every} a multiple of repl.accumulate()'s micro-steps")
        started = time.perf_counter()
        scale = 1.0 / self.num_groups
        for bucket in state.buckets:
            for position, anchor in enumerate(bucket.params):
                # (start - now) / groups: the mean arrives summed, as gradients do in the synchronizer.
                torch.sub(anchor.detach(), state.param_of(anchor).detach(), out=bucket.views[position])
                bucket.views[position].mul_(scale)
            bucket.presence().fill_(1)
        if self.num_groups > 1:
            pending = [self.reducer.reduce(bucket.buffer, self.outer_groups.replica, bucket)  # type: ignore[arg-type]
                       for bucket in state.buckets]
            for reduction in pending:
                reduction.wait()
        for bucket in state.buckets:
            for position, start in enumerate(bucket.params):
                start.grad = bucket.views[position]
        state.optimizer.step()
        with torch.no_grad():
            for param, anchor in zip(state.params, state.anchors):
                param.copy_(anchor)
        self.steps_since_outer = 0
        self.outer_steps += 1
        self._run_outer_steps += 1
        self._on_wait(time.perf_counter() - started)

    def report(self, inner_reducer: Reducer, inner_buckets: list[Bucket], accumulation: int) -> dict[str, Any]:
        """The run's traffic per step (bytes this process sent into reductions) against synchronous training's.

        `inner_buckets` are the gradient buckets the synchronizer reduces inside the sync group with
        `inner_reducer` once per update (of `accumulation` steps); synchronous training with the same
        reducer would reduce the whole gradient across every replica once per update instead.
        """
        state = self._round
        steps = max(self._run_steps, 1)
        alone = self.num_groups * self.sync_group_size == 1  # one process: synchronous training sends nothing
        full = sum(wire_bytes(self.reducer, bucket) for bucket in state.buckets) if state and not alone else 0
        outer = (state.round_bytes if state is not None else 0) * self._run_outer_steps / steps
        inner = sum(wire_bytes(inner_reducer, bucket) for bucket in inner_buckets) / accumulation
        synchronous = full / accumulation
        total = inner + outer
        return {
            "mode": "diloco", "outer_every": self.outer_every, "sync_groups": self.num_groups,
            "sync_group_size": self.sync_group_size, "outer_steps": self._run_outer_steps,
            "bytes_per_step": total, "outer_bytes_per_step": outer, "inner_bytes_per_step": inner,
            "synchronous_bytes_per_step": synchronous,
            "bytes_reduction": synchronous / total if total else (1.0 if not synchronous else float("inf")),
        }



class DiLoCoRegime(Regime):
    """DiLoCo as run(), save() and restore() see it: the outer loop observes the steps, closes a round cut short
    when a run ends, and adds the groups' inner and the outer optimizer state to checkpoints."""

    replicas_share_optimizer_state = False  # each sync group keeps its own inner optimizer state

    def __init__(self, outer: OuterLoop, optimizers: SyncedOptimizers, inner_reducer: Reducer) -> None:
        self.outer, self.optimizers, self.inner_reducer = outer, optimizers, inner_reducer

    def observers(self, on_after_step: Callable[[float], None], checkpoint_every: int | None) -> list[Observer]:
        return [self.outer.begin(self.optimizers, on_after_step, checkpoint_every)]

    def end_steps(self, show: bool) -> dict[str, Any]:
        return self.outer.finish(self.inner_reducer, self.optimizers, show)

    def checkpoint_objects(self, objects: dict[str, Any], restoring: str | os.PathLike[str] | None) -> dict[str, Any]:
        return self.outer.checkpoint_objects(objects, self.optimizers, restoring)
