"""What a compressed reducer's conversions cost: the casts around each bucket's all-reduce and the sums in fp16."""

from __future__ import annotations

from dataclasses import dataclass

from replicator.plan._checks import raise_if
from replicator.plan.step import Accelerator

__all__ = ["Compression", "compression_of", "cast_bandwidth_from_memory", "FP32_BYTES"]

FP32_BYTES = 4
# A cast pass reads 4 bytes of fp32 and writes 2 of the 16-bit type per element: 1.5 bytes of memory
# traffic per byte of gradient, which is what a memory-bound pass pays for.
_TRAFFIC_PER_GRADIENT_BYTE = (FP32_BYTES + 2) / FP32_BYTES


@dataclass(frozen=True)
class Compression:
    """A 16-bit wire type ("fp16" or "bf16"), with or without error feedback, as `Replicator(reducer=...)` runs it.

    The passes follow `replicator.sync.reducers.compression.CastReducer`, which makes them on
    the reducer's thread before a bucket's all-reduce and after it: the sum is cast down
    (fp16 first scales by 1/N, so that N large gradients stay inside its range) and cast
    back up (fp16 then scales by N); error feedback adds the residual before the cast and,
    still before the all-reduce, casts what was sent back up (rescaled for fp16) and
    subtracts it to keep what was lost.
    """

    wire: str
    error_feedback: bool = False

    def __post_init__(self) -> None:
        raise_if(self.wire not in ("fp16", "bf16"), f"wire type must be 'fp16' or 'bf16', got {self.wire!r}")

    def passes(self, replicas: int) -> tuple[int, int]:
        """Elementwise passes over a bucket's fp32 gradient (before its all-reduce, after it)."""
        scaled = self.wire == "fp16" and replicas > 1
        before = after = 1 + int(scaled)
        if self.error_feedback:
            before += 3 + int(scaled)  # add the residual; cast back (and rescale); subtract
        return before, after

    def seconds(self, elements: float, replicas: int, accelerator: Accelerator) -> float:
        """Time one bucket of `elements` gradients spends converting among `replicas` (on the reducer's stream).

        The casts cost their passes at the accelerator's `cast_bandwidth`; an fp16 sum costs
        each element the all-reduce reduces ((N-1)/N of the bucket on every replica, ring or
        hierarchical alike) at its `fp16_sum_rate`. bf16 sums are as cheap as fp32's
        (bf16 widens to fp32 by a shift), so its sum is left in the wire's cost.
        """
        before, after = self.passes(replicas)
        seconds = (before + after) * elements * FP32_BYTES / accelerator.cast_bandwidth
        if self.wire == "fp16" and replicas > 1:
            seconds += elements * (replicas - 1) / replicas / accelerator.fp16_sum_rate
        return seconds


def compression_of(reducer: str) -> Compression | None:
    """The compression a runtime reducer string names ('fp16', 'bf16+ef@hierarchical', ...); None for lossless."""
    compressor = reducer.strip().lower().partition("@")[0]
    wire, _, flags = compressor.partition("+")
    if wire not in ("fp16", "bf16"):
        return None
    return Compression(wire, flags == "ef")


def cast_bandwidth_from_memory(memory_bandwidth: float) -> float:
    """Bytes of fp32 gradient per second a memory-bound cast pass converts on a device of `memory_bandwidth`."""
    raise_if(not memory_bandwidth > 0, f"memory bandwidth must be > 0 bytes/s, got {memory_bandwidth}")
    return memory_bandwidth / _TRAFFIC_PER_GRADIENT_BYTE
