"""Internal: the variable source. Learners publish a snapshot of their modules between steps; actors pull it.

The learner's main thread copies the parameters and buffers of the modules built in
`repl.scope()` into flat per-dtype buffers between steps (before it draws the next batch), and
the learner's service thread sends the newest copy to an actor that asks, so a pull never
waits for a step and never reads weights mid-update. A copy being sent is never written again:
the next publish takes fresh buffers.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterable

import torch

from replicator.identity import describe

__all__ = ["VariableSource", "VariableSink", "module_tensors"]


def module_tensors(modules: Iterable[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers of `modules`, named, each once, in the order every process builds them."""
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor]] = []
    for module in modules:
        prefix = type(module).__name__
        for name, tensor in [*module.named_parameters(prefix=prefix), *module.named_buffers(prefix=prefix)]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                named.append((name, tensor))
    return named


class _Layout:
    """Where each tensor sits in the flat buffers of its dtype, and a checksum that both sides compare."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.tensors = [tensor for _, tensor in named]
        self.dtypes: list[torch.dtype] = []
        sizes: dict[torch.dtype, int] = {}
        self.places: list[tuple[int, int, int]] = []  # (buffer, offset, numel) per tensor
        for tensor in self.tensors:
            if tensor.dtype not in sizes:
                self.dtypes.append(tensor.dtype)
                sizes[tensor.dtype] = 0
            self.places.append((self.dtypes.index(tensor.dtype), sizes[tensor.dtype], tensor.numel()))
            sizes[tensor.dtype] += tensor.numel()
        self.sizes = [sizes[dtype] for dtype in self.dtypes]
        # 31 bits: it travels in an int64 header and must compare equal on both sides.
        self.checksum = zlib.crc32("\n".join(describe(n, t) for n, t in named).encode("utf-8")) & 0x7FFFFFFF
        self.described = [describe(n, t) for n, t in named]

    def empty(self) -> list[torch.Tensor]:
        return [torch.empty(size, dtype=dtype) for size, dtype in zip(self.sizes, self.dtypes, strict=True)]

    def views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [flats[b][offset:offset + numel] for b, offset, numel in self.places]


class VariableSource:
    """A learner's newest published weights, with the learner step (`version`) they are from."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.layout = _Layout(module_tensors(modules))
        self.lock = threading.Lock()
        self.version = -1  # nothing published yet
        self._flats: list[torch.Tensor] = []
        self._taken = True

    def publish(self, version: int) -> None:
        """Copy the modules' current values (the main thread, between steps)."""
        with self.lock:
            if self._taken:  # the service thread may be sending the last copy: fill new buffers
                self._flats, self._taken = self.layout.empty(), False
            with torch.no_grad():
                for view, tensor in zip(self.layout.views(self._flats), self.layout.tensors, strict=True):
                    view.copy_(tensor.detach().reshape(-1))
            self.version = version

    def take(self) -> tuple[int, list[torch.Tensor]] | None:
        """The newest copy and its version, for the service thread to send (None before the first publish)."""
        with self.lock:
            if self.version < 0:
                return None
            self._taken = True
            return self.version, self._flats


class VariableSink:
    """An actor's side: buffers to receive a learner's copy into, and loading them into this process's modules."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.layout = _Layout(module_tensors(modules))
        self.flats = self.layout.empty()

    def load(self) -> None:
        with torch.no_grad():
            for view, tensor in zip(self.layout.views(self.flats), self.layout.tensors, strict=True):
                tensor.copy_(view.reshape(tensor.shape))
