"""`repl.scope()`: build the model on this replica's device, with identical values on every replica."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules import module as module_hooks

from replicator.errors import ReplicatorUsageError
from replicator.topology import Mesh, ProcessGroups

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

    def __init__(self, groups: ProcessGroups, device: torch.device) -> None:
        self.groups = groups
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
    def block(self, optimized: Callable[[], Iterable[torch.Tensor]]) -> Iterator[None]:
        """Watch what is built; at the end move it to the device and copy replica 0's values everywhere.

        The tensors that `optimized()` returns when the block ends (the wrapped optimizers'
        parameters, some perhaps built before it) are checked and copied too.
        """
        if self._open is not None:
            raise ReplicatorUsageError("repl.scope() is already open; scopes do not nest")
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
        self._finish(block, optimized())

    def _finish(self, block: _Block, extra_tensors: Iterable[torch.Tensor]) -> None:
        roots = block.roots()
        for root in roots:
            root.to(self.device)
        self.modules.extend(root for root in roots if all(root is not m for m in self.modules))
        self.tensor_names.update(block.names())
        tensors: dict[int, torch.Tensor] = {}
        for root in roots:
            for tensor in [*root.parameters(), *root.buffers()]:
                tensors[id(tensor)] = tensor
        for tensor in extra_tensors:
            tensors.setdefault(id(tensor), tensor)
        self.check_devices(tensors.values(), where="at the end of repl.scope()")
        if self.mesh.num_replicas > 1:
            _broadcast_from_first(list(tensors.values()), self.groups.replica, self.mesh.replica_ranks[0])

    def check_devices(self, tensors: Iterable[torch.Tensor], where: str) -> None:
        """Raise, naming the tensor, if one is not on this replica's device."""
        for tensor in tensors:
            if tensor.device != self.device:
                name = self.names().get(id(tensor))
                raise ReplicatorUsageError(
                    f"{name or 'a parameter of shape ' + str(tuple(tensor.shape))} is on {tensor.device} but replica "
                    f"{self.mesh.replica_id} runs on {self.device} ({where}); create the model inside repl.scope() "
                    f"or move it with model.to(repl.device) before wrapping its optimizer"
                )

    def named_state(self, parameters: Iterable[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """`parameters` and the built modules' buffers, each with its name, for comparing replicas."""
        named: dict[int, tuple[str, torch.Tensor]] = {}
        for param in parameters:
            named.setdefault(id(param), (self.tensor_names.get(id(param), f"parameter {tuple(param.shape)}"), param))
        for module in self.modules:
            for name, buffer in module.named_buffers():
                named.setdefault(id(buffer), (f"{type(module).__name__}.{name}", buffer))
        return list(named.values())


def _broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, source: int) -> None:
    """Overwrite every tensor with the source replica's, one message per dtype."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for kind in sorted(by_kind, key=str):
        members = by_kind[kind]
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=source, group=group)
        offset = 0
        with torch.no_grad():
            for tensor in members:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
