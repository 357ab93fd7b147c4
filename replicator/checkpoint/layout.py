"""Where a process sits in the job that saves or restores (its replica and stage), and its share where peers differ."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from replicator.topology import Mesh

__all__ = ["Layout", "Share"]


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


@dataclass(frozen=True)
class Share:
    """What one process writes and loads of a checkpoint whose processes hold different state.

    Synchronous replicas hold the same state, which DCP writes once. In the asynchronous modes
    they do not: a parameter server holds the current values and optimizer state of its shard
    only, and each DiLoCo sync group its own inner optimizer state. A Share says how:

    - `owns`: the model entries it writes and the parameters (by name) whose optimizer state it
      writes and loads (None: all of them);
    - `prefixes`: per optimizer, put before its parameters' names, so that one group's state
      sits beside another's ("group1/");
    - `names`: names for tensors an optimizer updates that are in no module (DiLoCo's copy of
      the parameters at a round's start), by id;
    - `record`: the file (stem) of its optimizer and scheduler records, None for none (a peer
      writes the same);
    - `tensors`: more entries it writes as they are (state it saves for processes that do not
      write), or, when restoring, loads in place;
    - `local`: whether its own generators and input tensors are saved and restored;
    - `regime`: JSON for the job file, read back as `Restored.regime`.
    """

    owns: Callable[[str], bool] | None = None
    prefixes: tuple[str, ...] = ()
    names: Mapping[int, str] = field(default_factory=dict)
    record: str | None = None
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    local: bool = True
    regime: Mapping[str, Any] = field(default_factory=dict)

    def prefix(self, optimizer: int) -> str:
        return self.prefixes[optimizer] if optimizer < len(self.prefixes) else ""

    def has(self, name: str) -> bool:
        return self.owns is None or self.owns(name)
