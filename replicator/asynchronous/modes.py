"""A job's training mode as one object: rp.ParameterServers, rp.DiLoCo, rp.ActorLearner, or synchronous training.

The user passes a mode's config (frozen, in the manner of rp.Precision) as `Replicator(mode=...)`;
`training_mode()` checks it, alike on every process and before any process group exists, and
returns the job's `TrainingMode`: how the job is shaped, which groups average gradients and
with which reducer, and, once the model and optimizers exist, this process's regime (the one
object run(), save() and restore() hand the mode's work to). This is the one place where a
mode is chosen. The keywords that came before the config objects (mode="async",
parameter_servers=P, ...) keep working, with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from replicator.asynchronous.actor_learner.regime import ActorLearnerRegime
from replicator.asynchronous.actor_learner.roles import Roles
from replicator.asynchronous.diloco import DiLoCoRegime, OuterLoop, OuterOptimizer, check_diloco_keywords
from replicator.asynchronous.parameter_server.regime import AsyncRegime
from replicator.asynchronous.parameter_server.settings import AsyncSettings
from replicator.asynchronous.regime import Regime
from replicator.epochs import InputPosition
from replicator.errors import ReplicatorUsageError
from replicator.job import Job
from replicator.scope import ModelScope
from replicator.sync.optimizer import SyncedOptimizers
from replicator.sync.reducers import Reducer
from replicator.topology import ProcessGroups, discover

__all__ = ["ParameterServers", "DiLoCo", "ActorLearner", "OuterOptimizer", "TrainingMode", "training_mode",
           "KEYWORDS"]


@dataclass(frozen=True)
class ParameterServers:
    """Asynchronous training on parameter servers (TF-Replicator's asynchronous regime).

    The last `servers` processes hold the parameters, sharded by size, and apply the optimizer
    as gradients arrive; the others are workers in sync groups of `sync_group_size` consecutive
    ranks (synchronous inside a group, asynchronous between groups). A group's gradient is
    applied at most `max_staleness` server updates behind (0: bulk-synchronous; None: unbounded).
    """

    servers: int = 1
    sync_group_size: int = 1
    max_staleness: int | None = None
    name: ClassVar[str] = "async"


@dataclass(frozen=True)
class DiLoCo:
    """DiLoCo (arXiv 2311.08105): sync groups of `sync_group_size` train apart for `outer_every` steps, then
    `outer_optimizer(params)` (default: SGD, Nesterov momentum 0.9, lr 0.7) applies their mean pseudo-gradient."""

    outer_every: int
    sync_group_size: int = 1
    outer_optimizer: OuterOptimizer | None = None
    name: ClassVar[str] = "diloco"


@dataclass(frozen=True)
class ActorLearner:
    """Actor–learner (D4PG's layout): `actors` processes run run()'s actor_fn and fill the replay, the others learn
    from it as one synchronous replica group; with `evaluator=True` the last process evaluates the learners'
    weights."""

    actors: int
    evaluator: bool = False
    name: ClassVar[str] = "actor_learner"


Config = ParameterServers | DiLoCo | ActorLearner
# The keywords that came before the config objects, with their defaults: each belongs to one of them.
KEYWORDS: dict[str, Any] = {"sync_group_size": 1, "outer_every": None, "outer_optimizer": None,
                            "parameter_servers": 0, "max_staleness": None, "actors": 0, "evaluator": False}
_CONFIGS: dict[str, type[Config]] = {"async": ParameterServers, "diloco": DiLoCo, "actor_learner": ActorLearner}


def training_mode(mode: str | Config, stages: int, deprecated: Mapping[str, Any]) -> TrainingMode:
    """The job's mode from `mode` and the `deprecated` keywords beside it; ReplicatorUsageError, the same on every
    process, for what cannot run."""
    unknown = [key for key in deprecated if key not in KEYWORDS]
    if unknown:
        raise TypeError(f"Replicator() got an unexpected keyword argument {unknown[0]!r}")
    given = {key: value for key, value in deprecated.items() if value != KEYWORDS[key]}
    if isinstance(mode, (ParameterServers, DiLoCo, ActorLearner)):
        if given:
            raise ReplicatorUsageError(
                f"{', '.join(f'{key}=' for key in given)} cannot be given beside mode={mode!r}: set them inside "
                f"rp.{type(mode).__name__}(...)")
        return TrainingMode.checked(mode, stages)
    if given:
        config = _CONFIGS.get(mode)
        spelled = f"rp.{config.__name__}(...)" if config else "rp.ParameterServers, rp.DiLoCo or rp.ActorLearner"
        warnings.warn(f"Replicator(mode={mode!r}, {', '.join(f'{key}=...' for key in given)}) is deprecated: pass "
                      f"mode={spelled} with them inside", DeprecationWarning, stacklevel=3)
    return TrainingMode.of_keywords(mode, stages, **{**KEYWORDS, **given})


class TrainingMode:
    """One job's checked mode: its shape, the groups that average gradients, and each process's regime."""

    def __init__(self, config: Config | None, settings: AsyncSettings | None = None, roles: Roles | None = None):
        self.config, self.settings, self.roles = config, settings, roles
        self.name = config.name if config is not None else "sync"
        self._outer: OuterLoop | None = None

    @classmethod
    def checked(cls, config: Config, stages: int) -> TrainingMode:
        if isinstance(config, ParameterServers):
            settings = AsyncSettings.of("async", config.servers, config.sync_group_size, config.max_staleness, stages,
                                        servers_name="servers")
            return cls(config, settings=settings)
        if isinstance(config, ActorLearner):
            return cls(config, roles=Roles.of("actor_learner", config.actors, config.evaluator, stages))
        return cls(config)  # DiLoCo: its outer loop checks its arguments as it starts, with the job's groups

    @classmethod
    def of_keywords(cls, mode: str, stages: int, *, sync_group_size: int, outer_every: int | None,
                    outer_optimizer: OuterOptimizer | None, parameter_servers: int, max_staleness: int | None,
                    actors: int, evaluator: bool) -> TrainingMode:
        """The deprecated keywords' mode, refused with the messages they always had."""
        settings = AsyncSettings.of(mode, parameter_servers, sync_group_size, max_staleness, stages)
        roles = Roles.of(mode, actors, evaluator, stages)
        check_diloco_keywords("sync" if roles else mode, sync_group_size, outer_every, outer_optimizer,
                              discover().rank)
        if settings is not None:
            return cls(ParameterServers(parameter_servers, sync_group_size, max_staleness), settings=settings)
        if roles is not None:
            return cls(ActorLearner(actors, evaluator), roles=roles)
        if mode == "diloco":
            return cls(DiLoCo(outer_every, sync_group_size, outer_optimizer))  # type: ignore[arg-type]
        return cls(None)

    def job_shape(self) -> dict[str, Any]:
        """Job.start's role arguments: actor–learner's, or the parameter servers' and their sync groups'."""
        if self.roles is not None:
            return self.roles.job_shape()
        if self.settings is not None:
            return {"serving": self.settings.parameter_servers, "group_size": self.settings.sync_group_size}
        return {}

    def synced(self, job: Job, reducer: str | Reducer, uneven_batches: Any) -> ProcessGroups:
        """The groups whose replicas average gradients each step: DiLoCo's sync group (its outer loop starts here,
        checking its arguments on every rank), else the job's replicas."""
        if isinstance(self.config, DiLoCo):
            self._outer = OuterLoop.start(job.groups, sync_group_size=self.config.sync_group_size,
                                          outer_every=self.config.outer_every,
                                          outer_optimizer=self.config.outer_optimizer, reducer=reducer,
                                          stages=job.mesh.stages, uneven_batches=uneven_batches,
                                          timeout_s=job.timeout_s, device=job.device)
            job.close_with(self._outer.reducer)
            return self._outer.inner_groups
        return job.groups

    def reducer(self, reducer: str | Reducer) -> str | Reducer:
        """Role groups (servers' workers, learners) are not the node's processes: "auto" there sums with one
        all-reduce."""
        return "flat" if (self.settings or self.roles) and reducer == "auto" else reducer

    @property
    def replicas_share_optimizer_state(self) -> bool:
        """False for DiLoCo: each sync group keeps its own inner optimizer state."""
        return not isinstance(self.config, DiLoCo)

    def regime(self, job: Job, optimizers: SyncedOptimizers, models: ModelScope, position: InputPosition,
               trained: Callable[[], dict[str, Any]], reducer: Reducer) -> tuple[Regime, str]:
        """This process's regime and role: "learner", "actor" or "evaluator" (actor–learner), "server" or
        "worker" (parameter servers), else "replica"."""
        if self.roles is not None:
            return ActorLearnerRegime(self.roles, job, optimizers, models, position), self.roles.role
        if self.settings is not None:
            regime = AsyncRegime(self.settings, job, optimizers, position, trained)
            return regime, "server" if regime.serves else "worker"
        if self._outer is not None:
            return DiLoCoRegime(self._outer, optimizers, reducer), "replica"
        return Regime(), "replica"

