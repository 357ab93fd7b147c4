"""GradientSynchronizer: averages gradients across replicas, overlapping the backward pass.

Each parameter's post-accumulate-grad hook copies its gradient into its bucket; a complete
bucket's reduction is launched at once, asynchronously, while backward carries on with
earlier layers. Buckets are launched strictly in index order, on every replica, once per
round: that is what keeps the sequence of collectives identical across replicas even when
some parameters get no gradient on some replicas. `finalize()` launches what is left, waits,
and makes every `.grad` the average. It runs at the end of the backward pass that
synchronizes, as DDP's does, so that code between `backward()` and `step()`
(`torch.nn.utils.clip_grad_norm_`, logging a gradient norm) sees what one process would see.

A backward pass outside run()'s step_fn may stay local (`GradientState.communicates`): one
replica's evaluation or saliency pass then waits for no partner, and `step()` averages what
such passes accumulated, like any gradient no backward pass reached. Sparse gradients of
sparse embeddings travel as indices and values (`replicator.sync.sparse`); a gradient with
a graph (`create_graph=True`) comes back as the average, differentiable through this
replica's share.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Variable

from replicator.comm.agreement import Agreement, PendingAgreement, call_site, raise_with_stragglers
from replicator.comm.heartbeat import waiting
from replicator.errors import ReplicatorUsageError
from replicator.health import all_finite
from replicator.sync.bucket import Bucket, Reducer, assign_buckets
from replicator.sync.sparse import sparse_parameters, sum_sparse
from replicator.sync.state import GradientState, UpdateCount
from replicator.sync.transport import SlicedTransport
from replicator.timeline import recorder as timeline

__all__ = ["GradientSynchronizer"]

_FIRST_BUCKET_BYTES = 1 << 20
_SKIPPED_DIRS = tuple(os.path.dirname(module.__file__ or "") + os.sep
                      for module in (sys.modules["replicator"], torch))


def _backward_site() -> str:
    """'file.py:42 in step_fn' for the innermost frame outside replicator and torch: where backward() was called."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_DIRS):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"  # the autograd engine's own thread (a GPU backward)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class GradientSynchronizer:
    """Keeps the gradients of one optimizer's parameters identical across replicas.

    A *window* runs from one `zero_grad`/`step` to the next; within it every bucket is
    reduced at least once, in order. A gradient that arrives for a bucket already reduced
    in this window (a second backward before `step`) starts a new round that reduces the
    full accumulated gradients again: correct, at the price of the extra traffic.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: dist.ProcessGroup | None,
        agreement: Agreement,
        reducer: Reducer,
        bucket_cap_bytes: int,
        names: dict[int, str],
        label: str,
        state: GradientState,
        count: UpdateCount,
        on_wait: Callable[[float], None] = lambda seconds: None,
        debug: bool = False,
        shard: str | None = None,
    ) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.agreement = agreement
        self.reducer = reducer
        self.names = names
        self.label = label
        self.state = state  # shared by every optimizer: accumulation and no_sync
        self.count = count  # this optimizer's step() calls
        self.on_wait = on_wait
        self.debug = debug
        # shard="gradients" (replicator.sync.sharding): .grad is freed as its bucket takes it, and each bucket, once
        # averaged, hands this replica's slice to keep_slice(bucket, presence counts, summed) and is released; its
        # travel (lent rows, the slice summed where it stays) is replicator.sync.transport's.
        self.releases = shard == "gradients" and self.size > 1
        # keep_slice(bucket, presence counts, the slice its scatter summed into, or None: take it from the buffer).
        self.keep_slice: Callable[[Bucket, list[float] | None, torch.Tensor | None], None] | None = None
        self.slices_finite: Callable[[], bool] | None = None
        unique = list({id(p): p for p in params}.values())
        self.params = [p for p in unique if p.requires_grad]
        self.frozen = [p for p in unique if not p.requires_grad]
        self.buckets: list[Bucket] = []
        self.bucket_cap_bytes = bucket_cap_bytes
        self._location: dict[int, tuple[Bucket, int]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._reopen_hooks: list[torch.utils.hooks.RemovableHandle] = []  # armed after an accumulated average
        if self.size > 1:
            # Released buckets are plain tensors: a reducer's shared mappings would outlive the release.
            allocate = None if self.releases else getattr(reducer, "allocate", None)
            self.buckets = assign_buckets(self.params, bucket_cap_bytes, min(_FIRST_BUCKET_BYTES, bucket_cap_bytes),
                                          allocate)
            for bucket in self.buckets:
                for position, param in enumerate(bucket.params):
                    self._location[id(param)] = (bucket, position)
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]
        self.transport = SlicedTransport(self.buckets, reducer) if self.releases else None
        if state.count_samples is not None:  # weighted: a micro-step's gradients enter with its samples' weight
            self._hooks += [p.register_hook(self._weigh) for p in self.params]
        self._next_bucket = 0
        self._window_open = False
        self._windows = 0
        self._rounds = 0  # rounds of the open window
        self._reduced = False
        self._update_start = state.step  # the step at which the current update began (for weighting)
        self._local_pass: int | None = None  # the latest backward pass that stayed local
        self._sparse_from: tuple[int, bool] | None = None  # (modules, sparse_as_dense) `gathered` was set for
        self._agreement_in_flight: PendingAgreement | None = None
        self._finalize_pass: int | None = None  # the backward pass that will end by finalizing
        # Set while a pipeline step runs: its replicas first agree that the step succeeded.
        self.defer_finalize = False

    def add_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Synchronize parameters that joined the optimizer after wrapping (between updates), in buckets of their own.

        Appended after the others, so the buckets' order, hence the sequence of collectives,
        stays the same on every replica that added the same parameters.
        """
        known = {id(p) for p in [*self.params, *self.frozen]}
        new = [p for p in {id(p): p for p in params}.values() if id(p) not in known]
        trainable = [p for p in new if p.requires_grad]
        self.params += trainable
        self.frozen += [p for p in new if not p.requires_grad]
        if self.size == 1 or not trainable:
            return
        for bucket in assign_buckets(trainable, self.bucket_cap_bytes, self.bucket_cap_bytes,
                                     getattr(self.reducer, "allocate", None)):
            bucket.index = len(self.buckets)
            self.buckets.append(bucket)
            for position, param in enumerate(bucket.params):
                self._location[id(param)] = (bucket, position)
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_gradient) for p in trainable]

    def name_of(self, param: torch.nn.Parameter) -> str:
        return self.names.get(id(param), f"<parameter of shape {tuple(param.shape)}>")

    # -- during backward -------------------------------------------------------------
    def _weigh(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A micro-step's gradient times its samples over the update's first micro-step's (uneven accumulation)."""
        samples = self.state.samples_since(self._update_start)
        if len(samples) < 2 or samples[-1][0] == samples[0][0] or not samples[0][0]:
            return None
        return grad * (samples[-1][0] / samples[0][0])

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        if not self.state.completes_update(self.count):
            return
        backward_pass = torch._C._current_graph_task_id()
        if backward_pass != self._finalize_pass:
            if backward_pass == self._local_pass or not self.state.communicates():
                self._stay_local(backward_pass)
                return
            self._gather_sparse_of_known_modules()
            # Runs when this backward pass ends, in the thread that ran it; its errors come out
            # of backward(). (The autograd engine's final callbacks: what DDP and FSDP use.)
            # Keyed by the pass, so that one that raised before its end leaves nothing stale.
            # A reentrant checkpoint segment is a pass of its own: it finalizes too, early but
            # correctly (what arrives later starts a new round), at the price of the traffic.
            self._finalize_pass = backward_pass
            if not self.defer_finalize:
                Variable._execution_engine.queue_callback(self._finalize_after_backward)
        bucket, position = self._location[id(param)]
        if bucket.launched or position in bucket.ready or self._reduced:
            # A second gradient in this window: finish this round, then reduce afresh.
            self._refuse_second_round()
            self._finish_round()
            self._start_round()
        self._ensure_buffer(bucket)
        bucket.load(position, self._scale())
        if self.releases:  # its bucket holds it now: the full-size gradient need not outlive the backward pass
            param.grad = None
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].complete:
            self._launch(self.buckets[self._next_bucket])

    def _stay_local(self, backward_pass: int) -> None:
        if backward_pass != self._local_pass and self._reduced:
            raise ReplicatorUsageError(
                f"a backward pass at {_backward_site()} on replica {self.agreement.rank} stayed local (it ran outside "
                f"run()'s step_fn {'between steps' if self.state.in_run else 'in eval mode'}) but added into "
                f"gradients of {self.label} already averaged for the next optimizer.step(): the replicas would step "
                "apart. Call optimizer.zero_grad() before it, or run it inside step_fn on every replica"
            )
        self._local_pass = backward_pass

    def _launch(self, bucket: Bucket) -> None:
        # The buffer must be complete, presence slots included, before the round's check
        # starts: a reducer may take that check's completion as proof that every row is loaded.
        bucket.write_presence()
        if self._next_bucket == 0:  # the first launch of a round
            if not self._window_open:
                self._window_open = True
                self._windows += 1
            self._rounds += 1
            # Every round is agreed, and names its step, so a backward pass that only some replicas
            # run (a saliency pass on replica 0 inside step_fn) fails on all of them, naming where
            # it was called. Checked without blocking: the verdict is awaited before the buckets are.
            what = f"gradient sync of {self.label}, step {self.state.step}, update {self._windows}"
            what += f", backward pass {self._rounds} of the update" if self._rounds > 1 else ""
            self._agreement_in_flight = self.agreement.start(what, _backward_site())
            bucket.arrival = self._agreement_in_flight
        if self.debug:
            started = time.perf_counter()
            what = f"gradient bucket {bucket.index} of {self.label}, {bucket.buffer.numel()} elements"
            self.agreement.require_same(what, call_site())
            self.on_wait(time.perf_counter() - started)
        bucket.launched = True
        recording = timeline.active()
        launched = timeline.clock() if recording is not None else 0.0
        # shard="gradients" keeps only this replica's slice: a reducer that can stop after its scatter does.
        pending = self.transport.start(bucket, self.group) if self.transport is not None else None
        bucket.pending = pending or self.reducer.reduce(bucket.buffer, self.group, bucket)  # type: ignore[arg-type]
        if recording is not None:  # from launch to completion, on a track of its own: buckets overlap
            bucket.in_flight = timeline.InFlight(
                recording, f"bucket {bucket.index}", "communication", launched, bucket.pending, timeline.BUCKETS,
                {"bucket": bucket.index, "optimizer": self.label, "step": self.state.step, "round": self._rounds,
                 "bytes": bucket.numel * bucket.buffer.element_size(), "reducer": getattr(self.reducer, "name", "")})
        self._next_bucket = bucket.index + 1
        if self.releases and bucket.index > 0:
            # Few full buckets alive at once: the previous one's average is kept as a slice while this one travels.
            self._settle(self.buckets[bucket.index - 1])

    def _finish_round(self) -> None:
        """Launch every bucket not yet launched this round, in order, with what it has; wait for them all."""
        for bucket in self.buckets[self._next_bucket :]:
            self._ensure_buffer(bucket)
            for position in range(len(bucket.params)):
                if position not in bucket.ready:
                    bucket.load(position, self._scale())
            self._launch(bucket)
        self._wait_all()

    def _ensure_buffer(self, bucket: Bucket) -> None:  # shard="gradients": in a row the reducer lends, where it can
        self.transport.ensure_buffer(bucket) if self.transport is not None else bucket.ensure_buffer()

    def _start_round(self) -> None:
        """Empty buckets, none launched, nothing reduced: the next gradient starts a new round."""
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0
        self._reduced = False

    def __str__(self) -> str:
        """How a heartbeat names this synchronizer's wait for the replicas' gradients."""
        return f"the gradient sync of {self.label}, step {self.state.step}"

    def _wait_all(self) -> None:
        with timeline.span("gradient wait", "communication", optimizer=self.label), waiting(self):
            self._wait_for_buckets()

    def _wait_for_buckets(self) -> None:
        started = time.perf_counter()
        for bucket in self.buckets:
            self._wait_for(bucket)
        self.on_wait(time.perf_counter() - started)

    def _wait_for(self, bucket: Bucket) -> None:
        if self._agreement_in_flight is not None:  # first: its error names what a bucket's failure only follows from
            in_flight, self._agreement_in_flight = self._agreement_in_flight, None
            in_flight.wait()
        if bucket.pending is not None:
            try:
                bucket.pending.wait()
            except RuntimeError as error:
                where = f"gradient bucket {bucket.index} of {self.label}"
                raise_with_stragglers(self.agreement.group, where, error, debug=self.debug)
            if bucket.in_flight is not None:
                bucket.in_flight.close(bucket.pending)
                bucket.in_flight = None
            bucket.pending = None

    def _settle(self, bucket: Bucket) -> None:
        """shard="gradients": once `bucket` is averaged, keep this replica's slice of it and release the buffer."""
        if not bucket.views:
            return  # settled already
        started = time.perf_counter()
        self._wait_for(bucket)
        self.on_wait(time.perf_counter() - started)
        assert self.keep_slice is not None and self.transport is not None
        counts = None if all(bucket.flags) else bucket.presence().tolist()
        self.keep_slice(bucket, counts, self.transport.settle(bucket))
        bucket.release_buffer()

    # -- at step ---------------------------------------------------------------------
    def _scale(self) -> float:
        """What this replica's gradients are multiplied by, so that their sum over replicas is the average.

        Weighted (uneven batches): this replica's samples of the update's first micro-step over
        all samples of the update; `_weigh` already scaled later micro-steps relative to the first.
        Divided by `grad_scale` too: fp16's loss scale comes out here, in the same pass.
        """
        samples = self.state.samples_since(self._update_start)
        if not samples or not samples[0][0]:  # an empty batch on one replica: its loss is NaN anyway
            return 1.0 / (self.size * self.state.micro_steps(self.count) * self.state.grad_scale)
        return samples[0][0] / (sum(everyone for _, everyone in samples) * self.state.grad_scale)

    def _gather_sparse_of_known_modules(self) -> None:
        """Mark the parameters whose sparse gradients are gathered: sparse embeddings built in repl.scope()."""
        seen = (len(self.state.modules), self.state.sparse_as_dense)
        if seen == self._sparse_from or self.size == 1:
            return
        self._sparse_from = seen
        gathered = set() if self.state.sparse_as_dense else sparse_parameters(self.state.modules)
        for bucket in self.buckets:
            bucket.gathered = {position for position, param in enumerate(bucket.params) if id(param) in gathered}

    def finalize(self) -> None:
        """Make every gradient the replicas' average, over the accumulated micro-steps too.
        Idempotent within a window."""
        if self._reduced:
            return
        for param in self.frozen:
            if param.grad is not None:
                raise ReplicatorUsageError(
                    f"parameter {self.name_of(param)} was frozen (requires_grad=False) when the optimizer was "
                    "wrapped but now has a gradient that nobody synchronizes; set requires_grad before "
                    "repl.wrap_optimizer(...)"
                )
        if self.size == 1:
            grads = [p.grad for p in self.params if p.grad is not None]
            scale = self._scale()  # 1 / micro-steps unless micro-steps are weighted by unequal samples
            micro_steps = self.state.micro_steps(self.count)
            if grads and scale != 1.0 / micro_steps:
                torch._foreach_mul_(grads, scale)
            elif grads and micro_steps != 1:
                torch._foreach_div_(grads, float(micro_steps))
            self._reduced = True
            return
        self._gather_sparse_of_known_modules()
        self._finish_round()
        if self.releases:  # shard="gradients": only this replica's slices of the average stay
            for bucket in self.buckets:
                self._settle(bucket)
            for param in self.params:
                param.grad = None
            self._reduced = True
            return
        sparse = self._sum_sparse()
        for bucket in self.buckets:
            # Counts are read back only where this replica had no gradient of its own.
            counts = None if all(bucket.flags) else bucket.presence().tolist()
            for position, param in enumerate(bucket.params):
                # .grad becomes a view of the reduced bucket: no copy back (DDP's
                # gradient_as_bucket_view); load() unties it if it is still there next step.
                no_replica_had_one = counts is not None and counts[position] == 0
                param.grad = None if no_replica_had_one else bucket.views[position]
                if position in bucket.graphs:
                    # The average's value, with the derivative of this replica's own share: a second
                    # backward through it (a gradient penalty) adds this replica's part, which the
                    # next round averages, as one process would differentiate the average.
                    local = bucket.graphs[position]
                    param.grad = bucket.views[position] + (local - local.detach())
                summed = sparse.get(id(param))
                if summed is not None:  # dense where some replica's gradient was dense (a tied weight)
                    param.grad = summed if param.grad is None else param.grad.add_(summed)
        self._reduced = True
        if self.state.accumulation > 1:
            self._arm_reopen()

    def _arm_reopen(self) -> None:
        """Averages of accumulated micro-steps are divided by their number: a further backward pass before step()
        (a second loss of the last micro-step) must add to them in the units the next round divides again. A
        hook on each gradient, before it accumulates, takes the averages back to those units first (one process
        adds the second loss's gradient to its sum; the replicas would otherwise end with the first loss's mean
        divided by the micro-steps twice)."""
        if not self._reopen_hooks:
            self._reopen_hooks = [p.register_hook(self._reopen_before_accumulating) for p in self.params]

    def _disarm_reopen(self) -> None:
        for hook in self._reopen_hooks:
            hook.remove()
        self._reopen_hooks.clear()

    def _reopen_before_accumulating(self, grad: torch.Tensor) -> None:
        self._disarm_reopen()
        if self._reduced:
            self.reopen(self._local_units())

    def _local_units(self) -> float:
        """What averaged gradients are multiplied by so that the next round, which multiplies each replica's share
        by `_scale()`, sums them back to themselves: the inverse of `_scale()` summed over the replicas."""
        samples = self.state.samples_since(self._update_start)
        if not samples or not samples[0][0] or not samples[0][1]:
            return self.state.micro_steps(self.count) * self.state.grad_scale
        return self.state.grad_scale * sum(everyone for _, everyone in samples) / samples[0][1]

    def _sum_sparse(self) -> dict[int, torch.Tensor]:
        """The sums of the gathered sparse gradients, by parameter id (none where no replica had one)."""
        positions = [(bucket, position) for bucket in self.buckets for position in sorted(bucket.gathered)]
        if not positions or self.group is None:
            return {}
        try:
            summed = sum_sparse([bucket.sparse.get(position) for bucket, position in positions],
                                [bucket.params[position] for bucket, position in positions], self.group)
        except RuntimeError as error:
            raise_with_stragglers(self.agreement.group, f"sparse gradients of {self.label}", error)
        return {id(bucket.params[position]): total
                for (bucket, position), total in zip(positions, summed) if total is not None}

    def _finalize_after_backward(self) -> None:
        self._finalize_pass = None
        self.finalize()

    def finalize_deferred(self) -> None:
        """Finalize now if a backward pass synchronized while `defer_finalize` was set."""
        if self._finalize_pass is not None:
            self._finalize_after_backward()

    def gradients_finite(self) -> bool:
        """After finalize(): are all averaged gradients finite? The same answer on every replica."""
        if self.slices_finite is not None:
            return self.slices_finite()
        if self.size > 1:
            sparse = [p.grad._values() for p in self.params if p.grad is not None and p.grad.is_sparse]
            return all_finite([*(bucket.buffer[: bucket.numel] for bucket in self.buckets), *sparse])
        return all_finite(p.grad._values() if p.grad.is_sparse else p.grad for p in self.params if p.grad is not None)

    def reopen(self, factor: float) -> None:
        """A backward pass starts in a window already averaged: scale the averages by `factor` (fp16's, see
        GradientState.grad_scale) and reduce afresh, so that they add up with the new pass's scaled gradients."""
        if not self._reduced:
            return
        self._refuse_second_round()
        with torch.no_grad():
            for param in self.params:
                if param.grad is not None:
                    param.grad.mul_(factor)  # in place: a view of its bucket, which the next round reloads
        self._start_round()

    def _refuse_second_round(self) -> None:
        """shard="gradients" keeps no full gradient to reduce again: a second round in one update cannot be done."""
        if self.releases:
            raise ReplicatorUsageError(
                f"a second backward pass added gradients to {self.label} after they were reduced in this update (at "
                f"{_backward_site()}, replica {self.agreement.rank}); with shard='gradients' each replica keeps only "
                "its slice of the average, so there is nothing to add them to. Sum the losses into one backward(), "
                "accumulate with repl.accumulate(n) or no_sync(), or use shard='optimizer'")

    def end_window(self, discard: bool = False) -> None:
        """Close the window after `step` (or `zero_grad`, which discards its reductions).

        A window that launched anything is completed first, so that every replica issues
        the same collectives whether or not its own backward reached every bucket.
        """
        if discard and self._window_open:
            self._finish_round()
        self._disarm_reopen()
        self._start_round()
        if self.transport is not None:
            for bucket in self.buckets:
                bucket.release_buffer()
            self.transport.reset()
        self._window_open = False
        self._rounds = 0
        self._finalize_pass = None  # one that raised before its end never ran its callback
        # The next update starts with this step (zero_grad) or the next one (step).
        self._update_start = self.state.step + (0 if discard or not self.state.in_step else 1)

    def abandon(self) -> None:
        """Close a window that a failed step left in any state; every replica calls it at the same point.

        One replica may have launched buckets (its backward ran) while another launched none
        (it failed first): each launches the rest of the round, in order, so that all issue
        the same collectives and none is left pending into the next step. `.grad` stays local.
        """
        if self.size > 1:
            self._finish_round()
        self.end_window()

    def remove(self) -> None:
        self._disarm_reopen()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
