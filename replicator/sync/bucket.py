"""A bucket: several parameters' gradients in one flat buffer, reduced as one message; and the reducer contract."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from replicator.comm.agreement import PendingAgreement
from replicator.timeline.recorder import InFlight

__all__ = ["Bucket", "assign_buckets", "Allocator", "Reducer", "PendingReduction"]


class PendingReduction(Protocol):
    """A reduction in flight; `wait()` returns once the buffer holds the sum."""

    def wait(self) -> object: ...


class Reducer(Protocol):
    """Sums `buffer` in place over `group`, asynchronously.

    The synchronizer passes the `bucket` the buffer belongs to: its gradients end at
    `bucket.numel`, after which come presence slots that must be summed exactly, and its
    parameters give the gradients' shapes. The same bucket object comes back every round,
    so a reducer with state (error feedback, PowerSGD's Q) keys it by the bucket. A lossless
    reducer may also sum a loose tensor (no bucket). A reducer may also have `close()`, which
    stops whatever it runs in the background, and `allocate(numel, dtype, device)`, which
    provides bucket buffers it can reduce without a copy (see `assign_buckets`).
    """

    name: str

    def reduce(self, buffer: torch.Tensor, group: dist.ProcessGroup,
               bucket: Bucket | None = None) -> PendingReduction: ...


@dataclass(eq=False)
class Bucket:
    """Gradients laid end to end, then one presence slot per parameter.

    After the sum, a presence slot counts the replicas that produced a gradient for its
    parameter; zero means no replica did, and the parameter keeps grad None exactly as
    single-process training would leave it.
    """

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)
    # Which parameters had a local gradient, kept on the host so a step in which every
    # parameter had one never reads the (possibly GPU-resident) presence counts back.
    flags: list[int] = field(default_factory=list)
    launched: bool = False
    pending: PendingReduction | None = None
    # The window's agreement check when this bucket opened the window. Every replica starts it
    # only once this buffer is complete (gradients and presence slots), so its completion
    # proves every replica's buffer is loaded: a reducer may take it as its first barrier.
    arrival: PendingAgreement | None = None
    # Each parameter's slice of the buffer, shaped like it: made once, since every view made
    # from Python during backward is a dispatcher call on a cold cache.
    views: list[torch.Tensor] = field(default_factory=list)
    # Positions whose sparse gradients travel as indices and values beside the buffer (the
    # synchronizer decides, the same on every replica); any other sparse gradient is densified.
    gathered: set[int] = field(default_factory=set)
    # This round's sparse gradients of those positions, coalesced and scaled.
    sparse: dict[int, torch.Tensor] = field(default_factory=dict)
    # Gradients that carry a graph (backward(create_graph=True)), by position: the average
    # handed back stays differentiable through this replica's share.
    graphs: dict[int, torch.Tensor] = field(default_factory=dict)
    # Its reduction's timeline span while one is recorded (replicator.timeline.InFlight).
    in_flight: InFlight | None = None

    def __post_init__(self) -> None:
        self.views = [self.buffer[start : start + param.numel()].view_as(param)
                      for param, start in zip(self.params, self.offsets)]

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def presence(self) -> torch.Tensor:
        return self.buffer[self.numel :]

    def load(self, position: int, scale: float) -> None:
        """Copy the parameter's gradient in, times `scale` (zeros and absent if it has none).

        Scaling on the way in (by 1/replicas, or by this replica's share of the samples) saves a
        separate pass over the reduced buffer. A sparse gradient of a gathered position is kept
        aside (its slot stays zero and absent); any other is densified into its slot.
        """
        grad = self.params[position].grad
        view = self.views[position]
        if not self.flags:
            self.flags = [0] * len(self.params)
        self.ready.add(position)
        if grad is None or (grad.is_sparse and position in self.gathered):
            view.zero_()
            self.flags[position] = 0
            if grad is not None:
                self.sparse[position] = grad.detach().coalesce() * scale
            return
        if grad.is_sparse:
            grad = grad.to_dense()
        elif grad.data_ptr() == view.data_ptr():
            # .grad is still this bucket's view (zero_grad(set_to_none=False) kept it, or a
            # second backward in the window added into the average). Give it its own storage
            # before the buffer is scaled and reduced in place: autograd may add into it again
            # while the reduction runs (a weight shared by reentrant checkpoint segments).
            grad = self.params[position].grad = grad.clone()
        if grad.requires_grad and torch.is_grad_enabled():
            self.graphs[position] = grad  # a backward pass with create_graph=True made it
        torch.mul(grad.detach(), scale, out=view)
        self.flags[position] = 1

    def write_presence(self) -> None:
        """Put the presence flags in the buffer's tail, once per launch.

        Filled on the buffer's own device: copying a host list into a GPU buffer would make the
        host wait for all the backward work queued so far, once per bucket.
        """
        presence = self.presence()
        presence.fill_(1)
        for position, flag in enumerate(self.flags):
            if not flag:
                presence[position] = 0

    def release_buffer(self) -> None:
        """Free the buffer between updates (shard="gradients" keeps only its slice); `ensure_buffer` makes a new one."""
        self.buffer = self.buffer.new_empty(0)
        self.views = []

    def ensure_buffer(self, lent: torch.Tensor | None = None) -> None:
        """A buffer again after `release_buffer`: `lent` (a reducer's row, exactly as long) or a new tensor."""
        if not self.views and self.params:
            # Uninitialised: load() writes every parameter's slot (zeros where it has no gradient), and the
            # presence slots are written at launch.
            self.buffer = lent if lent is not None else torch.empty(
                self.numel + len(self.params), dtype=self.buffer.dtype, device=self.buffer.device)
            self.__post_init__()

    def reset(self) -> None:
        self.ready.clear()
        self.sparse.clear()
        self.graphs.clear()
        self.launched = False
        self.pending = None
        self.arrival = None
        self.in_flight = None


Allocator = Callable[[int, torch.dtype, torch.device], "torch.Tensor | None"]


def assign_buckets(params: list[torch.nn.Parameter], cap_bytes: int, first_cap_bytes: int,
                   allocate: Allocator | None = None) -> list[Bucket]:
    """Group parameters into buckets in reverse order (the order backward produces them).

    A bucket never mixes devices or dtypes. The first bucket is small so that the first
    message leaves early in the backward pass; later ones are up to `cap_bytes`. A reducer's
    `allocate` may provide the zeroed buffers (shared memory that needs no copy to reduce).
    """
    buckets: list[Bucket] = []
    current: list[torch.nn.Parameter] = []
    current_bytes = 0

    def close() -> None:
        nonlocal current, current_bytes
        if not current:
            return
        offsets, total = [], 0
        for param in current:
            offsets.append(total)
            total += param.numel()
        numel, dtype, device = total + len(current), current[0].dtype, current[0].device
        buffer = allocate(numel, dtype, device) if allocate is not None else None
        if buffer is None:
            buffer = torch.zeros(numel, dtype=dtype, device=device)
        buckets.append(Bucket(len(buckets), current, offsets, total, buffer))
        current, current_bytes = [], 0

    for param in reversed(params):
        if current and (param.dtype != current[0].dtype or param.device != current[0].device):
            close()
        current.append(param)
        current_bytes += param.numel() * param.element_size()
        if current_bytes >= (first_cap_bytes if not buckets else cap_bytes):
            close()
    close()
    return buckets
