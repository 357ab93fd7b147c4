"""Sharded data parallelism (ZeRO-1, ZeRO-2): each replica steps the optimizer on its own slice of every bucket.

(shard="parameters", ZeRO-3, is FSDP2's: replicator.sync.fsdp.)

Replica r of N owns slice r of every gradient bucket: elements `T*r//N` to `T*(r+1)//N` of the
bucket's buffer (T counts its gradients and its presence slots), cut down to the gradients. A
slice may cross parameters, and a parameter smaller than N lies in one replica's slice. Each
replica keeps a second optimizer of the user's class (the *shard optimizer*) over flat views of
its slices' pieces of the parameters, one parameter group per user group, so its state is 1/N of
the whole; `optimizer.step()` copies the user's hyperparameters in (an LR scheduler keeps
working), steps it, and all-gathers the updated slices back into the user's parameters, which
stay plain tensors. The user's optimizer itself never steps and holds no state.

- "optimizer" (ZeRO-1): the gradients are averaged in full, as without sharding, and `.grad`
  holds the average (a view of its bucket) between backward and step, exactly as with
  shard=None; the shard optimizer reads its slice from `.grad`.
- "gradients" (ZeRO-2): each `.grad` is freed as soon as its bucket holds it; once a bucket is
  averaged (while the next one travels), each replica keeps its slice of it (1/N) and the bucket's
  buffer is released, so at most two full buckets live during backward and none between steps.
  A reducer that can stop after the scatter does (the shared-memory one, on one node: each replica
  sums only its slice, read from the rows the buckets were loaded into and written straight into
  the slice it keeps: replicator.sync.transport); the others reduce in full. `.grad` is None after
  the backward pass.

The parameters' all-gather goes through the reducer where it has one (shared memory: each replica
writes its updated elements from its parameters into its peers' rows and copies theirs from its own
row into its parameters, no flat copy of a bucket in between), else over the replica group, two
buckets in flight.

The update of every element is the arithmetic one process does on that element (element-wise
optimizers: SGD, Adam, AdamW, ...), on the same averaged gradient: hence bit-equality with
shard=None at any N. An optimizer whose update mixes elements (LAMB's per-tensor trust ratio,
Shampoo) would differ; it is the user's to avoid. `state_dict()` gathers the full, layout-free
state on every replica and `load_state_dict()` takes its slices, so a checkpoint moves between
any N and shard levels.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm.objects import all_gather_values
from replicator.context import ReplicaContext
from replicator.errors import ReplicatorUsageError
from replicator.health import all_finite
from replicator.sync.bucket import Bucket
from replicator.sync.synchronizer import GradientSynchronizer

__all__ = ["SHARD_LEVELS", "SHARDED", "check_shard", "check_reducer", "ShardedOptimizer", "slice_bounds"]

SHARD_LEVELS = {
    "optimizer": "ZeRO-1: each replica keeps 1/N of the optimizer state",
    "gradients": "ZeRO-2: 1/N of the optimizer state and of the averaged gradients",
    "parameters": "ZeRO-3, on FSDP2: 1/N of the parameters too, gathered unit by unit in forward and backward",
}
# The wrapped optimizers whose state is sharded: no replica holds the whole of it (repl.broadcast_state refuses them).
SHARDED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_CHOICES = "None (every replica keeps everything), " + ", ".join(f"{k!r} ({v})" for k, v in SHARD_LEVELS.items())


def check_shard(shard: str | None, mode: object, stages: int, precision: object = "fp32",
                uneven_batches: object = "refuse") -> str | None:
    """The shard level, checked before the job starts: the same arguments raise the same error on every replica.

    `mode` is Replicator's: a name, or a mode's config object (rp.ParameterServers, ...) with its `name`."""
    mode = getattr(mode, "name", mode)
    if shard is None:
        return None
    if shard not in SHARD_LEVELS:
        raise ReplicatorUsageError(f"unknown shard={shard!r}; choose {_CHOICES}")
    if mode in ("async", "actor_learner", "diloco"):
        raise ReplicatorUsageError(
            f"shard={shard!r} works with mode='sync' only, not mode={mode!r}: parameter servers, actors and DiLoCo's "
            "groups keep whole copies of the optimizer state by design. Drop shard= or use mode='sync'")
    if shard == "parameters" and uneven_batches != "refuse":
        raise ReplicatorUsageError(
            f"shard='parameters' with uneven_batches={uneven_batches!r} is not available yet: FSDP2's reduce-scatter "
            "averages every replica's gradient alike, so replicas with more samples would not weigh more. Give every "
            "replica batches of one size (uneven_batches='refuse'), or use shard='gradients', which weighs them")
    if shard == "parameters" and getattr(precision, "name", precision) == "fp16":
        raise ReplicatorUsageError(
            "shard='parameters' with precision='fp16' is not available yet: fp16's loss scale judges whole "
            "gradients, and no sharded loss scale exists. Use precision='bf16' (no loss scale), or "
            "shard='gradients' with fp16")
    return shard


def check_reducer(reducer: object, shard: str) -> None:
    """Refuse reducers whose sum is not element-wise: their average cannot be taken apart into slices."""
    name = str(getattr(reducer, "name", type(reducer).__name__))
    if name.startswith("powersgd"):
        raise ReplicatorUsageError(
            f"shard={shard!r} cannot use reducer {name!r}: PowerSGD sums low-rank factors of whole gradient matrices, "
            "which no replica's slice can be summed from. Use a reducer that sums element-wise ('auto', 'flat', "
            "'shm', 'hierarchical', 'fp16', 'bf16'), or drop shard=")


def slice_bounds(bucket: Bucket, size: int, rank: int) -> tuple[int, int]:
    """Replica `rank`'s slice of `bucket`'s gradients: the shared-memory reducer's split of the whole buffer."""
    total = bucket.numel + len(bucket.params)
    return min(total * rank // size, bucket.numel), min(total * (rank + 1) // size, bucket.numel)


def _sliced(key: str, value: Any, param: torch.Tensor) -> bool:
    """Is this state entry shaped like its parameter (cut into slices), not a per-parameter value (a step count)?"""
    return isinstance(value, torch.Tensor) and value.shape == param.shape and (param.dim() > 0 or key != "step")


@dataclass(eq=False)
class _Piece:
    """This replica's part of one parameter: elements `start:stop` of its bucket, `tensor` a flat view of them."""

    bucket: int
    position: int
    start: int
    stop: int
    param: torch.nn.Parameter
    tensor: torch.Tensor


class ShardedOptimizer:
    """Steps `optimizer`'s update on this replica's slices, then gathers the parameters (see the module)."""

    def __init__(self, optimizer: torch.optim.Optimizer, synchronizer: GradientSynchronizer, level: str,
                 group: dist.ProcessGroup, context: ReplicaContext) -> None:
        self.optimizer, self.synchronizer, self.level = optimizer, synchronizer, level
        self.group, self.context = group, context
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = synchronizer.params[0].device if synchronizer.params else torch.device("cpu")
        buckets = synchronizer.buckets
        self.bounds = [[slice_bounds(bucket, self.size, rank) for rank in range(self.size)] for bucket in buckets]
        self.pieces: dict[int, _Piece] = {}  # by the parameter's id
        for bucket, bounds in zip(buckets, self.bounds):
            start, stop = bounds[self.rank]
            for position, (param, offset) in enumerate(zip(bucket.params, bucket.offsets)):
                low, high = max(start, offset), min(stop, offset + param.numel())
                if low < high:
                    if not param.is_contiguous():
                        raise ReplicatorUsageError(
                            f"shard={level!r} needs contiguous parameters; {synchronizer.name_of(param)} is not "
                            "(make it so before wrapping: param.data = param.data.contiguous())")
                    flat = param.detach().view(-1)[low - offset : high - offset]
                    self.pieces[id(param)] = _Piece(bucket.index, position, low, high, param, flat)
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [self.pieces[id(p)].tensor for p in group["params"] if id(p) in self.pieces]}
                  for group in optimizer.param_groups]
        # Every group carries all its options; the constructor gets those it takes (AdamW's defaults hold one not).
        accepted = inspect.signature(type(optimizer)).parameters
        try:
            self.shard = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        except (TypeError, ValueError) as error:
            raise ReplicatorUsageError(
                f"shard={level!r} builds a second {type(optimizer).__name__} over this replica's slices, as "
                f"type(optimizer)(param_groups, **options), and that failed: {error}. Give the optimizer "
                "a constructor that takes its defaults as keywords, or drop shard=") from error
        # shard="gradients": this replica's slice of each bucket's average, and which parameters had a gradient.
        self.slices: dict[int, torch.Tensor] = {}  # by bucket index
        self.present: dict[int, list[bool]] = {}

    # -- shard="gradients": the average kept as slices ------------------------------------
    def slice_for(self, bucket: Bucket) -> torch.Tensor:
        """Where a reducer that stops after its scatter may sum this replica's slice of `bucket` (then kept as is)."""
        start, stop = self.bounds[bucket.index][self.rank]
        return torch.empty(stop - start, dtype=bucket.buffer.dtype, device=bucket.buffer.device)

    def keep_slice(self, bucket: Bucket, counts: list[float] | None, summed: torch.Tensor | None = None) -> None:
        """Keep this replica's slice of a reduced bucket (`summed`, where the reducer summed it there; else copied
        out of the buffer); note which parameters had a gradient on any replica."""
        start, stop = self.bounds[bucket.index][self.rank]
        self.slices[bucket.index] = summed if summed is not None else bucket.buffer[start:stop].clone()
        self.present[bucket.index] = [True] * len(bucket.params) if counts is None else [c != 0 for c in counts]

    def slices_finite(self) -> bool:
        """Are all averaged gradients finite? Each replica checks its slices; the verdict is everyone's together."""
        flag = torch.tensor([float(all_finite(self.slices.values()))], device=self.device)  # NCCL: on the GPU
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag)

    def _gradient_of(self, piece: _Piece) -> torch.Tensor | None:
        if self.level == "gradients":
            if piece.bucket not in self.present or not self.present[piece.bucket][piece.position]:
                return None
            start = self.bounds[piece.bucket][self.rank][0]
            return self.slices[piece.bucket][piece.start - start : piece.stop - start]
        grad = piece.param.grad
        if grad is None:
            return None
        offset = self.synchronizer.buckets[piece.bucket].offsets[piece.position]
        return grad.detach().reshape(-1)[piece.start - offset : piece.stop - offset]

    # -- the update -----------------------------------------------------------------------
    def step(self) -> Any:
        """The user's hyperparameters in, the shard optimizer's step, the parameters gathered."""
        for mine, theirs in zip(self.shard.param_groups, self.optimizer.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        for piece in self.pieces.values():
            piece.tensor.grad = self._gradient_of(piece)
        try:
            result = self.shard.step()
        finally:
            for piece in self.pieces.values():
                piece.tensor.grad = None
        self.slices, self.present = {}, {}
        self._gather_parameters()
        return result

    def _gather_parameters(self) -> None:
        """Every replica's updated slices into every replica's parameters. On one node through shared memory, read
        from and written into the parameters themselves (over shard="gradients"' lent rows where it has them);
        else bucket by bucket through a flat tensor (`_gather`)."""
        gather = getattr(self.synchronizer.reducer, "all_gather_into", None)
        rows = self.synchronizer.transport.rows if self.synchronizer.transport is not None else {}
        buckets = [([(param.detach().view(-1), offset) for param, offset in zip(bucket.params, bucket.offsets)],
                    [start for start, _ in bounds] + [bounds[-1][1]], rows.get(bucket.index))
                   for bucket, bounds in zip(self.synchronizer.buckets, self.bounds)]
        work = gather(buckets) if gather is not None else None
        if work is None:
            self._gather(lambda param: param.detach(), self._into_parameters)
            return
        work.wait()

    def clip_(self, params: Iterable[torch.Tensor], max_norm: float, norm_type: float,
              stages: dist.ProcessGroup | None = None) -> torch.Tensor:
        """shard="gradients": clip by the global norm of the averaged gradients, from the slices (one all-reduce;
        with `stages`, a pipeline's stage group, one more: the norm is then the whole model's)."""
        pieces = [self.pieces[id(p)] for p in params if id(p) in self.pieces]
        grads = [g for piece in pieces if (g := self._gradient_of(piece)) is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), device=self.device)
        groups = [self.group] if stages is None else [self.group, stages]
        if math.isinf(norm_type):
            for group in groups:
                dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:
            powered = norm.to(torch.float64) ** norm_type
            for group in groups:
                dist.all_reduce(powered, group=group)
            norm = (powered ** (1.0 / norm_type)).to(norm.dtype)
        if grads:  # torch.nn.utils.clip_grads_with_norm_'s arithmetic, on the slices themselves
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def _gather(self, local: Callable[[torch.nn.Parameter], torch.Tensor],
                consume: Callable[[Bucket, torch.Tensor], None]) -> None:
        """All-gather, bucket by bucket, the slices of `local(param)` (a parameter or a tensor shaped like it) that
        each replica holds, and hand each bucket's whole flat tensor to `consume` as it arrives. Through the
        reducer's own all-gather where it has one (shared memory on one node), else Gloo's or NCCL's. Two buckets
        travel at a time, so the gathered copies never add up to a whole model."""
        gather = getattr(self.synchronizer.reducer, "all_gather", None)
        pending: list[tuple[Bucket, Callable[[], torch.Tensor]]] = []
        with torch.no_grad():
            for bucket, bounds in zip(self.synchronizer.buckets, self.bounds):
                start, stop = bounds[self.rank]
                flat = torch.empty(bucket.numel, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
                for param, offset in zip(bucket.params, bucket.offsets):
                    low, high = max(start, offset), min(stop, offset + param.numel())
                    if low < high:
                        flat[low:high] = local(param).reshape(-1)[low - offset : high - offset]
                cuts = [start for start, _ in bounds] + [bounds[-1][1]]
                work = gather(flat, cuts) if gather is not None else None
                pending.append((bucket, self._gathered(flat, bounds, work)))
                if len(pending) > 1:
                    consume(pending[0][0], pending.pop(0)[1]())
            for bucket, finish in pending:
                consume(bucket, finish())

    def _gathered(self, flat: torch.Tensor, bounds: list[tuple[int, int]], work: Any) -> Callable[[], torch.Tensor]:
        """What waits for one bucket's gather; started here over the process group when the reducer has none."""
        if work is not None:
            return lambda: (work.wait(), flat)[1]
        chunk = max(stop - start for start, stop in bounds)
        rows = torch.empty(self.size, chunk, dtype=flat.dtype, device=flat.device)
        start, stop = bounds[self.rank]
        rows[self.rank, : stop - start] = flat[start:stop]
        request = dist.all_gather(list(rows.unbind(0)), rows[self.rank].clone(), group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            assert request is not None
            request.wait()
            for rank, (low, high) in enumerate(bounds):
                flat[low:high] = rows[rank, : high - low]
            return flat

        return finish

    @staticmethod
    def _into_parameters(bucket: Bucket, flat: torch.Tensor) -> None:
        for param, offset in zip(bucket.params, bucket.offsets):
            param.detach().view(-1).copy_(flat[offset : offset + param.numel()])

    # -- checkpoints: the full, layout-free state ---------------------------------------
    def state_dict(self, original: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """torch's state_dict of the user's optimizer, holding the whole state gathered from every replica."""
        saved = original()  # the user's param_groups (hyperparameters and parameter numbers); its state is empty
        number = {id(p): n for n, p in enumerate(p for group in self.optimizer.param_groups for p in group["params"])}
        # Each parameter's state is described by the replica that holds its first element: its keys, which of
        # them are shaped like the slice (gathered below), and the others' values (JSON: a step count).
        described: dict[str, Any] = {}
        for piece in self.pieces.values():
            offset = self.synchronizer.buckets[piece.bucket].offsets[piece.position]
            state = self.shard.state.get(piece.tensor, {})
            if piece.start == offset and state:
                described[f"{piece.bucket}/{piece.position}"] = [
                    [key, "slice"] if isinstance(value, torch.Tensor) and value.shape == piece.tensor.shape
                    else [key, "tensor", float(value), str(value.dtype)] if isinstance(value, torch.Tensor)
                    else [key, "value", value] for key, value in state.items()]
        # JSON on the wire (comm.objects), never pickled: what each replica holds of the state, by name.
        for record in all_gather_values(described, self.group):
            described.update(record)
        sliced = sorted({entry[0] for entries in described.values() for entry in entries if entry[1] == "slice"})
        for key in sliced:
            def into_state(bucket: Bucket, flat: torch.Tensor, key: str = key) -> None:
                for position, (param, offset) in enumerate(zip(bucket.params, bucket.offsets)):
                    if [key, "slice"] in described.get(f"{bucket.index}/{position}", []):
                        entry = saved["state"].setdefault(number[id(param)], {})
                        entry[key] = flat[offset : offset + param.numel()].view_as(param).clone()

            self._gather(lambda param, key=key: self._state_or_zeros(param, key), into_state)  # type: ignore[misc]
        for where, entries in described.items():
            bucket_index, position = map(int, where.split("/"))
            param = self.synchronizer.buckets[bucket_index].params[position]
            entry = saved["state"].setdefault(number[id(param)], {})
            for key, kind, *value in entries:
                if kind == "tensor":
                    entry[key] = torch.tensor(value[0], dtype=getattr(torch, value[1].removeprefix("torch.")))
                elif kind == "value":
                    entry[key] = value[0]
        return saved

    def _state_or_zeros(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        piece = self.pieces.get(id(param))
        value = self.shard.state.get(piece.tensor, {}).get(key) if piece is not None else None
        if value is None:  # a parameter without this state (never had a gradient): its slice travels as zeros
            return torch.zeros_like(param)
        whole = torch.zeros(param.numel(), dtype=value.dtype, device=value.device)
        offset = self.synchronizer.buckets[piece.bucket].offsets[piece.position]  # type: ignore[union-attr]
        whole[piece.start - offset : piece.stop - offset] = value  # type: ignore[union-attr]
        return whole

    def load_state_dict(self, state_dict: dict[str, Any], original: Callable[[dict[str, Any]], None]) -> None:
        """Take this replica's slices of a full state_dict (saved at any N, sharded or not).

        Every entry is checked first, not only this replica's: a tensor neither shaped like its parameter nor of
        one element has no slices to take, and every replica must refuse it alike (one owning no slice of that
        parameter would otherwise go on alone, and the others fail at the first step)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for number, entry in state_dict["state"].items():
            param = params[int(number)]
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and not _sliced(key, value, param) and value.numel() != 1:
                    raise ReplicatorUsageError(
                        f"state {key!r} of {self.synchronizer.name_of(param)} has shape {tuple(value.shape)}, neither "
                        f"its parameter's {tuple(param.shape)} nor one element: shard={self.level!r} cannot cut it "
                        "into slices. Load a state whose tensors are laid out as their parameters, whole (what "
                        "optimizer.state_dict() gives, gathered from every replica)")
        original({"state": {}, "param_groups": state_dict["param_groups"]})  # hyperparameters, checked by torch
        shard_number = {id(t): n for n, t in enumerate(t for g in self.shard.param_groups for t in g["params"])}
        state: dict[int, dict[str, Any]] = {}
        for number, entry in state_dict["state"].items():
            param = params[int(number)]
            piece = self.pieces.get(id(param))
            if piece is None:
                continue
            offset = self.synchronizer.buckets[piece.bucket].offsets[piece.position]
            state[shard_number[id(piece.tensor)]] = {
                key: value.reshape(-1)[piece.start - offset : piece.stop - offset].clone()
                if _sliced(key, value, param) else value
                for key, value in entry.items()}
        own = self.shard.state_dict()
        self.shard.load_state_dict({"state": state, "param_groups": own["param_groups"]})
        for mine, theirs in zip(self.shard.param_groups, self.optimizer.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def state_bytes(self) -> int:
        """Bytes of optimizer state this replica holds (its shard optimizer's tensors)."""
        return sum(value.numel() * value.element_size() for state in self.shard.state.values()
                   for value in state.values() if isinstance(value, torch.Tensor))
