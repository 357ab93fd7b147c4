"""Where a process sits in the job that saves or restores: its replica and stage, and their counts."""

from __future__ import annotations

from typing import NamedTuple

from replicator.topology import Mesh

__all__ = ["Layout"]


class Layout(NamedTuple):
    """Where this process sits: replica `replica` of `num_replicas`, pipeline stage `stage` of `num_stages`."""

    replica: int = 0
    num_replicas: int = 1
    stage: int = 0
    num_stages: int = 1

    @classmethod
    def of(cls, mesh: Mesh) -> Layout:
        """This process's place in the job's mesh (replicas × stages)."""
        return cls(mesh.replica_id, mesh.num_replicas, mesh.stage_id, mesh.stages)

    @property
    def tag(self) -> str:
        """The name of this process's own entries in a checkpoint (its generators, its input tensors)."""
        return f"r{self.replica}s{self.stage}"
