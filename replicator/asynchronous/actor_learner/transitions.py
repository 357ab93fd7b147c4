"""Internal: a transition's fixed format (shapes and dtypes, set by the first one), checked on every transition.

Transitions travel from actors to replay shards as the columns of asynchronous.staging over the
peer link, never as pickled objects; the format itself travels as a line of decimal numbers
through the job's store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from replicator.errors import ReplicatorUsageError

__all__ = ["Transition", "FieldSpec", "TransitionSpec", "as_tensor", "FIELDS"]

_DTYPES: list[torch.dtype] = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                              torch.int16, torch.int8, torch.uint8, torch.bool]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}

FIELDS = ("observation", "action")  # the fields whose shape and dtype the first transition fixes


class Transition(NamedTuple):
    """One N-step transition, as the replay stores it."""

    observation: torch.Tensor
    action: torch.Tensor
    reward: float  # the discounted sum of the N rewards
    discount: float  # gamma^k to bootstrap from next_observation, 0 after a terminal step
    next_observation: torch.Tensor


def as_tensor(value: Any, field: str, who: str) -> torch.Tensor:
    """`value` (a tensor, numpy array or number) as a detached CPU copy; a clear error for anything else.

    A copy, because the N-step window keeps it for N steps and environments may reuse their buffers."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (np.ndarray, np.generic, int, float, bool)):
        return torch.from_numpy(np.array(value))
    if isinstance(value, (list, tuple)):
        try:
            return torch.from_numpy(np.array(value))
        except (TypeError, ValueError):
            pass
    raise ReplicatorUsageError(
        f"{who}: actor.add({field}=...) got a {type(value).__name__}, which is not a tensor, a numpy array or a "
        "number: pass the environment's arrays (or torch tensors) as they are")


@dataclass(frozen=True)
class FieldSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()

    def __str__(self) -> str:
        return f"shape {self.shape} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class TransitionSpec:
    """The shapes and dtypes of a transition's observation (and next observation) and action."""

    observation: FieldSpec
    action: FieldSpec

    @classmethod
    def of(cls, observation: torch.Tensor, action: torch.Tensor, who: str) -> TransitionSpec:
        for field, tensor in (("observation", observation), ("action", action)):
            if tensor.dtype not in _CODE:
                raise ReplicatorUsageError(
                    f"{who}: actor.add({field}=...) has dtype {tensor.dtype}, which the replay cannot store; use one "
                    f"of {', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
        return cls(FieldSpec(observation.dtype, tuple(observation.shape)), FieldSpec(action.dtype, tuple(action.shape)))

    def check(self, field: str, tensor: torch.Tensor, who: str, source: str) -> None:
        """Raise, naming `who` and the field, unless `tensor` matches this spec's `field`."""
        expected: FieldSpec = getattr(self, "observation" if field == "next_observation" else field)
        if tensor.dtype != expected.dtype or tuple(tensor.shape) != expected.shape:
            got = FieldSpec(tensor.dtype, tuple(tensor.shape))
            raise ReplicatorUsageError(
                f"{who}: actor.add({field}=...) has {got}, but {source} fixed {field} to {expected}. Every "
                "transition of the job must have the same shapes and dtypes (the replay keeps them in fixed-size "
                "tensors): convert in actor_fn, e.g. torch.as_tensor(x, dtype=torch.float32).reshape(...)")

    # -- as text, through the store ---------------------------------------------------------------
    def encode(self) -> str:
        return ";".join(f"{_CODE[f.dtype]}:{','.join(map(str, f.shape))}" for f in (self.observation, self.action))

    @classmethod
    def decode(cls, text: str) -> TransitionSpec:
        fields = []
        for part in text.split(";"):
            code, _, dims = part.partition(":")
            fields.append(FieldSpec(_DTYPES[int(code)], tuple(int(d) for d in dims.split(",") if d)))
        return cls(*fields)

    @property
    def nbytes(self) -> int:
        """Bytes per transition: observation, action, next observation, reward and discount (float32 each)."""
        return 2 * self.observation.nbytes + self.action.nbytes + 8
