"""The actor–learner job's roles: learners first, then actors, then the evaluator, checked alike on every process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replicator.errors import ReplicatorUsageError
from replicator.topology import discover

__all__ = ["Roles", "shards_fed_by"]

MODE = "actor_learner"


@dataclass(frozen=True)
class Roles:
    """`Replicator(mode="actor_learner", actors=A, evaluator=E)` in a job of `world_size` processes.

    Ranks [0, L) are learners (one synchronous replica group), [L, L + A) actors and, with an
    evaluator, rank L + A. Actors and the evaluator share one index space (the evaluator's is
    A), which names them in heartbeats, tickets and reports. The job's Mesh sees the A + E
    non-learners as its `servers` and the learners as one sync group, so the existing role
    groups apply: the step loop's checks and gradient averaging stay among the learners.
    """

    learners: int
    actors: int
    evaluator: bool
    rank: int

    @classmethod
    def of(cls, mode: str, actors: int, evaluator: bool, stages: int,
           world_size: int | None = None, rank: int | None = None) -> Roles | None:
        """The roles of mode="actor_learner" (None for other modes), or a ReplicatorUsageError saying what to change.

        Every process has the same arguments and world size, so every process raises alike,
        before any process group exists."""
        topology = discover()
        world_size = topology.world_size if world_size is None else world_size
        rank = topology.rank if rank is None else rank
        if mode != MODE:
            if actors or evaluator:
                raise ReplicatorUsageError(
                    f"actors={actors} and evaluator={evaluator} belong to mode='actor_learner': pass the mode too")
            return None
        if stages > 1:
            raise ReplicatorUsageError(
                f"mode='actor_learner' with stages={stages} is not supported yet: learners train whole models "
                "replicated; use stages=1")
        if actors < 1:
            raise ReplicatorUsageError(
                f"mode='actor_learner' needs actors >= 1, got actors={actors}: actors are the processes that step "
                "environments and fill the replay; with none the learners would wait forever")
        others = actors + int(evaluator)
        if others >= world_size:
            raise ReplicatorUsageError(
                f"actors={actors}{' + an evaluator' if evaluator else ''} leave no learner in a job of {world_size} "
                f"process(es): launch at least {others + 1} processes (replicator launch -n {others + 1}) or ask "
                "for fewer actors")
        return cls(world_size - others, actors, bool(evaluator), rank)

    # -- who is who ------------------------------------------------------------------------------
    @property
    def others(self) -> int:
        """The processes that are not learners: actors and the evaluator."""
        return self.actors + int(self.evaluator)

    @property
    def role(self) -> str:
        if self.rank < self.learners:
            return "learner"
        return "actor" if self.rank < self.learners + self.actors else "evaluator"

    @property
    def index(self) -> int:
        """This process's index among the learners, or among the actors (the evaluator's is `actors`)."""
        return self.rank if self.rank < self.learners else self.rank - self.learners

    def actor_rank(self, index: int) -> int:
        return self.learners + index

    def name(self, index: int) -> str:
        """'actor 1 (rank 3)' or 'the evaluator (rank 4)'."""
        what = "the evaluator" if index == self.actors else f"actor {index}"
        return f"{what} (rank {self.actor_rank(index)})"

    def describe(self) -> str:
        """This process, in words: 'learner 0 (rank 0)', 'actor 1 (rank 3)'."""
        if self.role == "learner":
            return f"learner {self.index} (rank {self.rank})"
        return self.name(self.index)

    def job_shape(self) -> dict[str, Any]:
        """Job.start's arguments: the non-learners as the Mesh's serving ranks, the learners as its one sync group."""
        return {"serving": self.others, "group_size": self.learners, "role_names": ("learner", "actor")}


def shards_fed_by(actor: int, live: list[int], learners: int) -> list[int]:
    """The replay shards (learners) that `actor` sends its transitions to, given the actors still alive.

    With every actor alive, actor i feeds shard i % L. When actors die, the survivors are
    numbered again so that every shard keeps a feeder: with fewer live actors than shards,
    each feeds several (in turn), so no learner waits forever for a dead actor's data.
    """
    if actor not in live:
        return [actor % learners]
    position, count = live.index(actor), len(live)
    if count >= learners:
        return [position % learners]
    return [shard for shard in range(learners) if shard % count == position]
