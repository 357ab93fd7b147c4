"""GradientSynchronizer: averages gradients across replicas, overlapping the backward pass.

Each parameter's post-accumulate-grad hook copies its gradient into its bucket; a complete
bucket's reduction is launched at once, asynchronously, while backward carries on with
earlier layers. Buckets are launched strictly in index order, on every replica, once per
round: that is what keeps the sequence of collectives identical across replicas even when
some parameters get no gradient on some replicas. `finalize()` launches what is left, waits,
and makes every `.grad` the average. It runs at the end of the backward pass that
synchronizes, as DDP's does, so that code between `backward()` and `step()`
(`torch.nn.utils.clip_grad_norm_`, logging a gradient norm) sees what one process would see.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Variable

from replicator.comm.agreement import Agreement, PendingAgreement, call_site, raise_with_stragglers
from replicator.errors import ReplicatorUsageError
from replicator.health import finite_sum
from replicator.sync.bucket import Bucket, Reducer, assign_buckets
from replicator.sync.state import GradientState, UpdateCount

__all__ = ["GradientSynchronizer"]

_FIRST_BUCKET_BYTES = 1 << 20


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
        unique = list({id(p): p for p in params}.values())
        self.params = [p for p in unique if p.requires_grad]
        self.frozen = [p for p in unique if not p.requires_grad]
        self.buckets: list[Bucket] = []
        self._location: dict[int, tuple[Bucket, int]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if self.size > 1:
            self.buckets = assign_buckets(self.params, bucket_cap_bytes, min(_FIRST_BUCKET_BYTES, bucket_cap_bytes),
                                          getattr(reducer, "allocate", None))
            for bucket in self.buckets:
                for position, param in enumerate(bucket.params):
                    self._location[id(param)] = (bucket, position)
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]
        self._next_bucket = 0
        self._window_open = False
        self._windows = 0
        self._reduced = False
        self._agreement_in_flight: PendingAgreement | None = None
        self._finalize_pass: int | None = None  # the backward pass that will end by finalizing
        # Set while a pipeline step runs: its replicas first agree that the step succeeded.
        self.defer_finalize = False

    def name_of(self, param: torch.nn.Parameter) -> str:
        return self.names.get(id(param), f"<parameter of shape {tuple(param.shape)}>")

    # -- during backward -------------------------------------------------------------
    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        if not self.state.completes_update(self.count):
            return
        backward_pass = torch._C._current_graph_task_id()
        if backward_pass != self._finalize_pass:
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
            self._finish_round()
            self._start_round()
        bucket.load(position, self._scale())
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].complete:
            self._launch(self.buckets[self._next_bucket])

    def _launch(self, bucket: Bucket) -> None:
        # The buffer must be complete, presence slots included, before the window's check
        # starts: a reducer may take that check's completion as proof that every row is loaded.
        bucket.write_presence()
        if not self._window_open:
            self._window_open = True
            self._windows += 1
            # Checked without blocking: the verdict is awaited before the buckets are.
            self._agreement_in_flight = self.agreement.start(f"gradient sync of {self.label}, window {self._windows}")
            bucket.arrival = self._agreement_in_flight
        if self.debug:
            started = time.perf_counter()
            what = f"gradient bucket {bucket.index} of {self.label}, {bucket.buffer.numel()} elements"
            self.agreement.require_same(what, call_site())
            self.on_wait(time.perf_counter() - started)
        bucket.launched = True
        bucket.pending = self.reducer.reduce(bucket.buffer, self.group, bucket)  # type: ignore[arg-type]
        self._next_bucket = bucket.index + 1

    def _finish_round(self) -> None:
        """Launch every bucket not yet launched this round, in order, with what it has; wait for them all."""
        for bucket in self.buckets[self._next_bucket :]:
            for position in range(len(bucket.params)):
                if position not in bucket.ready:
                    bucket.load(position, self._scale())
            self._launch(bucket)
        self._wait_all()

    def _start_round(self) -> None:
        """Empty buckets, none launched, nothing reduced: the next gradient starts a new round."""
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0
        self._reduced = False

    def _wait_all(self) -> None:
        started = time.perf_counter()
        if self._agreement_in_flight is not None:
            in_flight, self._agreement_in_flight = self._agreement_in_flight, None
            in_flight.wait()
        for bucket in self.buckets:
            if bucket.pending is not None:
                try:
                    bucket.pending.wait()
                except RuntimeError as error:
                    where = f"gradient bucket {bucket.index} of {self.label}"
                    raise_with_stragglers(self.agreement.group, where, error, debug=self.debug)
                bucket.pending = None
        self.on_wait(time.perf_counter() - started)

    # -- at step ---------------------------------------------------------------------
    def _scale(self) -> float:
        return 1.0 / (self.size * self.state.accumulation)

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
            if self.state.accumulation != 1:
                grads = [p.grad for p in self.params if p.grad is not None]
                if grads:
                    torch._foreach_div_(grads, float(self.state.accumulation))
            self._reduced = True
            return
        self._finish_round()
        for bucket in self.buckets:
            # Counts are read back only where this replica had no gradient of its own.
            counts = None if all(bucket.flags) else bucket.presence().tolist()
            for position, param in enumerate(bucket.params):
                # .grad becomes a view of the reduced bucket: no copy back (DDP's
                # gradient_as_bucket_view); load() unties it if it is still there next step.
                no_replica_had_one = counts is not None and counts[position] == 0
                param.grad = None if no_replica_had_one else bucket.views[position]
        self._reduced = True

    def _finalize_after_backward(self) -> None:
        self._finalize_pass = None
        self.finalize()

    def finalize_deferred(self) -> None:
        """Finalize now if a backward pass synchronized while `defer_finalize` was set."""
        if self._finalize_pass is not None:
            self._finalize_after_backward()

    def gradients_finite(self) -> bool:
        """After finalize(): are all averaged gradients finite? The same answer on every replica."""
        if self.size > 1:
            return finite_sum(bucket.buffer[: bucket.numel] for bucket in self.buckets)
        return finite_sum(p.grad for p in self.params if p.grad is not None)

    def end_window(self, discard: bool = False) -> None:
        """Close the window after `step` (or `zero_grad`, which discards its reductions).

        A window that launched anything is completed first, so that every replica issues
        the same collectives whether or not its own backward reached every bucket.
        """
        if discard and self._window_open:
            self._finish_round()
        self._start_round()
        self._window_open = False
        self._finalize_pass = None  # one that raised before its end never ran its callback

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
