"""shard="parameters" (ZeRO-3): the modules built in repl.scope() wrapped with FSDP2's fully_shard, block by block.

When the scope ends (replica 0's values copied everywhere), each module built in it is cut into *units*:
by default every direct child that holds parameters, else what the user's `shard_policy(name, module)`
picks among its submodules; then the module itself takes what is left. Each unit is passed to
`torch.distributed.fsdp.fully_shard` over the replicas' process group, children before parents, so
every parameter becomes a DTensor of which this replica holds 1/N (dimension 0, padded). Forward
gathers a unit's parameters before it runs and frees them after (`reshard_after_forward=True`);
backward gathers them again and reduce-scatters the unit's gradients, averaged over the replicas:
each replica ends with its shard of the averaged gradient, and the optimizer steps its shards.

The wrapped optimizers built in the block over the model's plain parameters are given the sharded
ones in their place (so `step_fn` and the scope's code stay single-device code); an optimizer
whose parameters are not in a module sharded here (built before the model was sharded, or over
another module) is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from replicator._torch_names import DTensor, fully_shard
from replicator.errors import ReplicatorUsageError
from replicator.health import all_finite

__all__ = ["NO_ACCUMULATION", "ShardPolicy", "child_units", "clip_shards_", "is_sharded", "local_gradients",
           "shard_modules", "shards_finite", "take_sharded"]

# Which submodules of a module built in repl.scope() become their own unit: (qualified name, submodule) -> bool.
ShardPolicy = Callable[[str, torch.nn.Module], bool]


def child_units(name: str, module: torch.nn.Module) -> bool:
    """The default policy: every direct child that holds parameters (a transformer's blocks, a Sequential's layers)."""
    return "." not in name and any(True for _ in module.parameters())


def is_sharded(tensor: torch.Tensor) -> bool:
    """Is this a parameter (or state) that shard="parameters" cut into DTensor shards?"""
    return isinstance(tensor, DTensor)


def shard_modules(roots: Iterable[torch.nn.Module], group: dist.ProcessGroup, device: torch.device,
                  policy: ShardPolicy | None) -> dict[int, torch.nn.Parameter]:
    """fully_shard each root's units, then the root; returns each replaced parameter's sharded successor, by id."""
    mesh = DeviceMesh.from_group(group, device.type)
    policy = policy or child_units
    successors: dict[int, torch.nn.Parameter] = {}
    for root in roots:
        slots = [(module, key, param) for module in root.modules() for key, param in module._parameters.items()
                 if param is not None and not is_sharded(param)]
        if not slots:
            continue
        # Reversed pre-order: a unit's own units are sharded before it, as fully_shard requires.
        units = [module for name, module in reversed(list(root.named_modules())) if name and policy(name, module)]
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(root, mesh=mesh)
        for module, key, param in slots:
            successors[id(param)] = module._parameters[key]  # type: ignore[assignment]
    return successors


def take_sharded(optimizer: torch.optim.Optimizer, successors: dict[int, torch.nn.Parameter],
                 name_of: Callable[[Any], str]) -> None:
    """Put the sharded parameters in place of the plain ones in `optimizer`'s groups; refuse what cannot be."""
    if optimizer.state:
        raise ReplicatorUsageError(
            f"{type(optimizer).__name__} already holds state for the parameters of the model as it was before "
            "shard='parameters' sharded it at the end of repl.scope(); wrap a fresh optimizer in the scope (its state "
            "is then built over the shards), and restore saved state with repl.restore()")
    for group in optimizer.param_groups:
        group["params"] = [successors.get(id(param), param) for param in group["params"]]
        plain = [name_of(param) for param in group["params"] if not is_sharded(param)]
        if plain:
            raise ReplicatorUsageError(
                f"{', '.join(plain[:3])} of {type(optimizer).__name__} {'is' if len(plain) == 1 else 'are'} not a "
                "parameter of a module built in this repl.scope() block, so shard='parameters' did not shard "
                f"{'it' if len(plain) == 1 else 'them'}: the optimizer was built before the model was sharded (in "
                "another block) or over tensors of no module. Build the model and its optimizer in the same "
                "`with repl.scope():` block, over model.parameters()")


def local_gradients(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """This replica's shards of the sharded parameters' averaged gradients (views: scaling them scales the DTensor)."""
    return [param.grad.to_local() for param in params if isinstance(param.grad, DTensor)]


def shards_finite(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> bool:
    """nonfinite="skip": are the averaged gradients finite? Each replica judges its shards; all share the verdict."""
    device = params[0].device if params else torch.device("cpu")
    flag = torch.tensor(float(all_finite(local_gradients(params))), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag)


def clip_shards_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """repl.clip_grad_norm_: what torch.nn.utils.clip_grad_norm_ does on FSDP2's DTensor gradients (each replica's
    shards' norms, combined by DTensor's partial reduction), so the clip factor is plain FSDP2's to the bit."""
    params = list(params)
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


NO_ACCUMULATION = (
    "{} with shard='parameters' is not available yet: FSDP2 reduce-scatters the gradients of every backward pass, so "
    "an accumulation would sum averages instead of averaging micro-batches. Reach the batch with more replicas or "
    "a larger per-replica batch, or use shard='gradients' with accumulation")
