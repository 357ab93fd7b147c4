"""The asynchronous regimes: parameter servers in sync groups with a staleness bound, DiLoCo, and actor–learner."""

from replicator.asynchronous.actor import ActorContext, ActorLearnerError
from replicator.asynchronous.diloco import OuterOptimizer
from replicator.asynchronous.joining import join_actor
from replicator.asynchronous.modes import ActorLearner, DiLoCo, ParameterServers
from replicator.asynchronous.regime import AsyncRegime
from replicator.asynchronous.replay import Replay, ReplaySample
from replicator.asynchronous.settings import AsyncSettings, check_shardable
from replicator.asynchronous.worker import ServerError

__all__ = ["AsyncRegime", "AsyncSettings", "OuterOptimizer", "ServerError", "check_shardable",
           "ParameterServers", "DiLoCo", "ActorLearner",
           "ActorContext", "ActorLearnerError", "Replay", "ReplaySample", "join_actor"]
