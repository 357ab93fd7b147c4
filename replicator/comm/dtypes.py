"""Every dtype in every collective: moved as bytes where a backend cannot carry it, reduced wider (internal).

Gloo refuses int16, the unsigned types past uint8 and the float8 types with "Invalid scalar
type", and torch itself cannot add or compare some of them on the CPU. Moving data (gather,
broadcast, all-to-all) needs no arithmetic, so those dtypes travel as their bytes, bit for
bit. Reducing them happens in a dtype both can handle, chosen so that narrowing back gives
exactly what adding in the original dtype would (integers wrap, a maximum is one of the
inputs) or, for the float8 types, the sum rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []

# What ProcessGroupGloo carries and reduces (checked against torch 2.13; NCCL carries all of them too).
CARRIED = frozenset({
    torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.complex32, torch.complex64, torch.complex128,
})
_NARROW_INTEGERS = frozenset({torch.int16, torch.uint16, torch.uint32})
_SIGN_BIT = -(2**63)  # flipping it maps uint64's order onto int64's

Restore = Callable[[torch.Tensor], torch.Tensor]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def carried(tensor: torch.Tensor) -> bool:
    return tensor.dtype in CARRIED


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat, sharing its memory (writes land in `tensor`)."""
    return tensor.reshape(-1).view(torch.uint8)


def rows_as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as (rows, bytes per row) uint8, sharing its memory: dimension 0 is kept."""
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:])).view(torch.uint8)


def reducible(tensor: torch.Tensor, op: Any) -> tuple[torch.Tensor, Any, Restore]:
    """(`tensor` in a dtype the backend and torch can reduce with the returned op, the way back).

    Raises TypeError for what has no meaning (the maximum of complex numbers) or no exact route.
    """
    dtype = tensor.dtype
    ordered = op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN)
    if tensor.is_complex() and ordered:
        raise TypeError(f"complex numbers have no order, so there is no element-wise maximum or minimum of {dtype} "
                        "tensors: reduce their .abs() or .real instead")
    if dtype == torch.bool:
        # A sum of bools in bool is their OR (as torch.add gives); summed as bytes it would wrap at 256 replicas.
        return tensor, (dist.ReduceOp.MAX if op == dist.ReduceOp.SUM else op), _same
    if dtype in CARRIED:
        return tensor, op, _same
    if dtype in _NARROW_INTEGERS:
        # int64 holds every partial sum; converting back wraps as adding in `dtype` would.
        return tensor.to(torch.int64), op, lambda result: result.to(dtype)
    if dtype == torch.uint64:
        signed = tensor.view(torch.int64)
        if not ordered:
            return signed, op, lambda result: result.view(torch.uint64)  # two's complement: the same bits
        return signed ^ _SIGN_BIT, op, lambda result: (result ^ _SIGN_BIT).view(torch.uint64)
    if tensor.is_floating_point():  # the float8 types: float32 holds them exactly
        return tensor.to(torch.float32), op, lambda result: result.to(dtype)
    raise TypeError(f"replicator's collectives cannot reduce {dtype} tensors; convert them to a standard integer or "
                    "floating-point dtype first")
