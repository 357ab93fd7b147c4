"""The asynchronous regimes: parameter servers in sync groups with a staleness bound, DiLoCo, and actor–learner."""

from replicator.asynchronous.actor_learner.actor import ActorContext, ActorLearnerError
from replicator.asynchronous.actor_learner.joining import join_actor
from replicator.asynchronous.actor_learner.replay import Replay, ReplaySample
from replicator.asynchronous.diloco import OuterOptimizer
from replicator.asynchronous.modes import ActorLearner, DiLoCo, ParameterServers
from replicator.asynchronous.parameter_server.regime import AsyncRegime
from replicator.asynchronous.parameter_server.settings import AsyncSettings, check_shardable
from replicator.asynchronous.parameter_server.worker import ServerError

__all__ = ["AsyncRegime", "AsyncSettings", "OuterOptimizer", "ServerError", "check_shardable",
           "ParameterServers", "DiLoCo", "ActorLearner",
           "ActorContext", "ActorLearnerError", "Replay", "ReplaySample", "join_actor"]
