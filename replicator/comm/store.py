"""The job's key-value store: the launcher's rendezvous store, which every process of the job reaches."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["job_store"]


def job_store() -> dist.Store:
    """The store of the job's default process group (torch keeps no public accessor for it)."""
    return dist.distributed_c10d._get_default_store()
