"""What goes wrong with a checkpoint: missing or incomplete, refused, or written for another model."""

from __future__ import annotations

from replicator.errors import ReplicatorError

__all__ = ["CheckpointError", "CheckpointMismatchError"]


class CheckpointError(ReplicatorError):
    """A checkpoint is missing, incomplete, or holds something replicator refuses to load."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was written for a different model or optimizer than the one restoring it."""
