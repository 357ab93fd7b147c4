"""The Replicator: the one object a researcher's single-device code talks to."""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import types
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.nn.modules import module as module_hooks

from replicator.comm import collectives
from replicator.comm.agreement import Agreement, PendingAgreement
from replicator.context import InputContext, ReplicaContext, set_active_context
from replicator.errors import ReplicaMismatchError, ReplicatorUsageError
from replicator.health import NONFINITE_POLICIES, NonFiniteError, OutputCheck, require_identical
from replicator.inputs import ReplicatedInput, batch_size_of
from replicator.comm.local_link import LocalLink
from replicator.sync.reducers import Reducer, make_reducer
from replicator.sync.synchronizer import GradientSynchronizer
from replicator.telemetry import Progress, StepTimes, breakdown_table
from replicator.topology import DEFAULT_TIMEOUT_S, build_process_groups, discover

if TYPE_CHECKING:
    from replicator.checkpoint import Restored

__all__ = ["Replicator"]


@dataclass(eq=False)
class _WrappedOptimizer:
    optimizer: torch.optim.Optimizer
    synchronizer: GradientSynchronizer
    calls: int = 0  # optimizer.step() calls, micro-steps included
    stepped: bool = False  # did the last step() update the parameters?


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


class Replicator:
    """Runs single-device `input_fn`/`step_fn` code on every replica of the job.

    Args:
        reducer: how gradient buckets are summed across replicas: "auto" (the default:
            through shared memory when every replica is on this node and on CPU,
            hierarchical across CPU nodes, else one all-reduce), "flat" (one all-reduce), "shm",
            "hierarchical" (DDL-style, per node then across nodes),
            "hierarchical:XxYxZ", "fp16"/"bf16" (+"+ef" error feedback), "powersgd:R" — see
            replicator.sync.reducers.REDUCER_NAMES — or an object with `reduce(buffer, group, bucket)`.
        bucket_cap_mb: gradient bucket size; larger buckets mean fewer, bigger messages.
        timeout_s: a collective that waits longer than this raises instead of hanging
            (default 300 s, or REPLICATOR_TIMEOUT).
        debug: fingerprint every collective, gradient buckets included, and leave a trail
            of each replica's last collective so a timeout names where stragglers were
            (default: REPLICATOR_DEBUG=1).
        nonfinite: what a NaN or infinite loss (anything step_fn returns) or gradient does:
            "raise" (the default) stops every replica with an error naming the replicas and
            the step; "skip" also checks the averaged gradients before every update and
            skips that update on every replica (one extra read of the gradients per step);
            "ignore" checks nothing.
        stages, chunks, schedule, checkpoint: pipeline model parallelism (GPipe). The job's
            processes form replicas × stages; `repl.pipeline(layers)` returns this process's
            stage, which splits each batch into `chunks` micro-batches and runs `schedule`
            ("gpipe" or "1f1b"), re-materializing activations per `checkpoint`.
    """

    def __init__(
        self,
        *,
        stages: int = 1,
        chunks: int = 1,
        schedule: str = "gpipe",
        checkpoint: str = "except_last",
        reducer: str | Reducer = "auto",
        bucket_cap_mb: float = 25.0,
        timeout_s: float | None = None,
        debug: bool | None = None,
        nonfinite: str = "raise",
    ) -> None:
        self.topology = discover()
        threads = os.environ.get("REPLICATOR_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
        timeout_s = float(os.environ.get("REPLICATOR_TIMEOUT", DEFAULT_TIMEOUT_S)) if timeout_s is None else timeout_s
        self._created_process_group = self.topology.distributed and not dist.is_initialized()
        if stages < 1 or chunks < 1:
            raise ReplicatorUsageError(f"stages and chunks must be at least 1, got stages={stages}, chunks={chunks}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ReplicatorUsageError(f"nonfinite={nonfinite!r} is not one of {', '.join(map(repr, NONFINITE_POLICIES))}")
        self.nonfinite = nonfinite
        self.skipped_steps: list[int] = []  # steps whose update nonfinite="skip" dropped
        self.groups = build_process_groups(self.topology, stages=stages, timeout_s=timeout_s)
        self.num_stages, self.chunks, self.schedule, self.checkpoint = stages, chunks, schedule, checkpoint
        self.stage_id = self.groups.stage_ranks.index(self.topology.rank)
        if self._created_process_group:
            atexit.register(self.close)
        self.debug = _env_flag("REPLICATOR_DEBUG") if debug is None else debug
        self.reducer = make_reducer(reducer, self.groups, timeout_s=timeout_s, device=self.topology.device)
        self.bucket_cap_bytes = int(bucket_cap_mb * (1 << 20))
        self.num_replicas = len(self.groups.replica_ranks)
        self.replica_id = self.groups.replica_ranks.index(self.topology.rank)
        self.device = self.topology.device
        # The whole job's checks (steps, run summary) and those of this stage's replicas, each
        # over a Unix-socket link when the group lives on one node (decided together).
        self.agreement = Agreement(self.groups.control, self.debug, LocalLink.connect(self.groups.control, timeout_s))
        self.replica_agreement = Agreement(self.groups.replica_control, self.debug,
                                           LocalLink.connect(self.groups.replica_control, timeout_s))
        self.context = ReplicaContext(self.replica_id, self.num_replicas, self.groups.replica, self.replica_agreement)
        # A third link, for the data of small ctx collectives: kept apart from the checks, whose
        # order relative to collectives in a backward pass need not match across replicas. It is
        # made over the replicas' Gloo control group (the replica group may be NCCL, which cannot
        # carry the set-up's host tensors), whose members are the same in the same order.
        self._data_link = None
        if self.groups.replica is not None and self.groups.replica_control is not None:
            self._data_link = LocalLink.connect(self.groups.replica_control, timeout_s)
        if self._data_link is not None:
            assert self._data_link.ranks == dist.get_process_group_ranks(self.groups.replica)
            collectives.attach_link(self.groups.replica, self._data_link)
        set_active_context(self.context)
        self._times = StepTimes()
        self.context.on_wait = lambda seconds: self._times.add_communication(seconds)
        self._wrapped: list[_WrappedOptimizer] = []
        self._owner: dict[int, _WrappedOptimizer] = {}
        self._names: dict[int, str] = {}
        self._scope: _Scope | None = None
        self._accumulation = 1
        self._no_sync_depth = 0
        self.last_run: dict[str, Any] = {}
        # What checkpoints hold: modules built in scope (or pipeline stages), schedulers, and
        # how far training got: completed steps and the batches consumed in the input's epoch.
        self._modules: list[torch.nn.Module] = []
        self._stages: list[Any] = []
        self._schedulers: list[Any] = []
        self.global_step = 0  # completed steps of the training, restored ones included
        self._input: Any = None
        self._input_start = (0, 0)  # (step, batches consumed) when the current run's input began
        self._pending_input: dict[str, Any] | None = None  # a restored position, for the next run()
        self._restored = False
        self._checked_identical = False  # run() compares the replicas' parameters once

    # -- identity ----------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """True on the one process that should log, print and save (global rank 0)."""
        return self.topology.rank == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- model set-up ----------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["Replicator"]:
        """Build the model and optimizers inside this block.

        Modules created here are placed on this replica's device and, when the block
        ends, every replica's parameters and buffers are overwritten with replica 0's, so
        all replicas start identical however they were seeded.
        """
        if self._scope is not None:
            raise ReplicatorUsageError("repl.scope() is already open; scopes do not nest")
        scope = _Scope()
        self._scope = scope
        handles = [
            module_hooks.register_module_parameter_registration_hook(scope.saw_tensor),
            module_hooks.register_module_buffer_registration_hook(scope.saw_tensor),
            module_hooks.register_module_module_registration_hook(scope.saw_child),
        ]
        placement = torch.device(self.device) if self.device.type != "cpu" else contextlib.nullcontext()
        try:
            with placement:
                yield self
        finally:
            for handle in handles:
                handle.remove()
            self._scope = None
        self._finish_scope(scope)

    def _finish_scope(self, scope: _Scope) -> None:
        roots = scope.roots()
        for root in roots:
            root.to(self.device)
        self._modules.extend(root for root in roots if all(root is not m for m in self._modules))
        self._names.update(scope.names())
        tensors: dict[int, torch.Tensor] = {}
        for root in roots:
            for tensor in [*root.parameters(), *root.buffers()]:
                tensors[id(tensor)] = tensor
        for wrapped in self._wrapped:
            for group in wrapped.optimizer.param_groups:
                for param in group["params"]:
                    tensors.setdefault(id(param), param)
        self._check_devices(tensors.values(), where="at the end of repl.scope()")
        if self.num_replicas > 1:
            _broadcast_from_first(list(tensors.values()), self.groups.replica, self.groups.replica_ranks[0])

    def _check_devices(self, tensors: Iterable[torch.Tensor], where: str) -> None:
        for tensor in tensors:
            if tensor.device != self.device:
                name = self._names.get(id(tensor)) or (self._scope.names().get(id(tensor)) if self._scope else None)
                raise ReplicatorUsageError(
                    f"{name or 'a parameter of shape ' + str(tuple(tensor.shape))} is on {tensor.device} but replica "
                    f"{self.replica_id} runs on {self.device} ({where}); create the model inside repl.scope() "
                    f"or move it with model.to(repl.device) before wrapping its optimizer"
                )

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Average the optimizer's gradients across replicas before it updates.

        Returns the same optimizer object (so LR schedulers and state_dict work as usual).
        Reductions start during backward, bucket by bucket, and the backward pass ends with
        the averages in `.grad`; `step()` averages whatever no backward pass reached.
        """
        if self._scope is None:
            raise ReplicatorUsageError(
                f"wrap_optimizer() was called outside repl.scope() (replica {self.replica_id}); create the model "
                "and wrap its optimizer inside `with repl.scope():` so that every replica starts identical"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"wrap_optimizer() takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if any(w.optimizer is optimizer for w in self._wrapped):
            raise ReplicatorUsageError("this optimizer is already wrapped; wrap each optimizer once")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        names = {**self._scope.names(), **self._names}
        self._names.update(names)
        self._check_devices(params, where="in wrap_optimizer()")
        for param in params:
            if id(param) in self._owner:
                raise ReplicatorUsageError(
                    f"parameter {names.get(id(param), tuple(param.shape))} belongs to two wrapped optimizers; "
                    "give each parameter to one optimizer (or use parameter groups)"
                )
        label = f"optimizer {len(self._wrapped)} ({type(optimizer).__name__})"
        wrapped = _WrappedOptimizer(optimizer, None)  # type: ignore[arg-type]
        wrapped.synchronizer = GradientSynchronizer(
            params, self.groups.replica, self.replica_agreement, self.reducer, self.bucket_cap_bytes, self._names, label,
            should_sync=lambda: self._no_sync_depth == 0 and wrapped.calls % self._accumulation == self._accumulation - 1,
            accumulation=lambda: self._accumulation,
            on_wait=self._times.add_communication,
            debug=self.debug,
        )
        for param in params:
            self._owner[id(param)] = wrapped
        self._wrapped.append(wrapped)
        _patch_optimizer(self, wrapped)
        return optimizer

    def wrap_scheduler(self, scheduler: Any) -> Any:
        """Make an LR scheduler step only when its optimizer really stepped (accumulation)."""
        wrapped = next((w for w in self._wrapped if w.optimizer is scheduler.optimizer), None)
        if wrapped is None:
            raise ReplicatorUsageError("wrap the scheduler's optimizer with repl.wrap_optimizer() first")
        original = scheduler.step

        def step(_: Any, *args: Any, **kwargs: Any) -> Any:
            if wrapped.stepped:
                return original(*args, **kwargs)
            return None

        scheduler.step = types.MethodType(step, scheduler)
        self._schedulers.append(scheduler)
        return scheduler

    def pipeline(self, layers: Any, balance: Any = "params", *, sample: Any = None,
                 deferred_batchnorm: bool = False) -> Any:
        """This process's stage of `layers` (a list of modules or an nn.Sequential).

        Every process builds the whole model the same way; the stage keeps its share. Call
        `pipe.train_step(inputs, targets, loss_fn)` in step_fn and wrap an optimizer over
        `pipe.parameters()`: gradients are then averaged across the replicas of each stage.
        `balance` is a list of layer counts, "params", or "time" (profiled on `sample`).
        """
        from replicator.pipeline import build_pipeline

        stage = build_pipeline(
            layers, stage_id=self.stage_id, num_stages=self.num_stages, balance=balance,
            stage_ranks=self.groups.stage_ranks, stage_group=self.groups.stage, chunks=self.chunks,
            schedule=self.schedule, checkpoint=self.checkpoint, device=self.device, sample=sample,
            deferred_batchnorm=deferred_batchnorm, balance_group=self.groups.control,
            replica=self.replica_id, no_sync=self.no_sync,
        )
        if self.num_replicas > 1:
            _fail_together(stage, self.agreement, lambda: [wrapped.synchronizer for wrapped in self._wrapped])
        self._stages.append(stage)
        return stage

    # -- gradients ---------------------------------------------------------------------
    def accumulate(self, micro_steps: int) -> None:
        """Accumulate gradients over `micro_steps` calls of step_fn before each update.

        step_fn stays as for one batch (zero_grad, backward, step): zero_grad and step
        take effect every `micro_steps` calls, only the last backward communicates, and the
        update uses the mean over all micro-batches of all replicas.
        """
        if micro_steps < 1:
            raise ReplicatorUsageError(f"accumulate() needs a positive number of micro-steps, got {micro_steps}")
        if any(w.calls % self._accumulation for w in self._wrapped):
            raise ReplicatorUsageError("accumulate() can only change between updates, not in the middle of one")
        for wrapped in self._wrapped:
            wrapped.calls = 0
        self._accumulation = micro_steps

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients locally, with no traffic."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip by the global norm of the *averaged* gradients, as single-process training would.

        Call it between backward and optimizer.step(). During an accumulation micro-step
        (when no update follows) it does nothing and returns None.
        """
        params = list(parameters)
        for wrapped in {id(w): w for p in params if (w := self._owner.get(id(p)))}.values():
            if wrapped.calls % self._accumulation != self._accumulation - 1:
                return None
            wrapped.synchronizer.finalize()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        # The norm of averaged gradients is the same on every replica: so is this verdict.
        if self.nonfinite == "raise" and not bool(torch.isfinite(norm)):
            raise NonFiniteError(
                f"the averaged gradients' norm is {float(norm)} at step {self.global_step} (raised on replica "
                f"{self.replica_id}); some replica's loss or gradient overflowed or became NaN. Lower the learning "
                "rate, check the data, or pass nonfinite='skip' to drop such updates on every replica"
            )
        return norm

    def _skip_update(self, wrapped: _WrappedOptimizer) -> None:
        """Drop this update on every replica: the averaged gradients, hence the verdict, are the same everywhere."""
        for group in wrapped.optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        wrapped.synchronizer.end_window()
        if self.global_step not in self.skipped_steps:
            self.skipped_steps.append(self.global_step)
        if self.is_main:
            print(f"replicator: step {self.global_step}: the averaged gradients of {wrapped.synchronizer.label} are NaN "
                  "or infinite; its update was skipped on every replica (nonfinite='skip')", flush=True)

    # -- input and the loop ------------------------------------------------------------
    def prepare_input(self, input_fn: Callable[[InputContext], Iterable[Any]]) -> ReplicatedInput:
        """Call input_fn once for this replica's input pipeline; batches go to its device."""
        context = InputContext(
            num_replicas=self.num_replicas,
            replica_id=self.replica_id,
            input_pipeline_id=self.replica_id,
            num_input_pipelines=self.num_replicas,
        )
        return ReplicatedInput(input_fn, context, self.device)

    def run(
        self,
        step_fn: Callable[[ReplicaContext, Any], Any],
        inputs: Iterable[Any],
        steps: int | None = None,
        *,
        progress: bool | None = None,
        warmup_steps: int = 5,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keep: int = 3,
    ) -> Iterator[tuple[int, Any]]:
        """Run `step_fn(ctx, batch)` on every replica; yield `(step, output)` for each step.

        Steps are numbered over the whole training: from `repl.global_step`, which earlier
        run() calls and restore() advance. The run ends once `steps` steps are done in all
        (earlier and restored ones included) or when any replica's input
        runs out, on every replica at the same step. At the end replica 0 prints the
        step-time breakdown and `repl.last_run` holds the figures.

        With `checkpoint_dir`, a fresh Replicator first resumes from the newest complete
        checkpoint there, if any (parameters, optimizers, schedulers, step, input position,
        random generators); with `checkpoint_every=N` it saves one after every N-th step and
        keeps the newest `keep`. Under `replicator launch --max-restarts R` that is all a
        script needs to survive the death of a replica.
        """
        if steps is not None and steps < 0:
            raise ReplicatorUsageError(f"steps must be >= 0, got {steps}")
        if checkpoint_every is not None and (checkpoint_dir is None or checkpoint_every < 1
                                             or checkpoint_every % self._accumulation):
            raise ReplicatorUsageError(
                f"checkpoint_every={checkpoint_every} needs a checkpoint_dir and must be a positive multiple of the "
                f"accumulation ({self._accumulation} micro-steps), so that checkpoints fall between updates"
            )
        if checkpoint_dir is not None and not self._restored and self.global_step == 0:
            from replicator.checkpoint import latest

            last = latest(checkpoint_dir)
            if last is not None:
                self.restore(last)
        show = (self.is_main and os.environ.get("REPLICATOR_PROGRESS", "1") != "0") if progress is None else (progress and self.is_main)
        times = StepTimes(warmup_steps=warmup_steps)
        self._times = times
        self.context.on_wait = times.add_communication
        for wrapped in self._wrapped:
            wrapped.synchronizer.on_wait = times.add_communication
        if not self._checked_identical:
            self._require_identical_replicas()
        bar = Progress(steps, enabled=show)
        iterator = self._start_input(inputs)
        step = self.global_step
        ended_early: list[int] = []
        checks: deque[OutputCheck] = deque()  # outputs not yet judged finite, oldest first
        judged: OutputCheck | None = None  # the one the latest announcement carries
        try:
            batch, has_batch, waited = _next_batch(iterator)
            times.input_seconds += waited
            pending = self._announce_step(step, batch, has_batch, steps, None)
            while steps is None or step < steps:
                started = time.perf_counter()
                if pending is not None:
                    if self._must_stop(step, pending, has_batch, ended_early, judged):
                        break
                elif not has_batch:
                    break
                agreed = time.perf_counter() - started
                times.add_communication(agreed)
                size = batch_size_of(batch)
                self.context.step = step
                # Announce the next step before running this one: the agreement then travels
                # while this step computes, instead of adding a round trip between steps.
                upcoming, has_upcoming, waited = ((None, False, 0.0) if steps is not None and step + 1 >= steps
                                                  else _next_batch(iterator))
                times.input_seconds += waited
                # The announcement judges an earlier step's output: the last one, or the one before
                # while the last is still on its way from a GPU (the host then never waits for it).
                judged = checks.popleft() if len(checks) > 1 or (checks and not checks[0].waits_for_a_device) else None
                pending = self._announce_step(step + 1, upcoming, has_upcoming, steps, judged)
                computing = time.perf_counter()
                output = step_fn(self.context, batch)
                _check_output(output)
                if self.nonfinite == "raise":
                    checks.append(OutputCheck(output, step))
                times.step_seconds += agreed + time.perf_counter() - computing
                times.finish_step(size * self.num_replicas)
                bar.update(step + 1, size * self.num_replicas, output)
                self.global_step = step + 1
                if checkpoint_every and self.global_step % checkpoint_every == 0:
                    from replicator.checkpoint import step_path

                    self.save(step_path(checkpoint_dir, self.global_step), keep=keep)  # type: ignore[arg-type]
                batch, has_batch = upcoming, has_upcoming
                yield step, output
                step += 1
            if pending is not None:  # the last step's outputs are still to be judged
                self._judge_outputs(pending.wait(), judged)
            while checks:  # outputs not judged yet: one more agreement each
                judged = checks.popleft()
                last = self._announce_step(step, None, False, step, judged)
                if last is not None:
                    self._judge_outputs(last.wait(), judged)
        finally:
            bar.close()
        self.sync_buffers()
        self._summarize(times, show, ended_early, step)

    def _start_input(self, inputs: Iterable[Any]) -> Iterator[Any]:
        """Iterate `inputs`, from where a restored checkpoint left them if there is one."""
        pending, self._pending_input = self._pending_input, None
        skip = int(pending["batches"]) if pending else 0
        if isinstance(inputs, ReplicatedInput):
            if pending is not None:
                inputs.load_state_dict(pending)
            iterator = iter(inputs)
        else:
            # A plain iterable can only be skipped through: right for lists and other
            # re-iterable inputs that yield the same batches every time.
            iterator = iter(inputs)
            for _ in range(skip):
                next(iterator, None)
        self._input, self._input_start = inputs, (self.global_step, skip)
        return iterator

    def _input_state(self) -> dict[str, Any]:
        """The input position of the current step, for a checkpoint."""
        if self._pending_input is not None:  # restored, not yet run: save what was restored
            return dict(self._pending_input)
        start_step, start_batches = self._input_start
        batches = start_batches + self.global_step - start_step  # one batch per step; a prefetched one is not consumed
        if isinstance(self._input, ReplicatedInput):
            return self._input.state_dict(batches)
        return {"epoch": 0, "batches": batches}

    def _announce_step(self, step: int, batch: Any, has_batch: bool, steps: int | None,
                       judged: OutputCheck | None) -> PendingAgreement | None:
        """Start agreeing on the next step (has a batch? of what size?) while the caller works.

        The announcement also carries whether the `judged` step's output (an earlier one)
        was finite, so that every replica learns of a NaN anywhere at no extra cost. Past the
        last step it is still made when there is an output to judge.
        """
        nonfinite = judged.locations() if judged is not None else []
        if self.num_replicas == 1:
            if judged is not None and nonfinite:
                raise NonFiniteError(self._nonfinite_message(judged.step, {0: nonfinite}))
            return None
        if steps is not None and step >= steps and judged is None:
            return None
        size = batch_size_of(batch) if has_batch else 0
        return self.agreement.start(f"step {step}", "", [int(has_batch), size, int(bool(nonfinite))])

    def _judge_outputs(self, verdict: Any, judged: OutputCheck | None) -> None:
        """Raise on every replica if any replica's `judged` output was NaN or infinite."""
        if verdict.maxima[2] == 0:
            return
        nonfinite = judged.locations() if judged is not None else []
        step = judged.step if judged is not None else -1
        intents = self.agreement.exchange("non-finite outputs", "", [float(bool(nonfinite)), float(step)])
        culprits = {i.replica: ["(see that replica's error)"] for i in intents if i.values[0]}
        if nonfinite:
            culprits[self.replica_id] = nonfinite
        raise NonFiniteError(self._nonfinite_message(int(max(i.values[1] for i in intents)), culprits))

    def _nonfinite_message(self, step: int, culprits: dict[int, list[str]]) -> str:
        listing = "; ".join(f"replica {replica}: {', '.join(spots)}" for replica, spots in sorted(culprits.items()))
        return (
            f"step_fn's output is NaN or infinite at step {step} on replica(s) {sorted(culprits)} ({listing}); raised "
            f"on replica {self.replica_id}. Its gradients were averaged into every replica's update. Lower the "
            "learning rate or check the data (a checkpoint from before this step is safe to resume from), or pass "
            "rp.Replicator(nonfinite='skip') to drop such updates on every replica"
        )

    def _require_identical_replicas(self) -> None:
        """Every replica of this stage must start run() with bit-identical parameters and buffers."""
        named: dict[int, tuple[str, torch.Tensor]] = {}
        for wrapped in self._wrapped:
            for group in wrapped.optimizer.param_groups:
                for param in group["params"]:
                    named.setdefault(id(param), (self._names.get(id(param), f"parameter {tuple(param.shape)}"), param))
        for module in self._modules:
            for name, buffer in module.named_buffers():
                named.setdefault(id(buffer), (f"{type(module).__name__}.{name}", buffer))
        require_identical(self.replica_agreement, list(named.values()), "at the start of run()")
        self._checked_identical = True

    def _must_stop(self, step: int, pending: PendingAgreement, has_batch: bool, ended_early: list[int],
                   judged: OutputCheck | None) -> bool:
        """True when some replica has no batch for this step; raises on unequal batch sizes."""
        verdict = pending.wait()
        self._judge_outputs(verdict, judged)
        (has_max, size_max, _), (has_min, size_min, _) = verdict.maxima, verdict.minima
        if has_min == 0:
            if has_max == 1:  # some replicas still had data: say who ran out
                intents = self.agreement.exchange("input ended", "", [float(has_batch)])
                ended_early.extend(i.replica for i in intents if not i.values[0])
                if self.is_main:
                    print(
                        f"replicator: input ran out on replica(s) {ended_early} at step {step} while others had "
                        "more; every replica stops here (shard evenly, e.g. ctx.sampler(..., drop_last=True))",
                        flush=True,
                    )
            return True
        if size_max != size_min:
            intents = self.agreement.exchange("batch sizes", "", [float(pending.values[1])])
            listing = ", ".join(f"replica {i.replica}: {int(i.values[0])}" for i in intents)
            raise ReplicaMismatchError(
                f"replicas have different batch sizes at step {step} ({listing}), raised on replica "
                f"{self.replica_id}. Averaging their gradients would weight samples unequally. Use a global "
                "batch divisible by the number of replicas and drop the last partial batch (drop_last=True)."
            )
        return False

    def sync_buffers(self) -> None:
        """Average the buffers (BatchNorm running statistics) over this stage's replicas.

        Each replica's BatchNorm tracks statistics of its own shard only. run() calls this when
        it ends (not when the loop over it is left with `break`) and save() before writing, so
        evaluation and checkpoints see one model; call it yourself before evaluating in the
        middle of a run or after a `break` (every replica, at the same point). Integer buffers
        take replica 0's values; buffers already equal everywhere (CrossReplicaBatchNorm's
        statistics, constant tables) stay bit for bit.
        """
        from replicator.sync.buffers import average_buffers

        average_buffers(self._trained_modules(), self.groups.replica, self.replica_agreement)

    def _trained_modules(self) -> list[torch.nn.Module]:
        """The modules built in scope(), or this process's pipeline stages."""
        return [stage.module for stage in self._stages] if self._stages else list(self._modules)

    def _summarize(self, times: StepTimes, show: bool, ended_early: list[int], steps: int) -> None:
        summary = self.agreement.exchange("run summary", "", times.as_values())
        per_replica = [[float(v) for v in intent.values] for intent in summary]
        total_step = sum(r[1] for r in per_replica)
        total_comm = sum(r[3] for r in per_replica)
        total_input = sum(r[4] for r in per_replica)
        self.last_run = {
            "steps": steps,
            "samples_per_second": times.steady_samples_per_second(),
            "communication_share": float(total_comm / max(total_step + total_input, 1e-12)),
            "per_replica": per_replica,
            "ended_early": ended_early,
        }
        if show and steps:
            from rich.console import Console

            Console().print(breakdown_table(per_replica))

    # -- checkpoints -------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, keep: int | None = None, extra: dict[str, Any] | None = None) -> Path:
        """Checkpoint the training: every process calls it, between steps.

        Saved: the modules built in repl.scope() (or this process's pipeline stage),
        wrapped optimizers and schedulers, `global_step`, the input position and every
        replica's random generators; `extra` is any JSON-able metadata. The write is atomic
        (a crash leaves the previous checkpoint intact); `keep` prunes `path`'s directory
        to the newest `keep` checkpoints. See replicator.checkpoint.
        """
        from replicator import checkpoint

        if any(w.calls % self._accumulation for w in self._wrapped):
            raise ReplicatorUsageError("repl.save() was called in the middle of an accumulation; save between updates")
        self.sync_buffers()
        return checkpoint.save(path, **self._checkpoint_objects(), step=self.global_step, input_state=self._input_state(),
                               extra=extra, keep=keep)

    def restore(self, path: str | os.PathLike[str]) -> "Restored":
        """Load a checkpoint written with any replica count (and stage split of the same model).

        The next run() continues from its step and input position. A checkpoint of another
        model raises CheckpointMismatchError on every process, naming the keys that differ.
        """
        from replicator import checkpoint

        restored = checkpoint.restore(path, **self._checkpoint_objects())
        for wrapped in self._wrapped:
            wrapped.calls, wrapped.stepped = 0, False
        self.global_step = restored.step
        self._pending_input = restored.input_state
        self._restored = True
        return restored

    def _checkpoint_objects(self) -> dict[str, Any]:
        from replicator.checkpoint import Layout

        if self._stages:
            # A stage keeps its layers' indices in the whole model, so the stages' keys
            # together are the unsplit model's: such a checkpoint restores without a pipeline.
            modules = {("model" if i == 0 else f"model{i}"): stage.module for i, stage in enumerate(self._stages)}
        elif len(self._modules) == 1:
            modules = {"model": self._modules[0]}
        else:
            modules = {f"model{i}": module for i, module in enumerate(self._modules)}
        if not modules:
            raise ReplicatorUsageError("there is nothing to checkpoint: build the model inside `with repl.scope():`")
        return {
            "modules": modules,
            "optimizers": [w.optimizer for w in self._wrapped],
            "schedulers": list(self._schedulers),
            "layout": Layout(self.replica_id, self.num_replicas, self.stage_id, self.num_stages),
            "group": self.groups.control,
        }

    # -- the job ---------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every replica reaches this point."""
        if self.groups.control is not None:
            dist.barrier(group=self.groups.control)

    def close(self) -> None:
        """Release the process groups (called at exit when replicator created them)."""
        for wrapped in self._wrapped:
            wrapped.synchronizer.remove()
        getattr(self.reducer, "close", lambda: None)()
        if self._data_link is not None:
            collectives.detach_link(self.groups.replica, self._data_link)  # type: ignore[arg-type]
        # A peer still collecting this replica's last messages reads them before it sees the close.
        for link in (self.agreement.link, self.replica_agreement.link, self._data_link):
            if link is not None:
                link.close()
        if self._created_process_group and dist.is_initialized():
            # Tear down together: a replica that closes its sockets while a peer is still
            # finishing its last collective can make that peer abort at exit.
            with contextlib.suppress(RuntimeError):
                if self.groups.control is not None:
                    dist.barrier(group=self.groups.control)
            dist.destroy_process_group()
            self._created_process_group = False


class _Scope:
    """What was built inside one `repl.scope()` block: modules and their tensors."""

    def __init__(self) -> None:
        self.modules: dict[int, torch.nn.Module] = {}
        self.children: set[int] = set()

    def saw_tensor(self, module: torch.nn.Module, name: str, tensor: Any) -> None:
        self.modules.setdefault(id(module), module)

    def saw_child(self, parent: torch.nn.Module, name: str, child: Any) -> None:
        self.modules.setdefault(id(parent), parent)
        if child is not None:
            self.modules.setdefault(id(child), child)
            self.children.add(id(child))

    def roots(self) -> list[torch.nn.Module]:
        return [m for key, m in self.modules.items() if key not in self.children]

    def names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for root in self.roots():
            prefix = type(root).__name__
            for name, tensor in [*root.named_parameters(prefix=prefix), *root.named_buffers(prefix=prefix)]:
                names.setdefault(id(tensor), name)
        return names


def _patch_optimizer(repl: Replicator, wrapped: _WrappedOptimizer) -> None:
    """Replace the instance's step and zero_grad; the class, state_dict and hooks stay torch's."""
    optimizer = wrapped.optimizer
    original_step = optimizer.step
    original_zero_grad = optimizer.zero_grad
    synchronizer = wrapped.synchronizer

    def step(_: Any, closure: Callable[[], Any] | None = None) -> Any:
        if repl._no_sync_depth:
            raise ReplicatorUsageError(
                "optimizer.step() was called inside repl.no_sync(): gradients there are not synchronized, so "
                "replicas would diverge; step after leaving no_sync()"
            )
        wrapped.calls += 1
        wrapped.stepped = False
        if wrapped.calls % repl._accumulation:
            return None
        if closure is None:
            synchronizer.finalize()
            if repl.nonfinite == "skip" and not synchronizer.gradients_finite():
                repl._skip_update(wrapped)
                return None
            result = original_step()
        else:
            if repl._accumulation != 1:
                raise ReplicatorUsageError("optimizers that take a closure (LBFGS) cannot be combined with accumulate()")
            result = original_step(_synchronized_closure(repl, synchronizer, closure))
        synchronizer.end_window()
        wrapped.stepped = True
        return result

    def zero_grad(_: Any, set_to_none: bool = True) -> None:
        if wrapped.calls % repl._accumulation:
            return  # in the middle of an accumulation: keep the partial sums
        synchronizer.end_window(discard=True)
        original_zero_grad(set_to_none)

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]


def _synchronized_closure(repl: Replicator, synchronizer: GradientSynchronizer, closure: Callable[[], Any]) -> Callable[[], Any]:
    """A closure whose gradients and loss are the replicas' averages (for LBFGS and friends)."""

    def synchronized() -> Any:
        with torch.enable_grad():
            loss = closure()
        synchronizer.finalize()
        if isinstance(loss, torch.Tensor) and repl.num_replicas > 1:
            loss = repl.context.all_mean(loss.detach())
        return loss

    return synchronized


def _fail_together(stage: Any, agreement: Agreement, synchronizers: Callable[[], list[GradientSynchronizer]]) -> None:
    """Make a pipeline step that fails on one replica fail on every replica.

    A stage's failure reaches the other stages of its own replica; without this, the other
    replicas would wait in gradient averaging until the timeout. So the averaging that the
    step's last backward would end with waits until every replica has said how its step went.
    """
    from replicator.pipeline import PipelineError

    train_step = stage.train_step

    def train_step_everywhere(*args: Any, **kwargs: Any) -> Any:
        waiting = synchronizers()
        for synchronizer in waiting:
            synchronizer.defer_finalize = True
        try:
            loss = train_step(*args, **kwargs)
        except PipelineError as error:
            agreement.require_same(f"pipeline train_step failed: {error}"[:200])
            raise  # every replica failed alike: its own error says it best
        finally:
            for synchronizer in waiting:
                synchronizer.defer_finalize = False
        agreement.require_same("pipeline train_step succeeded")
        for synchronizer in waiting:
            synchronizer.finalize_deferred()
        return loss

    stage.train_step = train_step_everywhere


def _next_batch(iterator: Iterator[Any]) -> tuple[Any, bool, float]:
    started = time.perf_counter()
    try:
        batch = next(iterator)
        return batch, True, time.perf_counter() - started
    except StopIteration:
        return None, False, time.perf_counter() - started


def _check_output(output: Any, where: str = "the output") -> None:
    """step_fn may return tensors, numbers and (nested) dicts, lists and tuples of them."""
    if output is None or isinstance(output, (torch.Tensor, bool, int, float)):
        return
    if isinstance(output, dict):
        for key, value in output.items():
            _check_output(value, f"{where}[{key!r}]")
        return
    if isinstance(output, (list, tuple)):
        for index, value in enumerate(output):
            _check_output(value, f"{where}[{index}]")
        return
    raise ReplicatorUsageError(
        f"step_fn returned a {type(output).__name__} at {where}, which cannot be reduced across replicas; "
        "return tensors, numbers, or dicts/tuples/lists of them (for example ctx.all_mean(loss.detach()))"
    )


def _broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, source: int) -> None:
    """Overwrite every tensor with the source replica's, one message per dtype."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for kind in sorted(by_kind, key=str):
        members = by_kind[kind]
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=source, group=group)
        offset = 0
        with torch.no_grad():
            for tensor in members:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
