"""Numerical health across replicas: finite losses and gradients (identical parameters: replicator.identity)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from replicator._tree import leaves_with_paths
from replicator.errors import ReplicatorUsageError

__all__ = ["NONFINITE_POLICIES", "check_nonfinite_policy", "OutputCheck", "all_finite"]

NONFINITE_POLICIES = ("raise", "skip", "ignore")


def check_nonfinite_policy(policy: str) -> None:
    """Raise ReplicatorUsageError unless `policy` is one of NONFINITE_POLICIES."""
    if policy not in NONFINITE_POLICIES:
        raise ReplicatorUsageError(f"nonfinite={policy!r} is not one of {NONFINITE_POLICIES}")


def _numbers(output: Any) -> Iterator[tuple[str, torch.Tensor | float]]:
    """Each floating-point tensor and float in step_fn's output (nested in dicts, lists, tuples), with where it sits."""
    if isinstance(output, torch.Tensor):  # the usual output, a loss: judged every step, so no walk for it
        if output.is_floating_point() or output.is_complex():
            yield "output", output.detach()
        return
    for where, value in leaves_with_paths(output, "output"):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() or value.is_complex():
                yield where, value.detach()
        elif isinstance(value, float):
            yield where, value


class OutputCheck:
    """Where one step's output is NaN or infinite, found without stalling the host behind a GPU.

    Host values are judged at once. A tensor on a CUDA device gets a flag computed there and
    copied into pinned host memory behind the step's own work, so `locations()` waits only
    for that copy: asked a step later, it no longer waits at all, and the host keeps queuing
    work ahead of the device as it would without the check.
    """

    def __init__(self, output: Any, step: int) -> None:
        self.step = step
        self._spots: list[str] = []
        self._on_device: list[tuple[str, torch.Tensor]] = []  # (where, pinned flag)
        self._copied: list[Any] = []  # a CUDA event after each flag's copy
        for where, value in _numbers(output):
            if isinstance(value, float):
                if not math.isfinite(value):
                    self._spots.append(where)
            elif value.device.type == "cuda":
                flag = torch.empty((), dtype=torch.bool, pin_memory=True)
                flag.copy_(torch.isfinite(value).all(), non_blocking=True)
                self._on_device.append((where, flag))
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(value.device))
                self._copied.append(event)
            elif value.numel() == 1 and not value.is_complex():  # a scalar: one read, not three tensor operations
                if not math.isfinite(value.item()):
                    self._spots.append(where)
            elif not bool(torch.isfinite(value).all()):
                self._spots.append(where)

    @property
    def waits_for_a_device(self) -> bool:
        return bool(self._copied)

    def locations(self) -> list[str]:
        for event in self._copied:
            event.synchronize()
        self._copied.clear()
        self._spots += [where for where, flag in self._on_device if not bool(flag)]
        self._on_device.clear()
        return self._spots


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element is finite; the answer costs one wait for the device, as GradScaler's does."""
    tensors = [tensor for tensor in tensors if tensor.numel()]
    if tensors and all(t.is_cuda and t.is_floating_point() and t.layout == torch.strided and not t.requires_grad
                       for t in tensors):
        # GradScaler's fused check, multiplying by exactly 1: a few kernels for all of a model's
        # gradients instead of one reduction (and one launch) per tensor.
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        found = [torch.zeros(1, device=device) for device in {device for device, _ in groups}]
        flags = {flag.device: flag for flag in found}
        for (device, _), group in groups.items():
            torch._amp_foreach_non_finite_check_and_unscale_(group, flags[device], torch.ones(1, device=device))
        return not any(bool(flag) for flag in found)
    # A float64 sum per tensor: NaN and inf survive it, and finite float32 values cannot overflow it.
    totals = [tensor.sum(dtype=torch.float64) for tensor in tensors]
    return not totals or bool(torch.isfinite(torch.stack(totals)).all())
