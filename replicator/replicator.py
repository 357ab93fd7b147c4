"""The Replicator: the one object a researcher's single-device code talks to."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from replicator import _env
from replicator.asynchronous.actor_learner.regime import serves_this_run
from replicator.asynchronous.modes import ActorLearner, DiLoCo, ParameterServers, training_mode
from replicator.cadence import Cadence, Hooks
from replicator.context import InputContext, ReplicaContext
from replicator.epochs import InputPosition
from replicator.health import check_nonfinite_policy
from replicator.inputs import ReplicatedInput
from replicator.job import Job, announced
from replicator.loop import Observer, StepLoop
from replicator.pipeline.randomness import seed_stage
from replicator.pipeline.recompute import check_pipeline_arguments
from replicator.record import RunRecord
from replicator.run_arguments import agree_on_run_arguments
from replicator.scope import ModelScope
from replicator.sync.broadcast import broadcast_state
from replicator.sync.buffers import average_buffers
from replicator.sync.guard import ReplicaGuard
from replicator.sync.optimizer import SyncedOptimizers
from replicator.sync.precision import MixedPrecision, Precision
from replicator.sync.reducers import Reducer, make_reducer
from replicator.sync.sharding import check_shard
from replicator.telemetry import Progress, StepTimes, summarize_run
from replicator.timeline.session import recorded

if TYPE_CHECKING:
    from replicator.checkpoint import Restored
    from replicator.pipeline import PipelineStage

__all__ = ["Replicator"]


@announced("scope", "pipeline", "sync_buffers", "save", "restore", "barrier", "broadcast_state")  # one-sided calls fail
class Replicator:
    """Runs single-device `input_fn`/`step_fn` code on every replica of the job.

    Args:
        reducer: how gradient buckets are summed: "auto" (the default: shared memory when every replica is on this
            node and on CPU, hierarchical across CPU nodes, else one all-reduce), "flat" (one all-reduce), "shm",
            "hierarchical[:XxYxZ]" (DDL-style, per node then across nodes), "fp16"/"bf16" (+"+ef" error feedback),
            "powersgd:R" (replicator.sync.reducers.REDUCER_NAMES), or an object with `reduce(buffer, group, bucket)`.
        bucket_cap_mb: gradient bucket size; larger buckets mean fewer, bigger messages.
        timeout_s: a collective that waits longer raises instead of hanging (default 300 s, or REPLICATOR_TIMEOUT).
        debug: fingerprint every collective, gradient buckets included, and leave a trail of each replica's last
            collective so a timeout names where stragglers were (default: REPLICATOR_DEBUG=1).
        nonfinite: what a NaN or infinite loss (anything step_fn returns) or gradient does: "raise" (the default)
            stops every replica with an error naming the replicas and the step; "skip" also checks the averaged
            gradients before every update and skips that update on every replica (one extra read of the gradients
            per step); "ignore" checks nothing.
        precision: "fp32" (default), "bf16" or "fp16": step_fn runs under torch.autocast; fp16 adds a loss scale
            whose overflow skips agree across replicas (rp.Precision tunes it; docs/how-to/mixed-precision.md).
        uneven_batches: "refuse" (default: unequal batch sizes raise), "weighted" (gradients and ctx.all_mean weigh
            by batch size) or batch -> count (tokens); sparse_as_dense: densify sparse gradients (Horovod's).
        shard: "optimizer" (ZeRO-1), "gradients" (ZeRO-2) or "parameters" (ZeRO-3, FSDP2): docs/how-to/sharding.md.
        stages: pipeline model parallelism (GPipe): the job's processes form replicas × stages, and
            `repl.pipeline(layers)` returns this process's stage. `virtual_stages=V`: V model chunks per stage.
        chunks: micro-batches per batch; schedule: "gpipe", "1f1b", "interleaved" (virtual_stages >= 2), "zero_bubble".
        recompute: which stages re-materialize activations: "always", "except_last" or "never" (`checkpoint=` is
            its old, deprecated name).
        mode: "sync" (default), rp.ParameterServers(...), rp.DiLoCo(...) or rp.ActorLearner(...) (docs/concepts/
            asynchronous.md); mode="async", "diloco" or "actor_learner" with their arguments as keywords is deprecated.
    """

    def __init__(
        self,
        *,
        stages: int = 1, chunks: int = 1, schedule: str = "gpipe", virtual_stages: int = 1,
        reducer: str | Reducer = "auto", bucket_cap_mb: float = 25.0, precision: str | Precision = "fp32",
        timeout_s: float | None = None, debug: bool | None = None, nonfinite: str = "raise", shard: str | None = None,
        uneven_batches: str | Callable[[Any], int] = "refuse", sparse_as_dense: bool = False,
        recompute: str = "except_last", checkpoint: str | None = None,
        mode: str | ParameterServers | DiLoCo | ActorLearner = "sync", **deprecated: Any,  # sync_group_size=, ...
    ) -> None:
        given = {key: value for key, value in locals().items() if key not in ("self", "deprecated")}
        self.arguments = {**given, **deprecated}  # as given: for run records
        recompute = check_pipeline_arguments(stages, chunks, recompute, checkpoint)  # checkpoint=: deprecated
        check_nonfinite_policy(nonfinite)
        precision, shard = Precision.of(precision), check_shard(shard, mode, stages, precision, uneven_batches)
        self.mode = training_mode(mode, stages, deprecated)  # the mode's keywords beside it: deprecated
        self.job = job = Job.start(stages=stages, timeout_s=timeout_s, debug=debug, **self.mode.job_shape())
        self.topology, self.groups, self.device, self.context = job.topology, job.groups, job.device, job.context
        mesh = job.mesh
        self.replica_id, self.num_replicas, self.stage_id = mesh.replica_id, mesh.num_replicas, mesh.stage_id
        self.agreement, self.debug, self.is_main = job.agreement, job.debug, job.topology.rank == 0  # is_main logs
        self.num_stages, self.chunks, self.schedule, self.recompute = stages, chunks, schedule, recompute
        self.virtual_stages = virtual_stages
        synced = self.mode.synced(job, reducer, uneven_batches)  # DiLoCo averages inside a sync group
        self.reducer = make_reducer(self.mode.reducer(reducer), synced, timeout_s=job.timeout_s, device=self.device)
        job.close_with(self.reducer)
        models = self.models = ModelScope(self.groups, self.device, job.replica_agreement, shard, job)
        self.optimizers = SyncedOptimizers(adopt=self.models.adopt,
            context=self.context, group=synced.replica, agreement=job.replica_agreement,
            reducer=self.reducer, bucket_cap_bytes=int(bucket_cap_mb * (1 << 20)), nonfinite=nonfinite,
            debug=job.debug, is_main=self.is_main, stages=job.groups.stage if stages > 1 else None, shard=shard)
        self.precision = MixedPrecision(precision, self.device, self.optimizers, synced)  # autocast, fp16's scale
        self.skipped_steps = self.optimizers.skipped_steps  # steps whose update nonfinite="skip" or fp16 dropped
        self.optimizers.state.configure(uneven_batches, sparse_as_dense, models.modules)
        self.guard = ReplicaGuard(job.replica_agreement, self.optimizers, self._trained_modules, models.tensor_names,
                                  optimizer_state=self.mode.replicas_share_optimizer_state)
        self.last_run: dict[str, Any] = {}
        self.record = RunRecord()  # the latest run()'s: its `directory` on the main process, else None
        self._stages: list[PipelineStage] = []
        self._input = InputPosition(self.replica_id, self.num_replicas, self.device, self.is_main, stages)
        self._restored = False
        # What run(), save() and restore() hand the mode's work to; role: "replica", "server", "learner", ...
        self.regime, self.role = self.mode.regime(job, self.optimizers, models, self._input,
                                                  self._checkpoint_objects, self.reducer)

    @property
    def nonfinite(self) -> str:
        """What a NaN or infinite output or averaged gradient does: "raise", "skip" or "ignore"."""
        return self.optimizers.nonfinite

    @nonfinite.setter
    def nonfinite(self, policy: str) -> None:
        check_nonfinite_policy(policy)
        self.optimizers.nonfinite = policy

    @property
    def global_step(self) -> int:
        """Completed steps of the training, restored ones included."""
        return self.optimizers.state.step

    @global_step.setter
    def global_step(self, step: int) -> None:
        self.optimizers.state.step = step

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- the model -----------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, shard_policy: Callable[[str, torch.nn.Module], bool] | None = None) -> Iterator[Replicator]:
        """Build the model and optimizers inside this block.

        Modules created here are placed on this replica's device and, when the block ends, every replica's parameters
        and buffers are overwritten with replica 0's, so all replicas start identical however they were seeded.
        shard="parameters" then shards them: `shard_policy(name, submodule)` picks the units.
        """
        built = len(self._stages)
        with self.models.block(self.optimizers.parameters, self.optimizers.take_sharded, shard_policy):
            yield self
        if len(self._stages) > built:
            seed_stage(self.job.mesh)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Average the optimizer's gradients across replicas before it updates.

        Returns the same optimizer object (so LR schedulers and state_dict work as usual). Reductions start during
        backward, bucket by bucket, and the backward pass ends with the averages in `.grad`; `step()` averages whatever
        no backward pass reached. Parameter groups added later with `optimizer.add_param_group` start from replica 0's
        values too.
        """
        self.models.check_wrappable(optimizer)
        return self.optimizers.wrap(optimizer, self.models.tensor_names, self.models.names())

    def broadcast_state(self, *objects: torch.nn.Module | torch.optim.Optimizer) -> None:
        """Copy replica 0's parameters and buffers (modules) and state and options (optimizers) to every replica.

        For state loaded on replica 0 only (Horovod's recipe); every replica calls it. run() refuses to start while the
        replicas' parameters or optimizer states differ.
        """
        broadcast_state(objects, self.groups, self.job.replica_agreement, self.models.names())

    def wrap_scheduler(self, scheduler: Any) -> Any:
        """Make an LR scheduler step only when its optimizer really stepped (accumulation)."""
        return self.optimizers.wrap_scheduler(scheduler)

    def pipeline(self, layers: Any, balance: Any = "params", *, sample: Any = None,
                 deferred_batchnorm: bool = False, init: Any = None) -> PipelineStage:
        """This process's stage of `layers` (a list of modules or an nn.Sequential).

        Every process builds the whole model the same way (on the meta device too: then reset_parameters() and
        `init(layer)` give this stage's layers values); only the stage's share stays alive. Call
        `pipe.train_step(inputs, targets, loss_fn)` in step_fn and wrap an optimizer over `pipe.parameters()`: gradients
        are averaged across each stage's replicas. `balance`: layer counts, "params", or "time" (on `sample`).
        """
        from replicator.pipeline import build_pipeline, job_hooks

        hooks = job_hooks(self.no_sync, self.optimizers, self.job.agreement, self.job.mesh, self.precision.scale_losses)
        stage = build_pipeline(layers, stage_id=self.stage_id, num_stages=self.num_stages, balance=balance,
            stage_ranks=self.groups.stage_ranks, stage_group=self.groups.stage, chunks=self.chunks,
            schedule=self.schedule, recompute=self.recompute, device=self.device, sample=sample,
            deferred_batchnorm=deferred_batchnorm, balance_group=self.groups.control, replica=self.replica_id,
            hooks=hooks, virtual_stages=self.virtual_stages, init=init)
        self.models.keep_stage(layers, stage.module)  # else the scope would keep the other stages' layers alive
        self._stages.append(stage)
        if not self.models.is_open:
            seed_stage(self.job.mesh)
        return stage

    # -- gradients -----------------------------------------------------------------------
    def accumulate(self, micro_steps: int, *, epoch_end: str = "carry") -> None:
        """Accumulate gradients over `micro_steps` calls of step_fn before each update.

        step_fn stays as for one batch (zero_grad, backward, step): zero_grad and step take effect every `micro_steps`
        calls, only the last backward communicates, and the update uses the mean over all micro-batches of all replicas.
        An update part way when an epoch ends: `epoch_end="carry"` (the default: every update averages `micro_steps`)
        goes on with it in the next epoch; "flush" (Accelerate's) updates on the micro-batches so far at each epoch's
        end, so that repl.save() works after run(epochs=...).
        """
        self.optimizers.accumulate(micro_steps, epoch_end)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside this block accumulate gradients locally, with no traffic."""
        return self.optimizers.no_sync()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip by the global norm of the *averaged* gradients of all stages, as one process would.

        Call it between backward and optimizer.step(), on every stage. During an accumulation micro-step (when no update
        follows) it does nothing and returns None.
        """
        return self.optimizers.clip_grad_norm_(parameters, max_norm, norm_type, shards=self.groups.stage)

    def sync_buffers(self) -> None:
        """Average the buffers (BatchNorm running statistics) over this stage's replicas, on every replica.

        run() does it when it ends (not after a `break`), save() before writing; call it before evaluating mid-run.
        Integer buffers take replica 0's values; buffers equal everywhere stay bit for bit.
        """
        average_buffers(self._trained_modules(), self.groups.replica, self.job.replica_agreement)

    # -- input and the loop ----------------------------------------------------------------
    def prepare_input(self, input_fn: Callable[[InputContext], Iterable[Any]]) -> ReplicatedInput:
        """Call input_fn once for this replica's input pipeline; batches go to its device."""
        return ReplicatedInput(self.regime.input_fn(input_fn), self._input.context, self.device)

    @recorded  # timeline=: the spans of every process, merged into one Chrome trace (replicator.timeline)
    def run(self, step_fn: Callable[[ReplicaContext, Any], Any], inputs: Iterable[Any], steps: int | None = None, *,
            epochs: int | None = None, progress: bool | None = None, warmup_steps: int = 5, update_period: int = 100,
            checkpoint_every: int | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
            keep: int = 3, every: Hooks | None = None, actor_fn: Callable[..., Any] | None = None,
            record: bool | str | os.PathLike[str] = True, name: str | None = None,
            timeline: bool | str | os.PathLike[str] | None = None) -> Iterator[tuple[int, Any]]:
        """Run `step_fn(ctx, batch)` on every replica; yield `(step, output)` for each step.

        `inputs`: `repl.prepare_input(input_fn)`, a DataLoader (split across replicas) or any iterable of this replica's
        batches. The run ends, on every replica at the same step, once `steps` steps or `epochs` passes (each telling
        the sampler its epoch; neither: one pass) of the whole training are done, restored ones included.
        `repl.last_run` holds its figures. In mode="actor_learner" actors and the evaluator call `actor_fn(actor)`
        (actors pull weights every `update_period` env steps) and yield nothing.

        With `checkpoint_dir`, a fresh Replicator first resumes from the newest complete checkpoint there (parameters,
        optimizers, schedulers, step, epoch and place in it, random generators) without reading the batches before that
        place; with `checkpoint_every=N` it saves after every N-th step and when the run completes, keeping `keep`.
        `every={N: hook}` calls `hook(global_step)` on every replica after every N-th step. The main process records the
        run (`repl.record`) in runs/<time>-<name>, `record` (a path) or not (False). `timeline=True` (or a file path, or
        REPLICATOR_TIMELINE=1) writes every process's spans as one Chrome trace.
        """
        agree_on_run_arguments(self, steps, epochs, checkpoint_every, checkpoint_dir)  # checked, then agreed
        cadence = Cadence(every, checkpoint_every, checkpoint_dir, self._save_step, keep,
                          self.optimizers.mid_accumulation)
        self.record = RunRecord.open(record, name, self.job, self.arguments, self.reducer, self._trained_modules())
        serving = serves_this_run(self.regime, actor_fn, update_period, steps)  # a server, an actor, the evaluator
        from replicator.checkpoint import latest

        fresh = not self._restored and self.global_step == 0  # a fresh Replicator resumes from checkpoint_dir
        if checkpoint_dir is not None and fresh and self.regime.restores and (last := latest(checkpoint_dir)):
            self.restore(last)
        if serving:  # a parameter server serves the groups (and saves when they ask); actors act: no steps here
            self.last_run = self.regime.serve()
            return
        show = self.is_main and (_env.progress() if progress is None else progress)
        times = StepTimes(warmup_steps=warmup_steps)
        self.context.on_wait = times.add_communication
        self.optimizers.set_on_wait(times.add_communication)
        self.regime.begin(times.add_communication)  # async: the servers' parameters, and updates through them
        self.guard.require_identical("at the start of run()")  # parameters, buffers and optimizer state
        observers: list[Observer] = [*self.regime.observers(times.add_after_step, checkpoint_every), times,  # DiLoCo's
            Progress(steps, enabled=show), self.guard.watch_gradients(), self.record, *cadence.observers]
        loop = StepLoop(self.job.agreement, self.context, self.optimizers.state, self.nonfinite, self.precision)
        outcome = yield from loop.run(step_fn, self._input.begin(inputs, epochs, steps), steps, observers)
        figures = self.regime.end_steps(show)  # DiLoCo: a round cut short is closed before the final checkpoint
        cadence.finish(outcome.steps, self.regime.saves_at_the_end, self.optimizers.mid_accumulation(), self.print)
        self.sync_buffers()
        self.guard.require_identical("at the end of run()")
        figures |= self.regime.finish(times, show) | self.precision.figures()  # async: every group done; skipped steps
        table = show and not self.regime.prints_report  # async: every group's report and table, from finish()
        self.last_run = summarize_run(self.job.agreement, times, outcome.steps, outcome.ended_early, table) | figures
        self.last_run = self.record.finish(self.last_run)  # with run_dir; into summary.json

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, keep: int | None = None,
             extra: dict[str, Any] | None = None) -> Path:
        """Checkpoint the training: every process calls it, between steps.

        Saved: the modules built in repl.scope() (or this process's pipeline stage), wrapped optimizers and schedulers,
        `global_step`, the input position and every replica's random generators; `extra` is any JSON-able metadata. The
        write is atomic (a crash leaves the previous checkpoint intact); `keep` prunes `path`'s directory to the newest
        `keep` checkpoints. See replicator.checkpoint.
        """
        objects = self._checkpoint_objects()  # first: DiLoCo refuses to save in the middle of a round
        self.optimizers.refuse_mid_accumulation("repl.save()")
        self.sync_buffers()
        if not self.regime.serves:  # parameter servers each hold their own shard's current values
            self.guard.require_identical(f"before saving a checkpoint at step {self.global_step}")
        return self.regime.save(path, objects, self.global_step, self._input.state_dict(), extra, keep)

    def _save_step(self, directory: str | os.PathLike[str], step: int, keep: int) -> Path:
        from replicator.checkpoint import step_path
        return self.save(step_path(directory, step), keep=keep)

    def restore(self, path: str | os.PathLike[str]) -> Restored:
        """Load a checkpoint written with any replica count (and stage split of the same model).

        The next run() continues from its step and input position. A checkpoint of another model raises
        CheckpointMismatchError on every process, naming the keys that differ.
        """
        restored = self.regime.restore(path, self._checkpoint_objects(path))
        self.optimizers.restart_counts()
        self.global_step = restored.step
        self._input.restored(restored)
        self._restored = True
        return restored

    def _checkpoint_objects(self, restoring: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        from replicator.checkpoint.training import training_objects

        stages, optimizers = [stage.module for stage in self._stages], [w.optimizer for w in self.optimizers.wrapped]
        return self.regime.checkpoint_objects(training_objects(stages, self.models.modules, optimizers,  # DiLoCo: more
            list(self.optimizers.schedulers), self.job.mesh, self.groups.control, self.precision.states()), restoring)

    def _trained_modules(self) -> list[torch.nn.Module]:
        """The modules built in scope(), or this process's pipeline stages."""
        return [stage.module for stage in self._stages] if self._stages else list(self.models.modules)

    # -- the job ---------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every process of the job reaches this point: the check that @announced makes is the barrier."""

    def close(self) -> None:
        """Release the process groups (called at exit when replicator created them)."""
        self.optimizers.close()
        self.job.close()
