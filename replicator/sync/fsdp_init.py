"""shard="parameters" on a model built on the meta device: each unit given values, initialised and sharded in turn.

A model too big for one replica is built in `repl.scope()` under `with torch.device("meta"):`, the
way torch's FSDP2 and the pipelines (replicator.pipeline.materialize) take one: shapes, no values.
When the block ends, every replica walks the module tree in the order in which building it for
real ran the modules' `reset_parameters()` (children before their parent, as torch's layers call
their own at the end of `__init__`). Each module's own tensors get storage on this replica's
device (the same Parameter objects, so optimizers built over them keep them), filled with NaN, and
its `reset_parameters()` runs; when the walk leaves a *unit* (what the shard policy picks, then the
root), the unit's tensors are copied from replica 0 (as the scope does for a whole model) and the
unit is passed to FSDP2's `fully_shard`, which keeps this replica's shard; the whole tensors are then
freed. Memory: the shards so far plus the unit being built, never the whole model. The random
generator passes through the states of a whole build, so the values are bit for bit those of
building the model on the device and sharding it (the generator of every replica ends where its
whole build would leave it, too).

A tensor that no `reset_parameters()` sets (a parameter created with `torch.ones` in a module
without one, a buffer computed in `__init__`) still holds NaN: that raises on every replica, naming
it. Initialisation must live in the modules' `reset_parameters()`; code in the scope that writes
values into a meta model writes nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from replicator.comm.agreement import Agreement
from replicator.errors import ReplicatorUsageError
from replicator.identity import require_same_layout
from replicator.pipeline.materialize import give_storage, is_meta
from replicator.sync.fsdp import ShardPolicy, child_units, is_sharded

__all__ = ["build_sharded", "is_meta"]


def build_sharded(roots: Iterable[torch.nn.Module], device: torch.device, group: dist.ProcessGroup | None,
                  source: int, agreement: Agreement, policy: ShardPolicy | None,
                  names: dict[int, str]) -> dict[int, torch.nn.Parameter]:
    """Give the meta `roots` values unit by unit (sharding each when `group` has several replicas).

    Returns each replaced parameter's sharded successor, by id (empty on one replica: the
    parameters are given values in place). `names` names the tensors in errors; `source` is
    replica 0's global rank.
    """
    replicas = 1 if group is None else dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, device.type) if group is not None and replicas > 1 else None
    successors: dict[int, torch.nn.Parameter] = {}
    for root in roots:
        named = [(names.get(id(t), f"{type(root).__name__} tensor {i}"), t)
                 for i, t in enumerate(itertools.chain(root.parameters(), root.buffers()))]
        # Before any values move: replicas with different models would broadcast into tensors of other sizes.
        require_same_layout(agreement, named, "at the end of repl.scope() (a model on the meta device)", _SAME_MODEL)
        real = [name for name, tensor in named if not tensor.is_meta]
        if real:
            raise ReplicatorUsageError(
                f"{_listed(real)} of a model built partly on the meta device {'is' if len(real) == 1 else 'are'} not "
                "on it: build every module of the model under `with torch.device(\"meta\"):` or none (a module "
                "built for real drew its random numbers when it was built, so the others could not replay a whole "
                "build's)")
        _Builder(root, device, group, source, mesh, policy or child_units, names, successors).visit(root)
    return successors


class _Builder:
    """One root's walk: modules in reset_parameters() order, each unit copied and sharded as the walk leaves it."""

    def __init__(self, root: torch.nn.Module, device: torch.device, group: dist.ProcessGroup | None, source: int,
                 mesh: DeviceMesh | None, policy: ShardPolicy, names: dict[int, str],
                 successors: dict[int, torch.nn.Parameter]) -> None:
        self.root = root
        self.device = device
        self.group = group
        self.source = source
        self.mesh = mesh
        self.names = names
        self.successors = successors
        self.units = {id(module) for name, module in root.named_modules() if name and policy(name, module)}
        self.seen: set[int] = set()
        self.copied: set[int] = set()

    def visit(self, module: torch.nn.Module) -> None:
        if id(module) in self.seen:  # a module reached twice (shared) was built, and initialised, once
            return
        self.seen.add(id(module))
        for child in module.children():
            self.visit(child)
        give_storage(module, self.device)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if module is self.root or id(module) in self.units:
            self._finish_unit(module)

    def _finish_unit(self, unit: torch.nn.Module) -> None:
        """Copy replica 0's values of the unit's plain tensors, check them, and shard the unit."""
        tensors = [t for t in itertools.chain(unit.parameters(), unit.buffers())
                   if not is_sharded(t) and id(t) not in self.copied]
        self.copied.update(id(t) for t in tensors)
        if self.mesh is not None:
            with torch.no_grad():  # in place, tensor by tensor: no flat copy of the unit next to it
                for tensor in tensors:
                    dist.broadcast(tensor.detach(), src=self.source, group=self.group)
        # Replica 0's values everywhere now: every replica reaches the same verdict.
        unset = [self.names.get(id(t), f"a tensor of shape {tuple(t.shape)}") for t in tensors
                 if (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any())]
        if unset:
            verb = "has" if len(unset) == 1 else "have"
            raise ReplicatorUsageError(
                f"{_listed(unset)} of {type(unit).__name__} (built on the meta device) {verb} no values once its "
                "modules' reset_parameters() ran at the end of repl.scope(): give the module "
                "that creates it a reset_parameters() that sets every parameter and buffer it owns (torch's layers "
                "have one; FSDP2 asks the same of a meta model), or build the model on a real device")
        if self.mesh is None:
            return
        slots = [(module, key, param) for module in unit.modules() for key, param in module._parameters.items()
                 if param is not None and not is_sharded(param)]
        fully_shard(unit, mesh=self.mesh)
        for module, key, param in slots:
            self.successors[id(param)] = module._parameters[key]  # type: ignore[assignment]
            # An optimizer built in the scope still holds the whole parameter until the scope hands it the shard:
            # its storage goes now (the object stays, on meta, so that it can be recognised and replaced).
            torch.utils.swap_tensors(param, torch.nn.Parameter(torch.empty_like(param, device="meta"),
                                                               requires_grad=param.requires_grad))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


_SAME_MODEL = (
    "Every replica must build the same model: look for a size, a layer or an option that depends on the replica "
    "or on data only one replica reads, and build the model from values every replica has."
)
