"""replicator: write input_fn and step_fn for one device; run them on many."""

from replicator import nn
from replicator.asynchronous import (
    ActorContext,
    ActorLearner,
    ActorLearnerError,
    DiLoCo,
    ParameterServers,
    Replay,
    ReplaySample,
    join_actor,
)
from replicator.context import InputContext, ReplicaContext
from replicator.errors import NonFiniteError, ReplicaMismatchError, ReplicatorError, ReplicatorUsageError
from replicator.replicator import Replicator
from replicator.sync.precision import Precision

__all__ = [
    "Replicator",
    "Precision",
    "ParameterServers",
    "DiLoCo",
    "ActorLearner",
    "InputContext",
    "ReplicaContext",
    "ReplicatorError",
    "ReplicaMismatchError",
    "ReplicatorUsageError",
    "NonFiniteError",
    "nn",
    "Replay",
    "ReplaySample",
    "ActorContext",
    "ActorLearnerError",
    "join_actor",
]
__version__ = "0.1.0"
