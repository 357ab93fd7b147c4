"""Replicas agree before they communicate, so divergence fails fast and names the culprit.

Before a collective whose partners could differ (a user's collective, the first gradient
bucket of a step, the start of a step), every replica sends a fixed-size message on the
control group: what it is about to do and from where. Because every message has the same
size, mismatched replicas still complete the exchange, see each other's intent and raise
the same clear error together instead of hanging or feeding wrong-sized buffers to Gloo.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from replicator.errors import ReplicaMismatchError

__all__ = ["Agreement", "Intent", "call_site"]

_SIGNATURE_BYTES = 256
_SITE_BYTES = 128
_VALUE_SLOTS = 16
_MESSAGE_BYTES = _SIGNATURE_BYTES + _SITE_BYTES + 8 * _VALUE_SLOTS
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def call_site() -> str:
    """'file.py:42 in step_fn' for the innermost frame outside replicator itself."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


@dataclass(frozen=True)
class Intent:
    """What one replica announced: an operation signature, its call site and a few numbers."""

    replica: int
    signature: str
    site: str
    values: tuple[float, ...]


def _encode(text: str, size: int) -> bytes:
    raw = text.encode("utf-8")[:size]
    return raw + b"\0" * (size - len(raw))


def _decode(raw: np.ndarray) -> str:
    return bytes(raw).rstrip(b"\0").decode("utf-8", errors="replace")


class Agreement:
    """Exchanges intents on a control group; a no-op for a single replica."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def exchange(self, signature: str, site: str = "", values: Sequence[float] = ()) -> list[Intent]:
        """Every replica's intent, in replica order. Raises nothing; see `require_same`."""
        if len(values) > _VALUE_SLOTS:
            raise ValueError(f"at most {_VALUE_SLOTS} values fit in an agreement message, got {len(values)}")
        padded = np.zeros(_VALUE_SLOTS, dtype=np.float64)
        padded[: len(values)] = values
        if self.group is None:
            return [Intent(0, signature, site, tuple(padded[: len(values)]))]
        message = np.frombuffer(
            _encode(signature, _SIGNATURE_BYTES) + _encode(site, _SITE_BYTES) + padded.tobytes(), dtype=np.uint8
        )
        mine = torch.from_numpy(message.copy())
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self.group)
        intents = []
        for replica, tensor in enumerate(everyone):
            raw = tensor.numpy()
            received = np.frombuffer(raw[_SIGNATURE_BYTES + _SITE_BYTES :].tobytes(), dtype=np.float64)
            intents.append(
                Intent(
                    replica,
                    _decode(raw[:_SIGNATURE_BYTES]),
                    _decode(raw[_SIGNATURE_BYTES : _SIGNATURE_BYTES + _SITE_BYTES]),
                    tuple(received[: len(values)]),
                )
            )
        return intents

    def require_same(self, signature: str, site: str = "", values: Sequence[float] = ()) -> list[Intent]:
        """Exchange intents and raise ReplicaMismatchError on every replica if signatures differ."""
        intents = self.exchange(signature, site, values)
        if any(intent.signature != intents[0].signature for intent in intents):
            raise ReplicaMismatchError(describe_mismatch(intents, self.rank))
        return intents


def describe_mismatch(intents: list[Intent], me: int) -> str:
    """A message that groups replicas by what they were doing, most common first."""
    groups: dict[str, list[Intent]] = {}
    for intent in intents:
        groups.setdefault(intent.signature, []).append(intent)
    lines = [f"replicas diverged (raised on replica {me}): they reached different collectives at the same point."]
    for signature, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        replicas = ", ".join(str(m.replica) for m in members)
        sites = sorted({m.site for m in members if m.site})
        where = f" at {'; '.join(sites)}" if sites else ""
        lines.append(f"  replica(s) {replicas}: {signature}{where}")
    lines.append(
        "Every replica must issue the same collectives in the same order: look for a collective "
        "inside a branch on replica_id or on data that differs between replicas."
    )
    return "\n".join(lines)
