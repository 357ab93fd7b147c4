"""Numerical health across replicas: identical parameters and finite losses and gradients."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from replicator._tree import leaves_with_paths
from replicator.comm.agreement import Agreement
from replicator.errors import ReplicaMismatchError, ReplicatorUsageError

__all__ = ["NONFINITE_POLICIES", "check_nonfinite_policy", "fingerprint", "require_identical", "OutputCheck",
           "finite_sum"]

NONFINITE_POLICIES = ("raise", "skip", "ignore")


def check_nonfinite_policy(policy: str) -> None:
    """Raise ReplicatorUsageError unless `policy` is one of NONFINITE_POLICIES."""
    if policy not in NONFINITE_POLICIES:
        raise ReplicatorUsageError(f"nonfinite={policy!r} is not one of {NONFINITE_POLICIES}")


def fingerprint(tensor: torch.Tensor) -> int:
    """A CRC of the tensor's bytes: equal exactly when the values are bit-for-bit equal."""
    data = tensor.detach().to("cpu").reshape(-1)  # 1-d: a 0-d tensor cannot be viewed as bytes
    return zlib.crc32(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")


def require_identical(agreement: Agreement, named: list[tuple[str, torch.Tensor]], where: str) -> None:
    """Raise on every replica unless all replicas hold bit-identical `named` tensors.

    One agreement of a combined fingerprint in the common case; on a mismatch, the
    per-tensor fingerprints are gathered so the error can name the first tensors that differ.
    """
    if agreement.size == 1:
        return
    prints = [fingerprint(tensor) for _, tensor in named]
    combined = zlib.crc32(b"".join(value.to_bytes(4, "little") for value in prints))
    layout = ";".join(f"{name}{tuple(tensor.shape)}{tensor.dtype}" for name, tensor in named)
    verdict = agreement.start(f"parameters and buffers {where} ({len(named)} tensors, layout crc "
                              f"{zlib.crc32(layout.encode())})", "", [combined]).wait()
    if verdict.unanimous:
        return
    mine = torch.tensor(prints, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(agreement.size)]
    dist.all_gather(everyone, mine, group=agreement.group)
    reference = everyone[0]
    differing = {replica: [name for (name, _), a, b in zip(named, theirs.tolist(), reference.tolist()) if a != b]
                 for replica, theirs in enumerate(everyone) if not torch.equal(theirs, reference)}
    lines = [f"replicas hold different parameters or buffers {where} (raised on replica {agreement.rank}):"]
    for replica, names in differing.items():
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        lines.append(f"  replica {replica} differs from replica 0 in {shown}")
    lines.append(
        "Training them together would average gradients of different models. Build and load the model inside "
        "`with repl.scope():` (which copies replica 0's values to every replica) and do not change parameters "
        "on some replicas only (for example loading a checkpoint on replica 0 alone: use repl.restore)."
    )
    raise ReplicaMismatchError("\n".join(lines))


def _numbers(output: Any) -> Iterator[tuple[str, torch.Tensor | float]]:
    """Each floating-point tensor and float in step_fn's output (nested in dicts, lists, tuples), with where it sits."""
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


def finite_sum(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element is finite: one summing pass per tensor (NaN and inf survive a sum)."""
    totals = [tensor.sum(dtype=torch.float64) for tensor in tensors if tensor.numel()]
    return not totals or bool(torch.isfinite(torch.stack(totals)).all())
