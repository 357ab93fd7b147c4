"""What the facade's save() and restore() hand to the checkpoint: its modules, optimizers, schedulers, layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from replicator.checkpoint.layout import Layout
from replicator.errors import ReplicatorUsageError
from replicator.sync.optimizer import SyncedOptimizers
from replicator.topology import Mesh

__all__ = ["checkpoint_objects"]


def checkpoint_objects(stage_modules: Sequence[torch.nn.Module], modules: Sequence[torch.nn.Module],
                       optimizers: SyncedOptimizers, mesh: Mesh, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """The keyword arguments of checkpoint.save/restore for this process: its pipeline stages' modules when it
    has any, else the modules built in repl.scope()."""
    if stage_modules:
        # A stage keeps its layers' indices in the whole model, so the stages' keys
        # together are the unsplit model's: such a checkpoint restores without a pipeline.
        named = {("model" if i == 0 else f"model{i}"): module for i, module in enumerate(stage_modules)}
    elif len(modules) == 1:
        named = {"model": modules[0]}
    else:
        named = {f"model{i}": module for i, module in enumerate(modules)}
    if not named:
        raise ReplicatorUsageError("there is nothing to checkpoint: build the model inside `with repl.scope():`")
    return {
        "modules": named,
        "optimizers": [w.optimizer for w in optimizers.wrapped],
        "schedulers": list(optimizers.schedulers),
        "layout": Layout.of(mesh),
        "group": group,
    }
