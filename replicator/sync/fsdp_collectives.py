"""shard="parameters": FSDP2's all-gathers and reduce-scatters on replicator's collectives, each agreed on first.

FSDP2 lets each sharded unit's collectives be replaced (`FSDPModule.set_custom_all_gather` and
`set_custom_reduce_scatter`, with the `AllGather` / `ReduceScatter` classes of
`torch.distributed.fsdp._fully_shard._fsdp_api`), added to torch in mid-2025 (pytorch pull request 155189).
torch 2.13 has them; torch 2.4, the oldest torch replicator supports, has not (its FSDP2 lived in
`torch.distributed._composable.fsdp`, without these hooks). Where they are absent, FSDP2 keeps its own
collectives and no agreement check runs inside it: `plug` returns False and changes nothing.

Where they exist, every unit's all-gather (forward, and again in backward) and reduce-scatter (backward) first
makes an agreement check among the replicas (replicator.comm.agreement) naming the unit and the collective, so
a replica that took another path (a branch that skips a unit, a second forward on one replica) raises the same
ReplicaMismatchError on every replica, naming each replica's unit and line, instead of handing Gloo buffers of
different sizes (an abort, a hang, or a silently wrong sum when the sizes happen to agree). The collective then
runs on the fastest transport that fits:

- every replica on one node, on CPU: shared memory (the shm reducer's segments), where the check is the only
  exchange of messages: each replica copies its part in before the check and reads the others' after it
  (`_SharedMemory` says why two areas used in turns make that safe). Gloo, FSDP2's own, emulates the
  reduce-scatter with an all-reduce of the whole tensor over TCP;
- across nodes on Gloo: after the check, a ring of send/recv moving (N - 1)/N of the tensor
  (`sync/reducers/_ring.py`);
- elsewhere (NCCL): after the check, the backend's own collectives.

An all-gather only copies. A reduce-scatter's sum through shared memory adds the replicas' slices in the order
Gloo's ring all-reduce does (`sum_in_ring_order`), then divides by N as Gloo's average does, so shard="parameters"
stays bit for bit equal to plain FSDP2 on Gloo (tested at 2, 3 and 4 replicas). The send/recv ring adds them the
other way round, the same bits up to three replicas (the first two terms swap), within rounding beyond.
Reductions other than a sum or an average (FSDP2's PREMUL_SUM, after `set_gradient_divide_factor`) go to the
backend's own collective, after the check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from replicator._torch_names import fsdp_param_groups
from replicator.comm.agreement import Agreement, PendingAgreement, call_site
from replicator.sync.reducers import _ring
from replicator.sync.reducers.shm import SharedMemorySum, shared_memory_usable, sum_in_ring_order
from replicator.topology import ProcessGroups

try:  # FSDP2 and the Comm API of its custom collectives; absent from older torch (see the module docstring)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - depends on the installed torch
    FSDPModule = AllGather = ReduceScatter = None  # type: ignore[assignment, misc]

__all__ = ["FsdpCollectives", "custom_collectives_available"]

# torch 2.13 renamed these (the old names warn); the project supports torch >= 2.4.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def custom_collectives_available() -> bool:
    """Can FSDP2's collectives be replaced in this torch?"""
    return FSDPModule is not None and AllGather is not None and hasattr(FSDPModule, "set_custom_reduce_scatter")


class _Transport(Protocol):
    """How one unit's collective moves its bytes (blocking). `agree()` makes the replicas' check: each transport
    calls it before anything that could wait for a peer, so a mismatch raises instead of leaving one waiting."""

    name: str

    def all_gather(self, output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup,
                   agree: Callable[[], PendingAgreement]) -> None: ...

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup,
                       agree: Callable[[], PendingAgreement]) -> None: ...

    def close(self) -> None: ...


class _SharedMemory:
    """Through the node's /dev/shm, one exchange of messages per collective: the agreement check itself.

    Two areas of one row per replica, each row as long as the largest unit gathered, used in turns (collective k
    uses area k mod 2): shared memory of twice the largest unit per replica, beside FSDP2's own buffers. A replica
    writes its part into the area before it makes the check; once every replica has made it (so every part is
    written), it reads what it needs. Nobody writes into an area while a peer may still read it: the next write
    into area k mod 2 is collective k + 2's, made by a replica that has passed check k + 1, which every peer makes
    only once it has read what it needed of collective k. A collective that does not fit the areas (its unit is
    larger than any when they were sized, or of another dtype) is agreed on first, then runs on the reducer's
    own segments (two barriers, one of them the check).
    """

    name = "shm"

    def __init__(self, shm: SharedMemorySum) -> None:
        self.shm = shm
        self.size, self.position = shm.local_size, shm.position
        self.areas: torch.Tensor | None = None  # (2, replicas, elements)
        self.collectives = 0  # how many ran: whose turn each area is

    def reserve(self, numel: int, dtype: torch.dtype) -> None:
        """Size the areas for collectives of up to `numel` elements of `dtype` (collective: every replica, together)."""
        if self.areas is not None and self.areas.dtype == dtype and self.areas.shape[2] >= numel:
            return
        self.areas = self.shm.shared_rows("fsdp", 2 * self.size, numel, dtype).view(2, self.size, numel)

    def _area(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        turn, self.collectives = self.collectives % 2, self.collectives + 1
        if self.areas is None or self.areas.dtype != dtype or self.areas.shape[2] < numel:
            return None
        return self.areas[turn, :, :numel]

    def all_gather(self, output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup,
                   agree: Callable[[], PendingAgreement]) -> None:
        flat, size = output.view(-1), chunk.numel()
        area = self._area(flat.numel(), flat.dtype)
        if area is None:
            _place(output, chunk, self.position)
            self.shm.all_gather_(output, [size * k for k in range(self.size + 1)], agree())
            return
        _place(output, chunk, self.position)
        area[0, self.position * size : (self.position + 1) * size] = chunk.view(-1)  # one row: each its own place
        agree()
        for peer in range(self.size):
            if peer != self.position:
                flat[peer * size : (peer + 1) * size] = area[0, peer * size : (peer + 1) * size]

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup,
                       agree: Callable[[], PendingAgreement]) -> None:
        flat, size = tensor.view(-1), output.numel()
        area = self._area(flat.numel(), flat.dtype)
        if area is None:
            self.shm.reduce_scatter(output, tensor, agree())
            return
        area[self.position] = flat  # a row each: the whole tensor
        agree()
        sum_in_ring_order(area[:, self.position * size : (self.position + 1) * size], self.position, output.view(-1))

    def close(self) -> None:
        self.shm.close()


class _Group:
    """Over the unit's process group: a send/recv ring on Gloo (its reduce-scatter is an all-reduce), else native."""

    def __init__(self, gloo: bool) -> None:
        self.gloo = gloo
        self.name = "ring" if gloo else "native"

    def all_gather(self, output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup,
                   agree: Callable[[], PendingAgreement]) -> None:
        agree()
        if self.gloo:
            _place(output, chunk, group.rank())
            _ring.all_gather_(output.view(-1), dist.get_process_group_ranks(group), group.rank(), group)
        else:
            _all_gather_single(output, chunk, group=group)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup,
                       agree: Callable[[], PendingAgreement]) -> None:
        agree()
        if self.gloo:  # in place in FSDP2's scratch input, which it drops afterwards
            output.copy_(_ring.reduce_scatter_(tensor.view(-1), dist.get_process_group_ranks(group), group.rank(),
                                               group))
        else:
            _reduce_scatter_single(output, tensor, op=dist.ReduceOp.SUM, group=group)

    def close(self) -> None:
        pass


def _place(output: torch.Tensor, chunk: torch.Tensor, position: int) -> None:
    """Put this replica's chunk in its place in `output`, unless FSDP2 built it there already (it does: a view)."""
    place = output.view(-1)[position * chunk.numel() : (position + 1) * chunk.numel()]
    if place.data_ptr() != chunk.data_ptr():
        place.copy_(chunk.view(-1))


def _is(op: Any, kind: Any) -> bool:
    try:
        return bool(op == kind)
    except (TypeError, RuntimeError):  # a ReduceOp object that does not compare with a plain kind
        return False


class FsdpCollectives:
    """The collectives that every sharded unit of one Replicator uses: one transport, one agreement channel."""

    def __init__(self, agreement: Agreement, transport: _Transport) -> None:
        self.agreement = agreement
        self.transport = transport
        self.checks = 0  # agreement checks made, for tests and reports

    @classmethod
    def build(cls, groups: ProcessGroups, device: torch.device, agreement: Agreement,
              timeout_s: float) -> FsdpCollectives:
        """Choose the transport for this job's replicas (collective: every replica calls it, at the same point)."""
        assert groups.replica is not None
        transport: _Transport
        if shared_memory_usable(groups, device) is None:
            transport = _SharedMemory(SharedMemorySum(groups, timeout_s))
        else:
            # The ring's send/recv on host tensors only: Gloo's own collectives carry CUDA tensors where it has them.
            transport = _Group(dist.get_backend(groups.replica) == "gloo" and device.type == "cpu")
        return cls(agreement, transport)

    def plug(self, roots: Iterable[torch.nn.Module]) -> bool:
        """Give every unit FSDP2 sharded in `roots` these collectives; False (nothing done) where torch cannot.
        Collective: every replica plugs the same units at the same point (the end of a repl.scope() block)."""
        if not custom_collectives_available():
            return False
        largest: dict[torch.dtype, int] = {}
        for root in roots:
            # Named as the scope names tensors: after the model's own class, not FSDP2's subclass of it (FSDPNet).
            model_class = next(c for c in type(root).__mro__ if not issubclass(c, FSDPModule))
            for name, module in root.named_modules(prefix=model_class.__name__):
                if isinstance(module, FSDPModule) and _holds_parameters(module):
                    module.set_custom_all_gather(_UnitAllGather(self, name))
                    module.set_custom_reduce_scatter(_UnitReduceScatter(self, name))
                    for dtype, numel in _gathered_elements(module, self.agreement.size).items():  # type: ignore[arg-type]
                        largest[dtype] = max(largest.get(dtype, 0), numel)
        reserve = getattr(self.transport, "reserve", None)
        if reserve is not None and len(largest) == 1:  # (units of mixed dtypes gather bytes: the slower path)
            [(dtype, numel)] = largest.items()
            reserve(numel, dtype)
        return True

    def close(self) -> None:
        self.transport.close()

    def _agree(self, what: str, unit: str, numel: int, dtype: torch.dtype) -> Callable[[], PendingAgreement]:
        """The check that every replica is about to run the same collective of the same unit (or all of them raise,
        saying which each runs), for the transport to make when it suits it."""

        def agree() -> PendingAgreement:
            pending = self.agreement.start(f"FSDP2 {what} of {unit}: {numel} {str(dtype).removeprefix('torch.')} "
                                           "elements per replica", call_site())
            pending.wait()
            self.checks += 1
            return pending

        return agree

    def all_gather(self, unit: str, output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.transport.all_gather(output, chunk, group,
                                  self._agree("all-gather of the parameters", unit, chunk.numel(), chunk.dtype))

    def reduce_scatter(self, unit: str, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup,
                       op: Any) -> None:
        agree = self._agree("reduce-scatter of the gradients", unit, output.numel(), tensor.dtype)
        average = _is(op, dist.ReduceOp.AVG)
        if not average and not _is(op, dist.ReduceOp.SUM):  # PREMUL_SUM: the backend's own, after the check
            agree()
            _reduce_scatter_single(output, tensor, op=op, group=group)
            return
        self.transport.reduce_scatter(output, tensor, group, agree)
        if average:
            output.div_(group.size())  # as Gloo's average: the sum, then a division


def _gathered_elements(unit: torch.nn.Module, replicas: int) -> dict[torch.dtype, int]:
    """What an all-gather of `unit` holds, by dtype: its own parameters (not its inner units'), each cut along
    dimension 0 into `replicas` shards of equal rows (FSDP2 pads the last). An estimate: a collective that turns
    out larger takes the slower path, no less correct."""
    inner = {id(p) for module in unit.modules() if module is not unit and isinstance(module, FSDPModule)
             for p in module.parameters()}
    elements: dict[torch.dtype, int] = {}
    for param in unit.parameters():
        if id(param) not in inner:
            rows = param.shape[0] if param.dim() else 1  # the DTensor's shape: the whole parameter's
            per_row = param.numel() // rows if rows else 0
            elements[param.dtype] = elements.get(param.dtype, 0) + -(-rows // replicas) * replicas * per_row
    return elements


def _holds_parameters(module: FSDPModule) -> bool:
    return len(fsdp_param_groups(module._get_fsdp_state())) == 1


def _allocate(size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


if AllGather is not None:

    class _UnitAllGather(AllGather):
        """One unit's all-gather, agreed on first."""

        def __init__(self, collectives: FsdpCollectives, unit: str) -> None:
            self.collectives, self.unit = collectives, unit

        def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
            return _allocate(size, dtype, device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     async_op: bool = False) -> dist.Work | None:
            self.collectives.all_gather(self.unit, output_tensor, input_tensor, group)
            return None  # done: FSDP2 waits on nothing

    class _UnitReduceScatter(ReduceScatter):
        """One unit's reduce-scatter of its gradients, agreed on first."""

        def __init__(self, collectives: FsdpCollectives, unit: str) -> None:
            self.collectives, self.unit = collectives, unit

        def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
            return _allocate(size, dtype, device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     op: Any, async_op: bool = False) -> dist.Work | None:
            self.collectives.reduce_scatter(self.unit, output_tensor, input_tensor, group, op)
            return None
