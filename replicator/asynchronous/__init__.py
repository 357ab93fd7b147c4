"""The asynchronous regimes: parameter servers in sync groups with a staleness bound, and DiLoCo."""

from replicator.asynchronous.diloco import DiLoCo, OuterOptimizer, diloco_for
from replicator.asynchronous.regime import AsyncRegime
from replicator.asynchronous.settings import AsyncSettings, check_shardable
from replicator.asynchronous.worker import ServerError

__all__ = ["AsyncRegime", "AsyncSettings", "DiLoCo", "OuterOptimizer", "ServerError", "check_shardable", "diloco_for"]
