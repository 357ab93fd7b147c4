"""Internal: the variable source. Learners copy their modules' weights for the actors that pull them; actors load them.

The learner's main thread copies the parameters and buffers of the modules built in
`repl.scope()` into flat per-dtype buffers between steps (before it draws the next batch), and
only when an actor's pull waits and the step has moved since the last copy: a learner that
nobody pulls from copies nothing. The learner's weights thread sends the newest copy; the copy
being sent is never written (the next copy goes into the other of two buffer sets).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterable

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
        # Zeroed, not empty: the pages are touched here, once, not by the first copy in the middle of training.
        return [torch.zeros(size, dtype=dtype) for size, dtype in zip(self.sizes, self.dtypes, strict=True)]

    def views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's place in `flats`, in its own shape (so one foreach copy moves them all)."""
        return [flats[b][offset:offset + numel].view(tensor.shape)
                for (b, offset, numel), tensor in zip(self.places, self.tensors, strict=True)]


class VariableSource:
    """A learner's newest copy of its weights, the learner step (`version`) it is from, and the step now (`step`)."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.layout = _Layout(module_tensors(modules))
        self.changed = threading.Condition()
        self.step = -1  # the learner's step at its last publish point
        self.version = -1  # the step of the newest copy (-1: none yet)
        self.wanted = False  # a pull waits for a copy of the step now
        self.copies = 0
        self.on_copy: Callable[[], None] | None = None  # tells the weights thread that a copy is ready
        self._sets: list[list[torch.Tensor] | None] = [None, None]
        self._views: list[list[torch.Tensor]] = [[], []]  # each set's views, made once
        self._newest = 0
        self._sending: int | None = None
        self._writing: int | None = None

    def publish(self, step: int, force: bool = False) -> bool:
        """At a publish point of the main thread (between steps): note the step; copy the weights if a pull waits for
        a newer copy than the newest (or `force`). True when it copied."""
        self.step = step
        if not force and not (self.wanted and step != self.version):
            return False
        with self.changed:
            # Never the set being sent; the older one if the newest is not being sent (it may be lent next).
            target = next(i for i in (1 - self._newest, self._newest) if i != self._sending)
            if self.version < 0:
                target = self._newest
            self._writing = target
            if self._sets[0] is None:  # both sets at the first publish (before training): no allocation later
                for index in (0, 1):
                    flats = self._sets[index] = self.layout.empty()
                    self._views[index] = self.layout.views(flats)
            views = self._views[target]
        # One call for every tensor: one release of the GIL, not one per tensor, each of which a busy service
        # thread could make the main thread wait to take back.
        with torch.no_grad():
            torch._foreach_copy_(views, self.layout.tensors)
        with self.changed:
            self._writing, self._newest, self.version, self.wanted = None, target, step, False
            self.copies += 1
            self.changed.notify_all()
        if self.on_copy is not None:
            self.on_copy()
        return True

    @property
    def fresh(self) -> bool:
        """The newest copy is of the step now (a pull can be answered without waiting for the main thread)."""
        return self.version >= 0 and self.version == self.step

    def lend(self) -> tuple[int, list[torch.Tensor]]:
        """The newest copy and its version, for the weights thread to send; give_back() once sent."""
        with self.changed:
            while self._writing == self._newest:
                self.changed.wait()
            self._sending = self._newest
            flats = self._sets[self._newest]
            assert flats is not None and self.version >= 0
            return self.version, flats

    def give_back(self) -> None:
        with self.changed:
            self._sending = None


class VariableSink:
    """An actor's side: buffers to receive a learner's copy into, and loading them into this process's modules."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.layout = _Layout(module_tensors(modules))
        self.flats = self.layout.empty()
        self._views = self.layout.views(self.flats)

    def load(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.layout.tensors, self._views)
