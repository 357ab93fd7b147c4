"""What a Replicator's checkpoint holds: its modules by name, optimizers, schedulers, layout and group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from replicator.checkpoint.layout import Layout
from replicator.errors import ReplicatorUsageError
from replicator.topology import Mesh

__all__ = ["training_objects"]


def training_objects(stage_modules: list[torch.nn.Module], modules: list[torch.nn.Module],
                     optimizers: list[torch.optim.Optimizer], schedulers: list[Any], mesh: Mesh,
                     group: dist.ProcessGroup | None, states: Sequence[Any] = ()) -> dict[str, Any]:
    """The keyword arguments of checkpoint.save/restore for a job's trained objects.

    `stage_modules` (this process's pipeline stages) take the place of `modules` (those built
    in repl.scope()) when there are any. `states` (fp16's loss scale) are kept after the LR
    schedulers, as they are: objects with a JSON state_dict that step with the updates.
    """
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
    return {"modules": named, "optimizers": optimizers, "schedulers": [*schedulers, *states],
            "layout": Layout.of(mesh), "group": group}
