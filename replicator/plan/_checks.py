"""The planner's input checks: one ValueError with a message naming the value, raised where a check fails."""

from __future__ import annotations

__all__ = ["raise_if"]


def raise_if(failed: bool, message: str) -> None:
    """Raise ValueError(message) when `failed`: the planner's dataclasses state each check on one line."""
    if failed:
        raise ValueError(message)
