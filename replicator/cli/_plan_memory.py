"""`replicator plan`'s memory section: model state per replica for each shard level, bytes sent, a budget's fit."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from replicator.plan.memory import SHARD_LEVELS, ShardMemory, shard_memory, smallest_fitting
from replicator.plan.step import Workload

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["print_memory", "memory_record"]


def _largest_unit(workload: Workload) -> float | None:
    """Parameters of the largest layer of the model's profile (what shard="parameters" gathers whole at once),
    None when only the total is known."""
    profile = workload.profile
    return None if profile is None or len(profile.layers) < 2 else float(max(layer.params for layer in profile.layers))


def _shard_levels(workload: Workload, options: argparse.Namespace, element_bytes: int,
                  replicas: int) -> list[ShardMemory]:
    """Every shard level's memory and traffic at `replicas`, least sharded first."""
    # Layers unknown (--params): the unit is left out, as the title says, rather than taken as the whole model,
    # which would make 'parameters' look worse than 'gradients'.
    unit = _largest_unit(workload)
    return [shard_memory(level, workload.params, replicas, options.optimizer, element_bytes,
                         0.0 if unit is None else unit) for level in SHARD_LEVELS]


def _shard_argument(memory: ShardMemory | None) -> str:
    if memory is None:
        return "nothing fits"
    return "shard=None" if memory.level == "none" else f"shard={memory.level!r}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


def print_memory(workload: Workload, options: argparse.Namespace, element_bytes: int, counts: list[int],
                 console: Console) -> None:
    """The model state per replica for each shard level and the bytes each replica sends per step, by GPU count;
    with --memory-per-gpu, the least sharded level that fits."""
    from rich.table import Table

    budget = None if options.memory_per_gpu is None else options.memory_per_gpu * 1e9
    unit = _largest_unit(workload)
    unit_text = (f"'parameters' adds the unit gathered whole, the largest layer: {_gb(unit * element_bytes)}"
                 if unit is not None else "'parameters' leaves out the unit gathered whole: the layers are not "
                 "known, give --model or --model-from")
    table = Table(title=f"Model state per replica ({options.optimizer}, {options.gradient_dtype}; activations "
                        f"come on top; {unit_text})")
    table.add_column("GPUs", justify="right")
    for level in SHARD_LEVELS:
        table.add_column("shard=None" if level == "none" else f"{level!r}", justify="right")
    table.add_column("sent/step\nall-reduce", justify="right")
    table.add_column("sent/step\n'parameters'", justify="right")
    if budget is not None:
        table.add_column(f"fits {options.memory_per_gpu:g} GB", justify="left")
    for gpus in counts:
        levels = _shard_levels(workload, options, element_bytes, gpus)
        row = [str(gpus), *(_gb(memory.total) for memory in levels), _gb(levels[0].sent_bytes),
               _gb(levels[-1].sent_bytes)]
        if budget is not None:
            row.append(_shard_argument(smallest_fitting(levels, budget)))
        table.add_row(*row)
    console.print(table)
    if budget is None:
        return
    top = _shard_levels(workload, options, element_bytes, counts[-1])
    fitting = smallest_fitting(top, budget)
    if fitting is not None and fitting.level == "none":
        console.print(f"Memory: model state fits --memory-per-gpu {options.memory_per_gpu:g} GB without sharding "
                      f"({_gb(top[0].total)} per replica).")
    elif fitting is not None:
        console.print(f"Memory: model state without sharding is {_gb(top[0].total)} per replica, over "
                      f"--memory-per-gpu {options.memory_per_gpu:g} GB; at {counts[-1]} GPUs the least sharded "
                      f"level that fits is rp.Replicator({_shard_argument(fitting)}) ({_gb(fitting.total)}).")
    else:
        console.print(f"Memory: no shard level fits --memory-per-gpu {options.memory_per_gpu:g} GB at {counts[-1]} "
                      f"GPUs (shard='parameters' needs {_gb(top[-1].total)} per replica): plan for more GPUs "
                      "(--max-gpus) or split the model into pipeline stages.")


def memory_record(workload: Workload, options: argparse.Namespace, element_bytes: int, gpus: int,
                  stages: int) -> dict[str, object]:
    """The `memory` field of a --json record: per shard level at the record's replica count (gpus / stages)."""
    replicas = max(1, gpus // stages)
    levels = _shard_levels(workload, options, element_bytes, replicas)
    budget = None if options.memory_per_gpu is None else options.memory_per_gpu * 1e9
    # A replica of several pipeline stages spreads its model state over them, about evenly.
    per_gpu = [ShardMemory(m.level, m.replicas, m.parameter_bytes / stages, m.gradient_bytes / stages,
                           m.optimizer_bytes / stages, m.gathered_bytes, m.sent_bytes) for m in levels]
    fitting = None if budget is None else smallest_fitting(per_gpu, budget)
    unit = _largest_unit(workload)
    return {"replicas": replicas, "optimizer": options.optimizer, "dtype": options.gradient_dtype,
            "largest_unit_bytes": None if unit is None else unit * element_bytes,
            "bytes_per_replica": {m.level: m.total for m in levels},
            "bytes_per_gpu": {m.level: m.total for m in per_gpu},
            "sent_bytes_per_step": {m.level: m.sent_bytes for m in levels},
            "budget_bytes": budget, "smallest_fitting": None if fitting is None else fitting.level}
