"""The processes that save or restore together: their barrier, a verdict all share, DCP without warnings (internal)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch.distributed as dist

__all__: list[str] = []


def distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_in(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if distributed(group) else 0


def barrier(group: dist.ProcessGroup | None) -> None:
    if distributed(group):
        dist.barrier(group=group)


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    # DCP warns that it "assumes a single process" whenever no group is initialised: that is
    # exactly the intent of a one-process save or an evaluation-time load.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

