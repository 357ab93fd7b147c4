"""`repl.scope()`: build the model on this replica's device, with identical values on every replica."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as module_hooks
from torch.nn.parameter import is_lazy

from replicator.comm.agreement import Agreement
from replicator.errors import ReplicatorUsageError
from replicator.heap import return_freed_blocks
from replicator.identity import broadcast_from_first, require_same_layout
from replicator.sync.fsdp import ShardPolicy, is_sharded, shard_modules
from replicator.sync.fsdp_collectives import FsdpCollectives, custom_collectives_available
from replicator.sync.fsdp_init import build_sharded, is_meta
from replicator.topology import Mesh, ProcessGroups

if TYPE_CHECKING:
    from replicator.job import Job

__all__ = ["ModelScope"]


class _Block:
    """What was built inside one `repl.scope()` block: modules and their tensors."""

    def __init__(self) -> None:
        self.modules: dict[int, torch.nn.Module] = {}
        self.children: set[int] = set()

    def saw_tensor(self, module: torch.nn.Module, name: str, tensor: Any) -> None:
        self.modules.setdefault(id(module), module)

    def saw_child(self, parent: torch.nn.Module, name: str, child: Any) -> None:
        self.modules.setdefault(id(parent), parent)
        if child is not None:
            self.modules.setdefault(id(child), child)
            self.children.add(id(child))

    def forget(self, dropped: Callable[[torch.nn.Module], bool]) -> None:
        """Stop watching the modules for which `dropped` is true (and their ids, which Python may reuse)."""
        for key, module in list(self.modules.items()):
            if dropped(module):
                del self.modules[key]
                self.children.discard(key)

    def roots(self) -> list[torch.nn.Module]:
        return [m for key, m in self.modules.items() if key not in self.children]

    def names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for root in self.roots():
            prefix = type(root).__name__
            for name, tensor in [*root.named_parameters(prefix=prefix), *root.named_buffers(prefix=prefix)]:
                names.setdefault(id(tensor), name)
        return names


class ModelScope:
    """The modules built in `repl.scope()` blocks, with their tensors' names for error messages."""

    def __init__(self, groups: ProcessGroups, device: torch.device, agreement: Agreement,
                 shard: str | None = None, job: Job | None = None) -> None:
        self.groups = groups
        self.shard = shard  # "parameters": the block's modules are sharded with FSDP2 when it ends
        self.job = job  # its timeout, and its close() for the sharded units' collectives
        if shard == "parameters" and device.type == "cpu":
            return_freed_blocks()  # else the units' gathered blocks stay resident (replicator.heap)
        self.collectives: FsdpCollectives | None = None  # built when the first block is sharded
        self.agreement = agreement  # among this stage's replicas, who build and copy the same model
        self.mesh: Mesh = groups.mesh
        self.device = device
        self.modules: list[torch.nn.Module] = []
        self.tensor_names: dict[int, str] = {}
        self._open: _Block | None = None

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def names(self) -> dict[int, str]:
        """Names of the tensors built so far, the open block's included."""
        return {**(self._open.names() if self._open else {}), **self.tensor_names}

    @contextlib.contextmanager
    def block(self, optimized: Callable[[], Iterable[torch.Tensor]],
              sharded: Callable[[dict[int, torch.nn.Parameter], list[torch.nn.Module]], None] = lambda *_: None,
              policy: ShardPolicy | None = None) -> Iterator[None]:
        """Watch what is built; at the end move it to the device and copy replica 0's values everywhere.

        The tensors that `optimized()` returns when the block ends (the wrapped optimizers'
        parameters, some perhaps built before it) are checked and copied too. With shard="parameters"
        the block's modules are then sharded (units chosen by `policy`, replicator.sync.fsdp), and
        `sharded(successors)` puts the sharded parameters in the wrapped optimizers.
        """
        if self._open is not None:
            raise ReplicatorUsageError("repl.scope() is already open; scopes do not nest")
        if policy is not None and self.shard != "parameters":
            raise ReplicatorUsageError(
                f"repl.scope(shard_policy=...) picks the units that shard='parameters' shards, but this Replicator "
                f"has shard={self.shard!r}; pass rp.Replicator(shard='parameters'), or drop shard_policy")
        block = _Block()
        self._open = block
        handles = [
            module_hooks.register_module_parameter_registration_hook(block.saw_tensor),
            module_hooks.register_module_buffer_registration_hook(block.saw_tensor),
            module_hooks.register_module_module_registration_hook(block.saw_child),
        ]
        placement = torch.device(self.device) if self.device.type != "cpu" else contextlib.nullcontext()
        try:
            with placement:
                yield
        finally:
            for handle in handles:
                handle.remove()
            self._open = None
        successors = self._build_meta(block, policy)
        self._finish(block, [t for t in optimized() if id(t) not in successors])
        if self.shard == "parameters" and self.groups.replica is not None and self.mesh.num_replicas > 1:
            successors.update(shard_modules(block.roots(), self.groups.replica, self.device, policy))
            for old, new in successors.items():  # the sharded parameters keep the names errors give
                if old in self.tensor_names:
                    self.tensor_names[id(new)] = self.tensor_names[old]
            self._plug_collectives(block.roots())
            sharded(successors, block.roots())

    def _plug_collectives(self, roots: list[torch.nn.Module]) -> None:
        """shard="parameters": the units' all-gathers and reduce-scatters on replicator's collectives, each agreed on
        by the replicas first (replicator.sync.fsdp_collectives); FSDP2's own where torch cannot replace them."""
        if self.job is None or not custom_collectives_available():
            return
        if self.collectives is None:  # every replica shards its first block at the same point: build it together
            self.collectives = FsdpCollectives.build(self.groups, self.device, self.agreement, self.job.timeout_s)
            self.job.close_with(self.collectives)
        self.collectives.plug(roots)

    def _build_meta(self, block: _Block, policy: ShardPolicy | None) -> dict[int, torch.nn.Parameter]:
        """shard="parameters": give the modules built on the meta device values unit by unit (sync.fsdp_init).

        Returns the sharded successors of the parameters it replaced. Other levels hold the whole model on every
        replica anyway: there a meta model is refused (_refuse_meta) as before.
        """
        meta = [root for root in block.roots() if is_meta(root)]
        if self.shard != "parameters" or not meta:
            return {}
        names = block.names()
        self.tensor_names.update(names)  # the sharded successors are named after them below
        return build_sharded(meta, self.device, self.groups.replica, self.mesh.replica_ranks[0], self.agreement,
                             policy, names)

    def keep_stage(self, layers: torch.nn.Module | Iterable[torch.nn.Module], stage: torch.nn.Module) -> None:
        """Forget every module of `layers` outside `stage`, and every module holding one, once a pipeline is cut.

        What the scope keeps lives as long as the Replicator: kept, the other stages' layers
        would stay in memory in every process.
        """
        kept = {id(m) for m in stage.modules()}
        whole = [layers] if isinstance(layers, torch.nn.Module) else list(layers)
        others = {id(m) for layer in whole for m in layer.modules()} - kept

        def dropped(module: torch.nn.Module) -> bool:
            return any(id(m) in others for m in module.modules())

        gone = {id(t) for m in self.modules if dropped(m) for t in [*m.parameters(), *m.buffers()]}
        self.modules[:] = [m for m in self.modules if not dropped(m)]  # in place: the optimizers' state shares it
        for key in gone & self.tensor_names.keys():  # in place too: the guard and the optimizers read this dict
            del self.tensor_names[key]
        if self._open is not None:
            self._open.forget(dropped)

    def _finish(self, block: _Block, extra_tensors: Iterable[torch.Tensor]) -> None:
        roots = block.roots()
        self._refuse_meta(roots)
        for root in roots:
            if not any(is_sharded(p) for p in root.parameters()):  # a meta model was built sharded, on the device
                root.to(self.device)
        self.modules.extend(root for root in roots if all(root is not m for m in self.modules))
        self.tensor_names.update(block.names())
        tensors: dict[int, torch.Tensor] = {}
        for root in roots:
            for tensor in [*root.parameters(), *root.buffers()]:
                tensors[id(tensor)] = tensor
        for tensor in extra_tensors:
            tensors.setdefault(id(tensor), tensor)
        # Shards (shard="parameters") of a model an earlier block built were copied before it was sharded, and
        # every replica holds other ones: nothing to copy.
        plain = [tensor for tensor in tensors.values() if not is_sharded(tensor)]
        self._copy_from_first(plain, "at the end of repl.scope()")

    def _refuse_meta(self, roots: list[torch.nn.Module]) -> None:
        """Raise, naming the first tensor, if a module built in the block has no values (the meta device)."""
        for root in roots:
            for name, tensor in [*root.named_parameters(prefix=type(root).__name__),
                                 *root.named_buffers(prefix=type(root).__name__)]:
                if tensor.is_meta:
                    raise ReplicatorUsageError(
                        f"{name} is on the meta device (a shape, no values) at the end of repl.scope() (replica "
                        f"{self.mesh.replica_id}): pass the layers to repl.pipeline(...), which gives each stage's "
                        "layers values, or give the model values inside the block: "
                        "model.to_empty(device=repl.device), then initialise it (e.g. its reset_parameters()); or "
                        "shard it: rp.Replicator(shard='parameters') gives a meta model values unit by unit"
                    )

    def adopt(self, tensors: list[torch.Tensor], where: str) -> None:
        """Give tensors that join after repl.scope() (an optimizer's new parameter group) replica 0's values.

        Inside an open scope nothing is copied yet: the block's end copies them with the rest.
        """
        for module in self.modules:  # a new part of a built model (a swapped head) is named after it
            for name, param in module.named_parameters(prefix=type(module).__name__):
                self.tensor_names.setdefault(id(param), name)
        if not self.is_open:
            self._copy_from_first(tensors, where)

    def _copy_from_first(self, tensors: list[torch.Tensor], where: str) -> None:
        self.check_placement(tensors, where)
        if self.mesh.num_replicas == 1:
            return
        names = self.names()
        named = [(names.get(id(t), f"<tensor {i}>"), t) for i, t in enumerate(tensors)]
        require_same_layout(self.agreement, named, where, _SAME_MODEL)
        # Lazy tensors have no values to copy. Raised once the layouts agreed, so on every replica.
        self._refuse_lazy(named, where, "before the block ends")
        broadcast_from_first(tensors, self.groups.replica, self.mesh.replica_ranks[0])

    def check_wrappable(self, optimizer: object) -> None:
        """Raise unless `optimizer` is wrapped inside a scope and its parameters are ready to synchronize."""
        if not self.is_open:
            raise ReplicatorUsageError(
                f"wrap_optimizer() was called outside repl.scope() (replica {self.mesh.replica_id}); create the model "
                "and wrap its optimizer inside `with repl.scope():` so that every replica starts identical"
            )
        if isinstance(optimizer, torch.optim.Optimizer):
            self.tensor_names.update(self.names())
            params = [p for group in optimizer.param_groups for p in group["params"]]
            # Lazy parameters cannot be given a place in the gradient buckets replicas average.
            self._refuse_lazy([(self.tensor_names.get(id(p), "a parameter"), p) for p in params],
                              "in wrap_optimizer()", "before repl.wrap_optimizer()")
            # shard="parameters" gives a model built on the meta device values when the block ends.
            self.check_placement([p for p in params if not (p.is_meta and self.shard == "parameters")],
                                 "in wrap_optimizer()")

    def _refuse_lazy(self, named: list[tuple[str, torch.Tensor]], where: str, when: str) -> None:
        lazy = [name for name, tensor in named if is_lazy(tensor)]
        if lazy and self.mesh.num_replicas > 1:
            raise ReplicatorUsageError(
                f"{', '.join(lazy)} {'has' if len(lazy) == 1 else 'have'} no shape yet (a lazy module such as "
                f"nn.LazyLinear) {where}, so replicas cannot start from replica 0's values (raised on replica "
                f"{self.mesh.replica_id}): run one forward inside repl.scope() (model(sample_batch)) {when}"
            )

    def check_placement(self, tensors: Iterable[torch.Tensor], where: str) -> None:
        """Raise, naming the tensor, if one is not on this replica's device."""
        for tensor in tensors:
            if is_lazy(tensor):
                continue  # on one replica it trains as in plain PyTorch: its first forward gives it a shape
            if tensor.device != self.device:
                name = self.names().get(id(tensor))
                raise ReplicatorUsageError(
                    f"{name or 'a parameter of shape ' + str(tuple(tensor.shape))} is on {tensor.device} but replica "
                    f"{self.mesh.replica_id} runs on {self.device} ({where}); "
                    + (_META_HINT if tensor.is_meta else "create the model inside repl.scope() or move it with "
                       "model.to(repl.device) before wrapping its optimizer")
                )


_META_HINT = (
    "a model built on the meta device has no values yet: wrap the optimizer over pipe.parameters() of the stage "
    "repl.pipeline(layers) returns (it gives this stage's layers values), or over a model given values with "
    "model.to_empty(device=repl.device) and initialised; or shard it: rp.Replicator(shard='parameters') gives a "
    "meta model values unit by unit"
)

_SAME_MODEL = (
    "Every replica must build the same model: look for a size, a layer or an option that depends on the replica "
    "or on data only one replica reads (a config file, a vocabulary built from the local shard), and build the "
    "model from values every replica has."
)
