"""Half-precision reducers: gradients travel as fp16 or bf16 (cast, sum, cast back), optionally with error feedback."""

from __future__ import annotations

import weakref

import torch

from replicator.sync.bucket import Bucket
from replicator.sync.reducers._summation import Summation
from replicator.sync.reducers._worker import BucketReducer

__all__ = ["CastReducer", "WIRE_TYPES"]

WIRE_TYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# Largest count each type holds exactly (2 ** (mantissa bits + 1)): presence slots hold
# counts of replicas, so up to this many replicas they can ride in the same message.
_EXACT_COUNTS = {torch.float16: 2048, torch.bfloat16: 256}


class CastReducer(BucketReducer):
    """Sums a bucket's gradients in a 16-bit type; the presence slots stay exact.

    With `error_feedback`, what the cast loses on this replica is kept (per bucket) and
    added to the next gradients of that bucket before they are cast, so the rounding error
    is delivered late instead of never. The rounding of the sum on the wire is not fed back.
    Buckets are keyed by identity, so one reducer may serve several optimizers.
    """

    def __init__(self, summation: Summation, wire: str, error_feedback: bool = False) -> None:
        if wire not in WIRE_TYPES:
            raise ValueError(f"wire type must be one of {sorted(WIRE_TYPES)}, got {wire!r}")
        self.summation = summation
        self.dtype = WIRE_TYPES[wire]
        self.error_feedback = error_feedback
        topology = "" if summation.name == "flat" else "@" + summation.name
        self.name = wire + ("+ef" if error_feedback else "") + topology
        # fp16 tops out at 65504: scaling by 1/N before the sum keeps N large gradients in range,
        # at the price of flushing those below ~6e-8 * N to zero (error feedback recovers them).
        # bf16 has fp32's range and needs no scaling.
        super().__init__(self.name, summation.size)
        self._prescale = self.dtype == torch.float16 and self._replicas > 1
        self._presence_on_wire = self._replicas <= _EXACT_COUNTS[self.dtype]
        self._residuals: weakref.WeakKeyDictionary[Bucket, torch.Tensor] = weakref.WeakKeyDictionary()

    def residual(self, bucket: Bucket) -> torch.Tensor | None:
        """What this replica still owes to the sum of `bucket` (None before its first reduction)."""
        return self._residuals.get(bucket)

    def _reduce(self, buffer: torch.Tensor, bucket: Bucket) -> None:
        numel = bucket.numel
        grads, presence = buffer[:numel], buffer[numel:]
        compensated = grads
        if self.error_feedback:
            residual = self._residuals.get(bucket)
            compensated = grads.clone() if residual is None else grads + residual
        wire = torch.empty(numel + (presence.numel() if self._presence_on_wire else 0), dtype=self.dtype,
                           device=buffer.device)
        wire[:numel].copy_(compensated / self._replicas if self._prescale else compensated)
        lost = None
        if self.error_feedback:
            sent = wire[:numel].to(buffer.dtype)
            lost = compensated - (sent * self._replicas if self._prescale else sent)
        if self._presence_on_wire:
            wire[numel:].copy_(presence)  # small integers: exact in the wire type
        self.summation.sum_(wire)
        if self._presence_on_wire:
            presence.copy_(wire[numel:])
        else:
            self.summation.sum_(presence)
        grads.copy_(wire[:numel])
        if self._prescale:
            grads.mul_(self._replicas)
        if lost is not None:
            # A parameter no replica produced gets grad None from the synchronizer, which drops
            # this sum: it keeps what it owed (its gradient slot was zero, so that is all it sent).
            for position, count in enumerate(presence.tolist()):
                if count == 0:
                    start = bucket.offsets[position]
                    end = start + bucket.params[position].numel()
                    lost[start:end].copy_(compensated[start:end])
            self._residuals[bucket] = lost
