"""Wrapped optimizers and schedulers: averaged gradients, accumulation, no_sync, clipping, skipped updates."""

from __future__ import annotations

import contextlib
import math
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from replicator.comm.agreement import Agreement
from replicator.context import ReplicaContext
from replicator.errors import NonFiniteError, ReplicatorUsageError
from replicator.identity import require_same_layout
from replicator.nn.spectral import spectral_normed
from replicator.sync.fsdp import GradientSync, clip_shards_, is_sharded, shards_finite, take_sharded
from replicator.sync.reducers import Reducer
from replicator.sync.sharding import SHARDED, ShardedOptimizer, check_reducer
from replicator.sync.sparse import sparse_parameters
from replicator.sync.state import GradientState, UpdateCount
from replicator.sync.synchronizer import GradientSynchronizer
from replicator.timeline import recorder as timeline

if TYPE_CHECKING:
    from replicator.sync.precision import LossScale

__all__ = ["SyncedOptimizers", "WrappedOptimizer"]


@dataclass(eq=False)
class WrappedOptimizer:
    """One wrapped optimizer, its synchronizer and how far it got."""

    optimizer: torch.optim.Optimizer
    synchronizer: GradientSynchronizer
    count: UpdateCount
    known: int = 0  # parameters in its groups that the synchronizer knows of: a cheap check at each step
    sharded: ShardedOptimizer | None = None  # shard="optimizer" or "gradients": who steps it, on this replica's slices


class SyncedOptimizers:
    """The job's wrapped optimizers and schedulers, and the GradientState they share.

    `wrap()` patches an optimizer instance's `step` and `zero_grad` (its class, state_dict and
    hooks stay torch's) so that updates use the replicas' averaged gradients, happen once per
    `accumulation` micro-steps, and are skipped on every replica when nonfinite="skip" finds the
    averages NaN or infinite. Its `add_param_group` gives the new parameters replica 0's values
    through `adopt(tensors, where)` and has their gradients averaged too.
    """

    def __init__(self, *, context: ReplicaContext, group: dist.ProcessGroup | None, agreement: Agreement,
                 reducer: Reducer, bucket_cap_bytes: int, nonfinite: str, debug: bool, is_main: bool,
                 adopt: Callable[[list[torch.Tensor], str], None] = lambda tensors, where: None,
                 stages: dist.ProcessGroup | None = None, shard: str | None = None) -> None:
        self.state = GradientState()
        self.context = context
        self.group = group
        self.agreement = agreement
        self.reducer = reducer
        self.bucket_cap_bytes = bucket_cap_bytes
        self.nonfinite = nonfinite
        self.debug = debug
        self.is_main = is_main
        self.adopt = adopt
        self.shard = shard  # "optimizer", "gradients" or None (replicator.sync.sharding)
        if shard is not None and shard != "parameters":  # FSDP2 reduce-scatters ZeRO-3's gradients itself
            check_reducer(reducer, shard)
        if agreement.size > 1:  # replicas sharding differently would issue different collectives at every update
            agreement.require_same(f"rp.Replicator(shard={shard!r})", "rp.Replicator()")
        self.stages = stages  # a pipeline's stages (of this replica): every update's skip verdict is theirs together
        self.wrapped: list[WrappedOptimizer] = []
        self.owner: dict[int, WrappedOptimizer] = {}
        self.schedulers: list[Any] = []
        self.skipped_steps: list[int] = []  # steps whose update nonfinite="skip" or fp16's loss scale dropped
        # fp16 (replicator.sync.precision): judges every update's averaged gradients, and skips it where not finite.
        self.loss_scale: LossScale | None = None
        self._warned_spectral = False  # accumulation with spectral norm is said once
        self._no_sync_checked = False
        self.gradient_sync = GradientSync(self.state, self.wrapped, self.shards_parameters, stages is not None)
        # Who applies an update instead of the optimizer itself, given the optimizer's index (the
        # asynchronous regime: parameter servers); None: the optimizer's own step().
        self.update: Callable[[int, torch.optim.Optimizer], None] | None = None

    # -- wrapping ----------------------------------------------------------------------
    def wrap(self, optimizer: torch.optim.Optimizer, names: dict[int, str],
             built: dict[int, str] | None = None) -> torch.optim.Optimizer:
        """Synchronize `optimizer`'s gradients; `names` name its parameters in errors (a dict the scope keeps
        filling), `built` those of every tensor built so far, an open scope block's included."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"wrap_optimizer() takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if any(w.optimizer is optimizer for w in self.wrapped):
            raise ReplicatorUsageError("this optimizer is already wrapped; wrap each optimizer once")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for param in params:
            if id(param) in self.owner:
                raise ReplicatorUsageError(
                    f"parameter {names.get(id(param), tuple(param.shape))} belongs to two wrapped optimizers; "
                    "give each parameter to one optimizer (or use parameter groups)"
                )
        label = f"optimizer {len(self.wrapped)} ({type(optimizer).__name__})"
        # Before the reducer allocates its buckets (the shared-memory one agrees on each): replicas that built
        # different models would disagree on how many buckets there are, and meet the wrong peers' messages.
        require_same_layout(self.agreement, [((built or names).get(id(p), "a parameter"), p) for p in params],
                            f"when {label} was wrapped", _SAME_PARAMETERS)
        count = UpdateCount()
        # shard="parameters": FSDP2 averages the gradients (replicator.sync.fsdp); the synchronizer reduces none.
        synced = [] if self.shards_parameters else params
        synchronizer = GradientSynchronizer(synced, self.group, self.agreement, self.reducer, self.bucket_cap_bytes,
                                            names, label, self.state, count, self.context.on_wait, self.debug,
                                            self.shard)
        wrapped = WrappedOptimizer(optimizer, synchronizer, count, len(params))
        if self.shard == "gradients" and synchronizer.size > 1:  # the average is kept as slices from the first one
            synchronizer.keep_slice = lambda bucket, counts, summed: self._sharded(wrapped).keep_slice(  # type: ignore
                bucket, counts, summed)
            synchronizer.transport.slice_for = lambda bucket: self._sharded(wrapped).slice_for(bucket)  # type: ignore
            synchronizer.slices_finite = lambda: self._sharded(wrapped).slices_finite()  # type: ignore[union-attr]
        for param in params:
            self.owner[id(param)] = wrapped
        self.wrapped.append(wrapped)
        self._patch(wrapped)
        return optimizer

    @property
    def shards_parameters(self) -> bool:
        """shard="parameters" with several replicas: FSDP2 holds the parameters as shards and averages gradients."""
        return self.shard == "parameters" and self.context.num_replicas > 1

    def take_sharded(self, successors: dict[int, torch.nn.Parameter], roots: Iterable[torch.nn.Module] = ()) -> None:
        """shard="parameters", at the end of repl.scope(): the wrapped optimizers step the sharded parameters."""
        self.gradient_sync.add(roots)  # accumulate() and no_sync() reduce-scatter at an update's last backward only
        for wrapped in self.wrapped:
            if all(is_sharded(p) for group in wrapped.optimizer.param_groups for p in group["params"]):
                continue  # wrapped in an earlier block
            take_sharded(wrapped.optimizer, successors, wrapped.synchronizer.name_of)
            for group in wrapped.optimizer.param_groups:
                for param in group["params"]:
                    self.owner[id(param)] = wrapped

    def wrap_scheduler(self, scheduler: Any) -> Any:
        """Make an LR scheduler step only when its optimizer really stepped (accumulation)."""
        wrapped = next((w for w in self.wrapped if w.optimizer is scheduler.optimizer), None)
        if wrapped is None:
            raise ReplicatorUsageError("wrap the scheduler's optimizer with repl.wrap_optimizer() first")
        original = scheduler.step

        def step(_: Any, *args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs) if wrapped.count.stepped else None

        scheduler.step = types.MethodType(step, scheduler)
        self.schedulers.append(scheduler)
        return scheduler

    def _patch(self, wrapped: WrappedOptimizer) -> None:
        optimizer, synchronizer, count, state = wrapped.optimizer, wrapped.synchronizer, wrapped.count, self.state
        original_step = optimizer.step
        original_zero_grad = optimizer.zero_grad
        original_add_param_group = optimizer.add_param_group

        def step(_: Any, closure: Callable[[], Any] | None = None) -> Any:
            if sum(len(group["params"]) for group in optimizer.param_groups) != wrapped.known:
                self._check_groups(wrapped)
            if state.no_sync_depth:
                raise ReplicatorUsageError(
                    "optimizer.step() was called inside repl.no_sync(): gradients there are not synchronized, so "
                    "replicas would diverge; step after leaving no_sync()"
                )
            count.stepped = False
            if not state.last_micro_step(count):
                count.calls += 1
                return None
            try:  # the micro-step is counted after the update: the averaging divides by the micro-steps it holds
                with timeline.span("optimizer step", "optimizer", optimizer=synchronizer.label, step=state.step):
                    return updated(closure)
            finally:
                count.calls = 0  # the next micro-step starts an update (one an epoch's end closed early, too)

        def updated(closure: Callable[[], Any] | None) -> Any:
            if closure is None:
                synchronizer.finalize()
                self.gradient_sync.average(optimizer, state.micro_steps(count))  # shard="parameters": FSDP2 summed
                if (self.nonfinite == "skip" or self.loss_scale is not None) and not self._goes_ahead(wrapped):
                    return None
                if (sharded := self._sharded(wrapped)) is not None:
                    result = sharded.step()
                elif self.update is None:
                    result = original_step()
                else:
                    result = self.update(self.wrapped.index(wrapped), optimizer)
            else:
                if self.update is not None or self.shard is not None:
                    raise ReplicatorUsageError("an optimizer step with a closure (LBFGS) cannot run with mode='async' "
                                               "(parameter servers apply updates) or with shard= (a closure's "
                                               "line search needs the whole gradient on every replica)")
                if state.accumulation != 1 or self.loss_scale is not None:
                    raise ReplicatorUsageError(
                        "optimizers that take a closure (LBFGS) cannot be combined with accumulate() or "
                        "precision='fp16', whose loss scale needs one verdict per update (use 'bf16')")
                result = original_step(self._synchronized_closure(synchronizer, closure))
            synchronizer.end_window()
            count.stepped = True
            return result

        def zero_grad(_: Any, set_to_none: bool = True) -> None:
            if state.mid_accumulation(count):
                return  # in the middle of an accumulation: keep the partial sums
            synchronizer.end_window(discard=True)
            original_zero_grad(set_to_none)

        def add_param_group(_: Any, param_group: dict[str, Any]) -> None:
            if self.shard is not None:
                raise ReplicatorUsageError(f"add_param_group() after wrapping is not available with shard="
                                           f"{self.shard!r} yet; put every group in the optimizer before wrapping it")
            original_add_param_group(param_group)
            self._take_on_new_parameters(wrapped)

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
        optimizer.add_param_group = types.MethodType(add_param_group, optimizer)  # type: ignore[method-assign]
        if self.shard in ("optimizer", "gradients") and synchronizer.size > 1:  # checkpoints: the whole state
            SHARDED.add(optimizer)
            original_state_dict, original_load = optimizer.state_dict, optimizer.load_state_dict
            optimizer.state_dict = lambda: self._sharded(wrapped).state_dict(  # type: ignore[method-assign,union-attr]
                original_state_dict)
            optimizer.load_state_dict = lambda state_dict: self._sharded(  # type: ignore[method-assign,union-attr]
                wrapped).load_state_dict(state_dict, original_load)

    def _sharded(self, wrapped: WrappedOptimizer) -> ShardedOptimizer | None:
        """The optimizer's shard (shard= and several replicas), built when first needed: after repl.scope() ended,
        which may have moved the parameters to the device, and knowing the modules, whose sparse gradients no
        slice can be summed from (refused before the first update)."""
        if wrapped.sharded is not None or self.shard in (None, "parameters") or wrapped.synchronizer.size == 1:
            return wrapped.sharded
        synchronizer = wrapped.synchronizer
        sparse = set() if self.state.sparse_as_dense else sparse_parameters(self.state.modules)
        for param in synchronizer.params:
            if id(param) in sparse:
                raise ReplicatorUsageError(
                    f"shard={self.shard!r} cannot slice the sparse gradients of {synchronizer.name_of(param)} (an "
                    "Embedding with sparse=True): pass sparse_as_dense=True to rp.Replicator, build the embedding "
                    "with sparse=False, or drop shard=")
        assert self.group is not None
        wrapped.sharded = ShardedOptimizer(wrapped.optimizer, synchronizer, self.shard, self.group, self.context)
        return wrapped.sharded

    def _take_on_new_parameters(self, wrapped: WrappedOptimizer) -> None:
        """After add_param_group: copy replica 0's values of the new parameters, then synchronize their gradients.

        A classifier head swapped in for fine-tuning is built apart on each replica; without the
        copy its replicas would start apart, and without the buckets they would train apart.
        """
        params = [p for group in wrapped.optimizer.param_groups for p in group["params"]]
        new = [p for p in {id(p): p for p in params}.values() if id(p) not in self.owner]
        for param in params:
            if self.owner.get(id(param), wrapped) is not wrapped:
                raise ReplicatorUsageError(
                    f"parameter {wrapped.synchronizer.name_of(param)} belongs to two wrapped optimizers; "
                    "give each parameter to one optimizer (or use parameter groups)"
                )
        self.adopt(new, f"in {wrapped.synchronizer.label}.add_param_group()")
        wrapped.synchronizer.add_parameters(new)
        for param in new:
            self.owner[id(param)] = wrapped
        wrapped.known = len(params)

    def _check_groups(self, wrapped: WrappedOptimizer) -> None:
        """Refuse parameters put into param_groups by hand after wrapping: nobody copied or averaged them."""
        params = [p for group in wrapped.optimizer.param_groups for p in group["params"]]
        unknown = [wrapped.synchronizer.name_of(p) for p in params if self.owner.get(id(p)) is not wrapped]
        if not unknown:  # parameters were taken out: their buckets just stay empty
            wrapped.known = len(params)
            return
        raise ReplicatorUsageError(
            f"{', '.join(unknown)} joined {wrapped.synchronizer.label}'s param_groups after "
            f"repl.wrap_optimizer() without add_param_group() (raised on replica {self.context.replica_id}), so no "
            "replica copied replica 0's values or averages their gradients: the replicas would train apart. Add "
            "them with optimizer.add_param_group({'params': [...]}), which does both"
        )

    def _synchronized_closure(self, synchronizer: GradientSynchronizer,
                              closure: Callable[[], Any]) -> Callable[[], Any]:
        """A closure whose gradients and loss are the replicas' averages (for LBFGS and friends)."""

        def synchronized() -> Any:
            with torch.enable_grad():
                loss = closure()
            synchronizer.finalize()
            if isinstance(loss, torch.Tensor) and self.context.num_replicas > 1:
                loss = self.context.all_mean(loss.detach())
            return loss

        return synchronized

    def _goes_ahead(self, wrapped: WrappedOptimizer) -> bool:
        """Are the averaged gradients finite (fp16: on every stage, and noted for the loss scale)? Else skip."""
        finite = wrapped.synchronizer.gradients_finite()
        if self.shards_parameters:  # each replica judges its shards of the averages; the verdict is everyone's
            finite = shards_finite([p for g in wrapped.optimizer.param_groups for p in g["params"]], self.group)
        if self.stages is not None:
            # One process would skip the whole model's update: so do all stages, whichever held the NaN.
            device = wrapped.synchronizer.params[0].device if wrapped.synchronizer.params else "cpu"
            flag = torch.tensor(float(finite), device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.stages)
            finite = bool(flag)
        if self.loss_scale is not None:
            self.loss_scale.record(finite)
        if not finite:
            self._skip_update(wrapped, overflow=self.loss_scale is not None)
        return finite

    def _skip_update(self, wrapped: WrappedOptimizer, overflow: bool = False) -> None:
        """Drop this update on every replica: the averaged gradients, hence the verdict, are the same everywhere.

        An fp16 overflow (`overflow`) is the loss scale's business, as quiet as torch.amp.GradScaler's skips:
        repl.last_run lists them.
        """
        for group in wrapped.optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        wrapped.synchronizer.end_window()
        if self.state.step not in self.skipped_steps:
            self.skipped_steps.append(self.state.step)
        if self.is_main and not overflow:
            print(f"replicator: step {self.state.step}: the averaged gradients of {wrapped.synchronizer.label} are "
                  "NaN or infinite; its update was skipped on every replica (nonfinite='skip')", flush=True)

    def parameters(self) -> list[torch.Tensor]:
        """Every wrapped optimizer's parameters, in order."""
        return [p for w in self.wrapped for group in w.optimizer.param_groups for p in group["params"]]

    # -- accumulation ------------------------------------------------------------------
    def mid_accumulation(self) -> bool:
        """Is some optimizer between the micro-steps of one update?"""
        return any(self.state.mid_accumulation(w.count) for w in self.wrapped)

    def refuse_mid_accumulation(self, what: str) -> None:
        """Raise if some optimizer is part way through an update: `what` (a save) needs an update's boundary."""
        n = self.state.accumulation
        taken = max((w.count.calls % n for w in self.wrapped), default=0)
        if not taken:
            return
        if self.state.epoch_end == "flush":
            fix = f"Call it between updates: at an epoch's end, or a multiple of {n} steps into an epoch"
        else:
            fix = (f"An epoch's end does not end an update here: repl.accumulate({n}) carries a partial one into the "
                   "next epoch, where Accelerate's accumulate() updates on it at the end of the dataloader. Call it "
                   f"where global_step is a multiple of {n}, give each epoch a multiple of {n} batches, or pass "
                   f"repl.accumulate({n}, epoch_end=\"flush\") to update on the partial window when an epoch ends")
        raise ReplicatorUsageError(
            f"{what} was called at step {self.state.step}, in the middle of an accumulation: {taken} of the {n} "
            f"micro-steps of the next update are summed in the gradients, which a checkpoint does not hold. {fix}")

    def accumulate(self, micro_steps: int, epoch_end: str = "carry") -> None:
        """Make each update take `micro_steps` step_fn calls (see Replicator.accumulate)."""
        if self.mid_accumulation():
            raise ReplicatorUsageError("accumulate() can only change between updates, not in the middle of one")
        self.gradient_sync.refuse_in_pipeline(f"accumulate({micro_steps})") if micro_steps > 1 else None
        self.state.set_accumulation(micro_steps, epoch_end)
        for wrapped in self.wrapped:
            wrapped.count.calls = 0
        if micro_steps > 1:
            self._warn_if_spectral_normed(f"accumulate({micro_steps})", f"{micro_steps} times")

    def _warn_if_spectral_normed(self, how: str, times: str) -> None:
        """Gradient accumulation runs spectral norm's power iteration once per micro-batch: say so, once."""
        normed = [] if self._warned_spectral else spectral_normed(self.state.modules)
        if normed:
            self._warned_spectral = True
            if self.is_main:
                warnings.warn(
                    f"{how} with spectral-normed modules ({', '.join(normed[:3])}{' ...' if len(normed) > 3 else ''}):"
                    f" their power iteration runs in every micro-batch's forward, {times} per update, where one "
                    "process training on the whole batch runs it once. Replicas stay equal, but this is not the "
                    "large-batch algorithm (BigGAN-PyTorch's caveat): reach the batch with more replicas instead, "
                    "or accept the difference.", stacklevel=4)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients locally, with no traffic."""
        self.gradient_sync.refuse_in_pipeline("no_sync()")
        if not self._no_sync_checked:  # once: a walk over the modules for every micro-batch would cost
            self._no_sync_checked = True
            self._warn_if_spectral_normed("no_sync() accumulation", "once per micro-batch")
        self.state.no_sync_depth += 1
        self.gradient_sync.update()
        try:
            yield
        finally:
            self.state.no_sync_depth -= 1
            self.gradient_sync.update()

    def restart_counts(self) -> None:
        """Forget micro-steps taken (after restoring a checkpoint, which falls between updates)."""
        for wrapped in self.wrapped:
            wrapped.count.calls, wrapped.count.stepped = 0, False

    # -- between backward and step -----------------------------------------------------
    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                        shards: dist.ProcessGroup | None = None) -> torch.Tensor | None:
        """Clip by the global norm of the averaged gradients; None during an accumulation micro-step.

        With `shards` (a pipeline's stage group, every member calling) the parameters are this
        process's share of a model split over the group, and the norm is the whole model's.
        """
        params = list(parameters)
        owners = list({id(w): w for p in params if (w := self.owner.get(id(p)))}.values())
        if not all(self.state.last_micro_step(w.count) for w in owners or self.wrapped):
            return None
        for wrapped in owners:
            wrapped.synchronizer.finalize()
        slices = [w.sharded for w in owners if (w.sharded or self._sharded(w)) and self.shard == "gradients"]
        if slices:  # .grad is None: the average exists as slices, whose squares are summed across replicas
            if len(slices) != len(owners) or len(slices) > 1:
                raise ReplicatorUsageError("with shard='gradients', clip the parameters of one wrapped optimizer at a "
                                           "time: call repl.clip_grad_norm_ once per optimizer")
            norm = slices[0].clip_(params, max_norm, norm_type, shards)  # type: ignore[union-attr]
            return self._check_norm(norm)
        if self.shards_parameters:  # the norm of the averages from every replica's shards of them (one all-reduce)
            return self._check_norm(clip_shards_(params, max_norm, norm_type, shards))
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type).to(params[0].device if params else "cpu")
        if shards is not None:
            norm = _norm_of_shards(norm, norm_type, shards)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return self._check_norm(norm)

    def _check_norm(self, norm: torch.Tensor) -> torch.Tensor:
        # The norm of averaged gradients is the same on every replica: so is this verdict. Under fp16 an
        # overflow is the loss scale's to handle: step() skips the update and lowers the scale.
        if self.nonfinite == "raise" and self.loss_scale is None and not bool(torch.isfinite(norm)):
            raise NonFiniteError(
                f"the averaged gradients' norm is {float(norm)} at step {self.state.step} (raised on replica "
                f"{self.context.replica_id}); some replica's loss or gradient overflowed or became NaN. Lower the "
                "learning rate, check the data, or pass nonfinite='skip' to drop such updates on every replica"
            )
        return norm

    @contextlib.contextmanager
    def hold_gradients(self) -> Iterator[None]:
        """Inside this block the averaging that ends a backward pass waits for `release_gradients()`."""
        for wrapped in self.wrapped:
            wrapped.synchronizer.defer_finalize = True
        try:
            yield
        finally:
            for wrapped in self.wrapped:
                wrapped.synchronizer.defer_finalize = False

    def release_gradients(self) -> None:
        """Finish the averaging that a backward pass inside `hold_gradients()` left waiting."""
        for wrapped in self.wrapped:
            wrapped.synchronizer.finalize_deferred()

    def abandon_gradients(self) -> None:
        """Drop the averaging a failed pipeline step left pending, alike on every replica (all call it)."""
        for wrapped in self.wrapped:
            wrapped.synchronizer.abandon()

    def reopen_reduced(self, factor: float) -> None:
        """A backward pass starts: gradients already averaged in this window go back to the loss scale's units."""
        for wrapped in self.wrapped:
            wrapped.synchronizer.reopen(factor)

    def finalize_completed(self) -> None:
        """Average now the gradients of every optimizer whose update this backward pass completed (one replica: as
        the replicas' averaging does at the end of backward, so code before step() sees the final gradients)."""
        for wrapped in self.wrapped:
            if self.state.completes_update(wrapped.count):
                wrapped.synchronizer.finalize()

    def set_on_wait(self, on_wait: Callable[[float], None]) -> None:
        """Report seconds blocked in gradient reductions to `on_wait` (the run's step timing)."""
        for wrapped in self.wrapped:
            wrapped.synchronizer.on_wait = on_wait

    def close(self) -> None:
        """Remove the gradient hooks."""
        for wrapped in self.wrapped:
            wrapped.synchronizer.remove()


def _norm_of_shards(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """The norm of a vector split over `group`, from each process's `norm` of its piece."""
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.to(torch.float64) ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)


_SAME_PARAMETERS = (
    "Every replica must build the same model and give each optimizer the same parameters in the same order: look "
    "for a size, a layer or an option that depends on the replica or on data only one replica reads."
)
