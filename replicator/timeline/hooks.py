"""Forward and backward spans of the modules built in repl.scope(), through hooks installed only while recording.

A forward span runs from a top-level module's forward pre-hook to its forward hook. A backward
span starts when the gradient of such a module's output arrives (the first moment backward
works on the model) and ends after the autograd engine's final callbacks, so it includes the
gradient synchronizer's wait for the last buckets, as `loss.backward()` does for its caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from replicator._tree import tensors
from replicator.timeline.recorder import Recorder, clock

__all__ = ["ModelSpans"]


class ModelSpans:
    """Times every forward call of `modules` and every backward pass through them; `remove()` takes the hooks off."""

    def __init__(self, recorder: Recorder, modules: Iterable[torch.nn.Module]) -> None:
        self.recorder = recorder
        self._handles: list[RemovableHandle] = []
        self._calls: dict[int, list[float]] = {}  # module id -> starts of its calls in progress (nested calls)
        self._passes: dict[int, float] = {}  # autograd graph task -> when backward reached the model
        self._args: dict[int, dict[str, Any]] = {}  # module id -> its spans' arguments, made once
        for module in modules:
            self._args[id(module)] = {"module": type(module).__name__}
            self._handles.append(module.register_forward_pre_hook(self._forward_started))
            self._handles.append(module.register_forward_hook(self._forward_ended, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_started(self, module: torch.nn.Module, args: Any) -> None:
        self._calls.setdefault(id(module), []).append(clock())

    def _forward_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        starts = self._calls.get(id(module))
        if not starts:
            return
        self.recorder.add("forward", "forward", starts.pop(), clock(), args=self._args.get(id(module)))
        if torch.is_grad_enabled():
            for tensor in (output,) if isinstance(output, torch.Tensor) else tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._gradient_arrived)

    def _gradient_arrived(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task in self._passes:
            return
        self._passes[task] = clock()
        # The synchronizer queues its own final callback (the wait for the last buckets) later in
        # this pass, at the first parameter's gradient: ours re-queues itself so that it runs last.
        Variable._execution_engine.queue_callback(lambda: Variable._execution_engine.queue_callback(
            lambda: self._backward_ended(task)))

    def _backward_ended(self, task: int) -> None:
        start = self._passes.pop(task, None)
        if start is not None:
            self.recorder.add("backward", "backward", start, clock())
