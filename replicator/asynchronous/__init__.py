"""The asynchronous regime: parameter servers and sync groups with a staleness bound (docs/asynchronous.md)."""

from replicator.asynchronous.regime import AsyncRegime
from replicator.asynchronous.settings import AsyncSettings, check_shardable
from replicator.asynchronous.worker import ServerError

__all__ = ["AsyncRegime", "AsyncSettings", "ServerError", "check_shardable"]
