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

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from replicator._torch_names import DTensor, FSDPModule, fully_shard
from replicator.errors import ReplicatorUsageError
from replicator.health import all_finite
from replicator.sync.state import GradientState

__all__ = ["NO_ACCUMULATION", "GradientSync", "ShardPolicy", "child_units", "clip_shards_", "is_sharded",
           "local_gradients", "shard_modules", "shards_finite", "take_sharded"]

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
        # An empty tensor (a pipeline stage without parameters offers one to its optimizer) has nothing to shard.
        plain = [name_of(param) for param in group["params"] if not is_sharded(param) and param.numel()]
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


def clip_shards_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float,
                 stages: dist.ProcessGroup | None = None) -> torch.Tensor:
    """repl.clip_grad_norm_: what torch.nn.utils.clip_grad_norm_ does on FSDP2's DTensor gradients (each replica's
    shards' norms, combined by DTensor's partial reduction), so the clip factor is plain FSDP2's to the bit. With
    `stages` (a pipeline's stage group, every member calling) the norm is the whole model's: the stages' norms
    combined, and each replica's shards scaled by its factor."""
    params = list(params)
    grads = [param.grad for param in params if param.grad is not None]
    if not grads and stages is None:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros(())
    if stages is None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=stages)
    else:
        powered = norm.to(torch.float64) ** norm_type
        dist.all_reduce(powered, group=stages)
        norm = (powered ** (1.0 / norm_type)).to(norm.dtype)
    shards = local_gradients(params)
    if shards:  # torch.nn.utils.clip_grads_with_norm_'s arithmetic, on this replica's shards
        torch._foreach_mul_(shards, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


NO_ACCUMULATION = (
    "{} with shard='parameters' and stages > 1 is not available yet: a sharded pipeline stage already gathers its "
    "units once per step and reduce-scatters them after its last micro-batch. Reach the batch with more "
    "micro-batches (chunks=) or replicas, or use shard='gradients' with accumulation")


class GradientSync:
    """shard="parameters" with accumulate(n) or no_sync(): FSDP2 reduce-scatters only in the backward pass that ends
    an update; the others add to the unsharded gradients it keeps (FSDP2's set_requires_gradient_sync), and the
    update divides the sum by the micro-steps, as the synchronizer does for the other levels.

    Whether the next backward ends an update is asked before every forward pass of a sharded root, and when no_sync()
    begins and ends (a backward may run inside it, or after a forward that did)."""

    def __init__(self, state: GradientState, wrapped: list[Any], sharding: bool, pipelined: bool) -> None:
        # wrapped: the SyncedOptimizers' WrappedOptimizers (their update counts), as they are added
        self.state, self.wrapped, self.sharding, self.pipelined = state, wrapped, sharding, pipelined
        self.roots: list[FSDPModule] = []

    def refuse_in_pipeline(self, what: str) -> None:
        if self.sharding and self.pipelined:
            raise ReplicatorUsageError(NO_ACCUMULATION.format(what))

    def add(self, roots: Iterable[torch.nn.Module]) -> None:
        for root in roots:
            if isinstance(root, FSDPModule) and root not in self.roots:
                refuse_direct_forward(root)
                if not self.pipelined:  # a sharded pipeline stage syncs its units itself (pipeline.sharded)
                    self.roots.append(root)
                    root.register_forward_pre_hook(lambda module, inputs: self.update())
        self.update()

    def update(self) -> None:
        communicates = not self.state.no_sync_depth and all(self.state.last_micro_step(w.count) for w in self.wrapped)
        for root in self.roots:
            root.set_requires_gradient_sync(communicates)

    def average(self, optimizer: torch.optim.Optimizer, micro_steps: int) -> None:
        """Before an update: the gradients FSDP2 summed over `micro_steps` backward passes, divided by them."""
        if self.sharding and micro_steps > 1:
            params = [param for group in optimizer.param_groups for param in group["params"]]
            torch._foreach_div_(local_gradients(params), float(micro_steps))


def refuse_direct_forward(root: torch.nn.Module) -> None:
    """Make `root.forward(...)` called directly (not `root(...)`) raise: it skips the hooks that gather the root's
    parameters and, after backward, reduce-scatter its gradients, so it would fail inside torch or train wrongly."""
    inside_call = [0]
    forward = root.forward

    def enter(module: torch.nn.Module, inputs: Any) -> None:
        inside_call[0] += 1

    def leave(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        inside_call[0] -= 1

    def checked_forward(*args: Any, **kwargs: Any) -> Any:
        if not inside_call[0]:
            name = type(root).__name__.removeprefix("FSDP")  # FSDP2's subclass of the model's class
            raise ReplicatorUsageError(
                f"{name}.forward() was called directly on a model sharded with shard='parameters': that skips "
                "FSDP2's hooks, which gather its parameters before forward and reduce-scatter its gradients after "
                "backward. Call the module itself: `model(x)`, not `model.forward(x)`")
        return forward(*args, **kwargs)

    root.register_forward_pre_hook(enter, prepend=True)
    root.register_forward_hook(leave, always_call=True)
    root.forward = checked_forward
