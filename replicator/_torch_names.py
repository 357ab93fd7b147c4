"""Internal: torch names that moved between the versions replicator supports (torch >= 2.4), imported from one place."""

from __future__ import annotations

from typing import Any

try:  # public from torch 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef, unused-ignore]

try:  # public from torch 2.6
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # pragma: no cover - torch 2.4 and 2.5
    from torch.distributed._composable.fsdp import (  # type: ignore[no-redef, attr-defined, unused-ignore]
        FSDPModule,
        fully_shard,
    )

__all__ = ["DTensor", "FSDPModule", "fsdp_param_groups", "fully_shard"]


def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list from torch 2.13 (`_fsdp_param_groups`), at most one before
    (`_fsdp_param_group`, None for a unit without parameters)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [group for group in [getattr(state, "_fsdp_param_group", None)] if group is not None]
    return list(groups)
