"""What a pipeline schedule is made of: operations, actions on micro-batches, and the schedule itself (plain data).

A pipeline of K stages may hold V model chunks per stage (*virtual stages*): the model is
cut into K x V pieces and piece p lives on stage p % K as its chunk p // K, so a
micro-batch visits every stage V times. With V = 1 (GPipe, 1F1B) piece and stage coincide.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Op", "Action", "Schedule", "ScheduleError", "DeadlockError", "F", "B", "check_sizes"]


class Op(str, enum.Enum):
    """What one action does."""

    FORWARD = "forward"
    BACKWARD = "backward"  # input and weight gradients at once
    BACKWARD_INPUT = "backward_input"  # the input gradient only (zero-bubble schedules)
    BACKWARD_WEIGHT = "backward_weight"  # the weight gradient, after BACKWARD_INPUT
    SEND_ACTIVATION = "send_activation"
    RECV_ACTIVATION = "recv_activation"
    SEND_GRADIENT = "send_gradient"
    RECV_GRADIENT = "recv_gradient"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACTIVATION, Op.SEND_GRADIENT)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACTIVATION, Op.RECV_GRADIENT)

    @property
    def makes_input_gradient(self) -> bool:
        """A backward whose result the previous piece waits for."""
        return self in (Op.BACKWARD, Op.BACKWARD_INPUT)

    @property
    def frees_activations(self) -> bool:
        """The last pass over a micro-batch's saved activations."""
        return self in (Op.BACKWARD, Op.BACKWARD_WEIGHT)


_COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})

_SHORT = {
    Op.FORWARD: "F",
    Op.BACKWARD: "B",
    Op.BACKWARD_INPUT: "I",
    Op.BACKWARD_WEIGHT: "W",
    Op.SEND_ACTIVATION: "SA",
    Op.RECV_ACTIVATION: "RA",
    Op.SEND_GRADIENT: "SG",
    Op.RECV_GRADIENT: "RG",
}


@dataclass(frozen=True)
class Action:
    """One step of a stage: an operation on one micro-batch of one of its chunks (0 unless interleaved)."""

    op: Op
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{_SHORT[self.op]}{self.microbatch}" + (f"v{self.chunk}" if self.chunk else "")

    __repr__ = __str__


def F(i: int, chunk: int = 0) -> Action:
    return Action(Op.FORWARD, i, chunk)


def B(i: int, chunk: int = 0) -> Action:
    return Action(Op.BACKWARD, i, chunk)


class ScheduleError(ValueError):
    """A schedule is malformed: a pass missing or repeated, or out of dependency order."""


class DeadlockError(ScheduleError):
    """Simulating the schedule got stuck: every unfinished stage waits on a message never sent."""


@dataclass(frozen=True)
class Schedule:
    """The actions of every stage, in order. `stages[s]` is what stage s runs; it holds `virtual_stages` chunks."""

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]
    virtual_stages: int = 1

    def __getitem__(self, stage: int) -> tuple[Action, ...]:
        return self.stages[stage]

    @property
    def training(self) -> bool:
        """True when the schedule runs backward passes (a forward-only schedule is for evaluation)."""
        return any(a.op.is_compute and a.op is not Op.FORWARD for a in self.stages[0])

    @property
    def num_pieces(self) -> int:
        """K x V: how many pieces the model is cut into."""
        return self.num_stages * self.virtual_stages

    def piece(self, stage: int, chunk: int) -> int:
        """The position in the whole model of `stage`'s chunk `chunk`."""
        return chunk * self.num_stages + stage

    def place(self, piece: int) -> tuple[int, int]:
        """(stage, chunk) holding `piece`."""
        return piece % self.num_stages, piece // self.num_stages

    def compute_order(self, stage: int) -> list[Action]:
        """The forward and backward actions of one stage, without the communication."""
        return [a for a in self.stages[stage] if a.op.is_compute]

    def __str__(self) -> str:
        chunks = f" x {self.virtual_stages} chunks" if self.virtual_stages > 1 else ""
        lines = [f"{self.name} schedule, {self.num_stages} stages{chunks} x {self.num_microbatches} micro-batches"]
        lines += [f"  stage {s}: " + " ".join(map(str, actions)) for s, actions in enumerate(self.stages)]
        return "\n".join(lines)


def check_sizes(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"a pipeline needs at least 1 micro-batch (chunks >= 1), got {num_microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"a stage holds at least 1 model chunk (virtual_stages >= 1), got {virtual_stages}")
