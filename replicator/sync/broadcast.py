"""`repl.broadcast_state`: replica 0's module and optimizer state on every replica (Horovod's recipe).

A researcher coming from Horovod loads a checkpoint on rank 0 only, then calls
`broadcast_parameters` and `broadcast_optimizer_state`. Here one verb does both. An optimizer's
state may exist on replica 0 alone (the others never stepped), so its structure travels
too: as JSON (torch's pytree spec and the plain values), never pickled; tensors follow in
one broadcast per dtype and device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from replicator.comm.agreement import Agreement
from replicator.comm.objects import broadcast_value
from replicator.errors import ReplicatorUsageError
from replicator.identity import broadcast_from_first, copy_from_first, require_same_layout
from replicator.sync.fsdp import is_sharded
from replicator.sync.sharding import SHARDED
from replicator.topology import ProcessGroups

__all__ = ["broadcast_state"]

_SAME_OBJECTS = ("Every replica must pass the same modules and optimizers, built the same way, to "
                 "repl.broadcast_state(), at the same point.")


def broadcast_state(objects: Iterable[Any], groups: ProcessGroups, agreement: Agreement,
                    names: dict[int, str]) -> None:
    """Overwrite each module's parameters and buffers, and each optimizer's state and options, with replica 0's.

    The replica group carries the tensors; its Gloo control group, the optimizer state's
    structure and any tensors kept on the host (Adam's step counts). Every replica of this
    stage calls it with the same objects; their layouts are compared first (`agreement`).
    """
    group, control, source = groups.replica, groups.replica_control, groups.mesh.replica_ranks[0]
    objects = list(objects)
    if any(isinstance(thing, torch.optim.Optimizer) and thing in SHARDED for thing in objects):
        raise ReplicatorUsageError(  # the same objects on every replica: raised by all, before any traffic
            "repl.broadcast_state() cannot copy replica 0's state of an optimizer wrapped with shard=: each replica "
            "holds only its slice of it. Call optimizer.load_state_dict(state) on every replica (each takes its "
            "slice of the whole state), or use repl.save()/repl.restore()")
    params = [p for thing in objects for p in (thing.parameters() if isinstance(thing, torch.nn.Module) else
              [p for g in thing.param_groups for p in g["params"]] if isinstance(thing, torch.optim.Optimizer) else [])]
    if any(is_sharded(param) for param in params):
        raise ReplicatorUsageError(  # the same objects on every replica: raised by all, before any traffic
            "repl.broadcast_state() cannot copy replica 0's values of a model sharded with shard='parameters': each "
            "replica holds other shards of it. Use repl.save() and repl.restore(), where every replica reads its "
            "shards of the whole values")
    for number, thing in enumerate(objects):
        where = f"in repl.broadcast_state(), argument {number}"
        if isinstance(thing, torch.nn.Module):
            prefix = type(thing).__name__
            named = [(names.get(id(t), n), t)
                     for n, t in [*thing.named_parameters(prefix=prefix), *thing.named_buffers(prefix=prefix)]]
            copy_from_first(named, group, source, agreement, where, _SAME_OBJECTS)
        elif isinstance(thing, torch.optim.Optimizer):
            params = [p for g in thing.param_groups for p in g["params"]]
            require_same_layout(agreement, [(names.get(id(p), f"parameter {i}"), p) for i, p in enumerate(params)],
                                where, _SAME_OBJECTS)
            if agreement.size > 1:
                _broadcast_optimizer(thing, group, control, source, agreement.rank == 0)
        else:
            raise ReplicatorUsageError(
                f"repl.broadcast_state() takes modules and optimizers; argument {number} is a {type(thing).__name__}")


def _broadcast_optimizer(optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None,
                         control: dist.ProcessGroup | None, source: int, is_source: bool) -> None:
    leaves: list[Any] = []
    message: dict[str, Any] | None = None
    if is_source:
        leaves, spec = pytree.tree_flatten(optimizer.state_dict())
        try:
            message = {"spec": pytree.treespec_dumps(spec), "leaves": [_describe_leaf(v) for v in leaves]}
        except ReplicatorUsageError as error:  # sent on, so that every replica raises it
            message = {"error": str(error)}
    skeleton = broadcast_value(message, 0, control)  # replica 0 is the first member of the control group
    if "error" in skeleton:
        raise ReplicatorUsageError(f"{skeleton['error']} (found on replica 0)")
    if not is_source:
        devices = [p.device for g in optimizer.param_groups for p in g["params"]]
        device = devices[0] if devices else torch.device("cpu")
        leaves = [_make_leaf(described, device) for described in skeleton["leaves"]]
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    # Host tensors over Gloo: the replica group may be NCCL, which carries device tensors only.
    broadcast_from_first([t for t in tensors if t.device.type == "cpu"], control, source)
    broadcast_from_first([t for t in tensors if t.device.type != "cpu"], group, source)
    if not is_source:
        optimizer.load_state_dict(pytree.tree_unflatten(leaves, pytree.treespec_loads(skeleton["spec"])))


def _describe_leaf(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"tensor": [list(value.shape), str(value.dtype).removeprefix("torch."), value.device.type == "cpu"]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ReplicatorUsageError(
        f"the optimizer's state_dict holds a {type(value).__name__}; repl.broadcast_state() sends tensors, numbers "
        "and strings only (never pickled objects)"
    )


def _make_leaf(described: dict[str, Any], device: torch.device) -> Any:
    if "tensor" not in described:
        return described["value"]
    shape, dtype_name, on_host = described["tensor"]
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise ReplicatorUsageError(f"replica 0 sent optimizer state of unknown dtype {dtype_name!r}")
    return torch.empty([int(size) for size in shape], dtype=dtype, device="cpu" if on_host else device)
