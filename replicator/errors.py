"""The exceptions replicator raises, so users can catch them by kind."""

from __future__ import annotations

__all__ = ["ReplicatorError", "ReplicaMismatchError", "ReplicatorUsageError", "NonFiniteError"]


class ReplicatorError(RuntimeError):
    """Base class of replicator's own errors."""


class ReplicaMismatchError(ReplicatorError):
    """Replicas disagree: different collectives, step counts or batch sizes at the same point."""


class ReplicatorUsageError(ReplicatorError, ValueError):
    """The API was used in a way that cannot work; the message says how to fix it."""


class NonFiniteError(ReplicatorError):
    """A loss or an averaged gradient was NaN or infinite; raised on every replica at the same step."""
