"""Internal: torch names that moved between the versions replicator supports (torch >= 2.4), imported from one place."""

from __future__ import annotations

try:  # public from torch 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef, unused-ignore]

try:  # public from torch 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - torch 2.4 and 2.5
    from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef, attr-defined, unused-ignore]

__all__ = ["DTensor", "fully_shard"]
