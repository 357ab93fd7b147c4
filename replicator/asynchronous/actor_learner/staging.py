"""Internal: an actor's staging columns: transitions written row by row into preallocated tensors, sent as chunks.

`actor.add()` writes one row per transition, with no allocation: the observation, action and
next observation go into their columns through numpy assignment when they arrive as arrays or
CPU tensors of the job's format, which is the cost that stays per step (a few microseconds);
anything else takes the checked path (`transitions.as_tensor`, `TransitionSpec.check`), which
raises the same errors as before. A chunk on the wire is the first rows of each column, sent in
place (comm.frames takes the tensors' bytes without a copy).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replicator.asynchronous.actor_learner.transitions import TransitionSpec, as_tensor

__all__ = ["Columns", "chunk_rows"]

CHUNK_BYTES = 256 << 10  # a chunk's size on the wire, at most (one row at least)
MAX_CHUNK_ROWS = 1024


def chunk_rows(spec: TransitionSpec) -> int:
    """Rows per chunk for this transition format: about CHUNK_BYTES, between 1 and MAX_CHUNK_ROWS."""
    return max(1, min(MAX_CHUNK_ROWS, CHUNK_BYTES // max(spec.nbytes, 1)))


def _numpy(column: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a column, where numpy has its dtype (not bfloat16)."""
    try:
        return column.numpy()
    except TypeError:
        return None


class Columns:
    """Up to `rows` staged transitions for one learner: observation, action, next_observation, reward, discount."""

    def __init__(self, spec: TransitionSpec, rows: int, who: str, source: str) -> None:
        self.spec, self.rows, self.who, self.source = spec, rows, who, source
        obs, act = spec.observation, spec.action
        self.observation = torch.empty((rows, *obs.shape), dtype=obs.dtype)
        self.action = torch.empty((rows, *act.shape), dtype=act.dtype)
        self.next_observation = torch.empty((rows, *obs.shape), dtype=obs.dtype)
        self.reward = torch.empty(rows, dtype=torch.float32)
        self.discount = torch.empty(rows, dtype=torch.float32)
        self.count = 0
        self._obs = _numpy(self.observation)
        self._act = _numpy(self.action)
        self._next = _numpy(self.next_observation)
        self._reward = self.reward.numpy()
        self._discount = self.discount.numpy()
        self._obs_fast = (self._obs.dtype if self._obs is not None else None, obs.shape)
        self._act_fast = (self._act.dtype if self._act is not None else None, act.shape)
        self._obs_torch = (obs.dtype, torch.Size(obs.shape))
        self._act_torch = (act.dtype, torch.Size(act.shape))

    @property
    def free(self) -> int:
        return self.rows - self.count

    def put(self, observation: Any, action: Any, reward: float, discount: float, next_observation: Any) -> None:
        """Stage one transition in the next row (the caller made room)."""
        row = self.count
        self._write(self.observation, self._obs, self._obs_fast, self._obs_torch, row, observation, "observation")
        self._write(self.action, self._act, self._act_fast, self._act_torch, row, action, "action")
        self._write(self.next_observation, self._next, self._obs_fast, self._obs_torch, row, next_observation,
                    "next_observation")
        self._reward[row] = reward
        self._discount[row] = discount
        self.count = row + 1

    def put_rows(self, observation: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, discount: torch.Tensor,
                 next_observation: torch.Tensor) -> None:
        """Stage len(observation) transitions at once (checked tensors with a leading batch dimension)."""
        start, stop = self.count, self.count + len(observation)
        self.observation[start:stop] = observation
        self.action[start:stop] = action
        self.next_observation[start:stop] = next_observation
        self.reward[start:stop] = reward
        self.discount[start:stop] = discount
        self.count = stop

    def _write(self, column: torch.Tensor, array: np.ndarray | None, fast: tuple[Any, tuple[int, ...]],
               exact: tuple[torch.dtype, torch.Size], row: int, value: Any, field: str) -> None:
        kind = type(value)
        if array is not None:
            if kind is np.ndarray and value.dtype == fast[0] and value.shape == fast[1]:
                array[row] = value
                return
            if kind is torch.Tensor and value.dtype == exact[0] and value.shape == exact[1] and \
                    value.device.type == "cpu":
                array[row] = value.detach().numpy()
                return
        tensor = as_tensor(value, field, self.who)  # the checked path: any other form, or a mismatch to name
        self.spec.check(field, tensor, self.who, self.source)
        column[row] = tensor

    def chunk(self, count: int) -> list[torch.Tensor]:
        """The first `count` staged rows of every column (views: send them before staging more)."""
        return [self.observation[:count], self.action[:count], self.next_observation[:count], self.reward[:count],
                self.discount[:count]]

    def drop(self, count: int) -> None:
        """Forget the first `count` rows (they were sent); the rest move to the front."""
        rest = self.count - count
        if rest > 0:
            for column in (self.observation, self.action, self.next_observation, self.reward, self.discount):
                column[:rest] = column[count:self.count].clone()
        self.count = max(rest, 0)
