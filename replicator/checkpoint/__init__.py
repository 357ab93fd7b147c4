"""Checkpoints on torch.distributed.checkpoint: atomic, resharding, loaded without unpickling code.

`save` and `restore` are the two collective verbs; the concerns they combine live below:
`files` (naming, the atomic commit, pruning, `latest`), `safe_load` (DCP's reader with
nothing unpickled), `state` (modules, optimizers and schedulers by name), `rng` (random
generators), `values` (JSON for the rest) and `collective` (the group's shared verdicts).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from replicator.checkpoint.collective import barrier, distributed, quiet_dcp, rank_in
from replicator.checkpoint.errors import CheckpointError, CheckpointMismatchError
from replicator.checkpoint.files import (
    FORMAT,
    JOB_FILE,
    PARTIAL_SUFFIX,
    commit,
    fsync_directory,
    latest,
    prune,
    read_info,
    read_json,
    step_path,
    write_json,
)
from replicator.checkpoint.layout import Layout, Share
from replicator.checkpoint.rng import fresh_seed, rng_tensors, set_rng
from replicator.checkpoint.safe_load import SafeReader, TensorsOnlyPlanner, read_index
from replicator.checkpoint.state import (
    check_model,
    listing,
    model_state,
    named_modules,
    optimizer_state,
    parameter_names,
    plan_optimizer,
    plan_schedulers,
    read_record,
    scheduler_state,
)
from replicator.checkpoint.values import from_json, plain_json, to_json
from replicator.comm.decision import everyone_agrees
from replicator.errors import ReplicatorUsageError

__all__ = [
    "Layout",
    "Share",
    "Restored",
    "CheckpointError",
    "CheckpointMismatchError",
    "save",
    "restore",
    "latest",
    "step_path",
    "prune",
    "read_info",
]


@dataclass
class Restored:
    """What `restore` hands back besides the objects it loaded in place."""

    path: Path
    step: int
    input_state: dict[str, Any]  # the job-wide part, plus this process's tensors where it had any
    extra: dict[str, Any]
    saved_layout: Layout  # replica/stage counts of the job that wrote it (replica = stage = 0)
    rng_restored: bool  # False: this process had no saved streams and was seeded afresh
    regime: dict[str, Any] = field(default_factory=dict)  # what the asynchronous modes wrote (Share.regime)


_ALONE = Layout()  # replica 0 of 1, stage 0 of 1: a job of one process

# A test hook: called on every rank once its files are written and before the commit, so a
# test can kill a process at the worst moment. Never set outside tests. It lives here, beside
# `save`, because tests set it as `replicator.checkpoint._after_write`.
_after_write: Callable[[Path], None] | None = None


def save(
    path: str | os.PathLike[str],
    *,
    modules: nn.Module | Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    step: int = 0,
    input_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    layout: Layout = _ALONE,
    group: dist.ProcessGroup | None = None,
    keep: int | None = None,
    share: Share | None = None,
) -> Path:
    """Write a checkpoint to `path` atomically; every process of `group` calls it together.

    Args:
        modules: a module (saved as "model") or {name: module}. A pipeline stage passes
            its own stage module under the name the unsplit model uses: stage modules keep
            the original layer indices, so the stages' keys together are the whole model's.
        optimizers: saved by parameter name, so they reshard and merge.
        schedulers: the optimizers' LR schedulers.
        step: the number of completed steps.
        input_state: where the input stands. JSON values (epoch, batches consumed) are the
            job's, written by rank 0; tensors (e.g. the generator state the epoch began
            with) are this process's own.
        extra: any JSON-able job metadata.
        layout: this process's replica and stage (and their counts).
        group: a process group spanning the whole job that can reduce CPU tensors (Gloo):
            Replicator's `groups.control`. None on one process.
        keep: afterwards keep only the newest `keep` checkpoints of `path`'s directory.
        share: where processes hold different state (the asynchronous modes), what this one
            writes (see Share); by default every replica writes the same and stage s's
            replica 0 its records.

    Replicated tensors (every replica has the same) are written once: DCP deduplicates
    them across the group. Files go to `<path>.partial`; after every process has written
    and a barrier, rank 0 writes the job file and renames the directory to `path`, so
    `path` exists only when complete. Returns `path`.
    """
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    share = share or Share(record=f"stage{layout.stage}" if layout.replica == 0 else None)
    rank = rank_in(group)
    failure: Exception | None = None
    try:
        if keep is not None and keep < 1:
            raise ReplicatorUsageError(f"keep must be at least 1 (the checkpoint being written), got {keep}")
        tensors, stage_record, job = _gather(modules, optimizers, schedulers, step, input_state, extra, layout, share)
    except Exception as error:  # e.g. a value JSON cannot hold: every process must learn of it, or the rest would wait
        failure = error
    if not everyone_agrees(failure is None, group):
        if failure is not None:
            raise failure
        raise CheckpointError(f"another process could not prepare checkpoint {path}; its error names the problem")

    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a previous attempt's leftovers
        partial.mkdir(parents=True)
    barrier(group)
    with quiet_dcp():
        dcp.save(tensors, storage_writer=FileSystemWriter(partial, sync_files=True),
                 process_group=group if distributed(group) else None, no_dist=not distributed(group))
    if share.record is not None:
        write_json(partial / f"{share.record}.json", stage_record)
    if _after_write is not None:
        _after_write(partial)
    barrier(group)  # every shard and stage file is on disk
    if rank == 0:
        write_json(partial / JOB_FILE, job)
        fsync_directory(partial)
        commit(partial, path)
        if keep is not None:
            prune(path.parent, keep)
    barrier(group)  # nobody returns before the checkpoint is visible
    return path


def _gather(
    modules: nn.Module | Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    step: int,
    input_state: Mapping[str, Any] | None,
    extra: Mapping[str, Any] | None,
    layout: Layout,
    share: Share,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """This process's tensors for DCP, its stage's JSON record and the job's JSON record."""
    named = named_modules(modules)
    tensors = {key: value for key, value in model_state(named).items() if share.has(key)}
    tensors.update(share.tensors)
    names = {**share.names, **parameter_names(named)}
    optimizer_records = []
    for index, optimizer in enumerate(optimizers):
        optimizer_tensors, record = optimizer_state(optimizer, names, index, share.prefix(index), share.owns)
        tensors.update(optimizer_tensors)
        optimizer_records.append(record)
    scheduler_records = [scheduler_state(scheduler, index) for index, scheduler in enumerate(schedulers)]
    local = {f"rng/{k}": v for k, v in rng_tensors().items()}
    job_input: dict[str, Any] = {}
    for key, value in (input_state or {}).items():
        if isinstance(value, torch.Tensor):
            local[f"input/{key}"] = value
        else:
            job_input[key] = to_json(value, f"input_state[{key!r}]")
    for key, value in local.items() if share.local else ():
        tensors[f"_local/{layout.tag}/{key}"] = value.detach().cpu()
    job = {
        "format": FORMAT,
        "step": int(step),
        "num_replicas": layout.num_replicas,
        "num_stages": layout.num_stages,
        "modules": sorted(named),
        "input": job_input,
        "extra": to_json(dict(extra or {}), "extra"),
        "torch": torch.__version__,
    }
    if share.regime:
        job["regime"] = plain_json(dict(share.regime), "the regime's record")  # the library's own: read as it is
    return tensors, {"optimizers": optimizer_records, "schedulers": scheduler_records}, job


def _record(path: Path, checkpoint_format: int) -> dict[str, Any]:
    """A stage's (or server's, or group's) record file: its optimizers' parameter groups and scalars, its schedulers."""
    record = read_json(path)
    try:
        return read_record(record, checkpoint_format)
    except (KeyError, TypeError, AttributeError, ValueError) as error:  # valid JSON, but not what save() writes
        raise CheckpointError(f"checkpoint file {path} is not a replicator record ({type(error).__name__}: {error}): "
                              "the file is damaged or was put there by another program") from error


def _first_failure(error: CheckpointException) -> str:
    """The first process's error in DCP's CheckpointException, as type and message."""
    for rank, (cause, _) in sorted(error.failures.items()):
        return f"{type(cause).__name__} on process {rank}: {cause}"
    return str(error)


def restore(
    path: str | os.PathLike[str],
    *,
    modules: nn.Module | Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    layout: Layout = _ALONE,
    group: dist.ProcessGroup | None = None,
    rng: bool = True,
    share: Share | None = None,
) -> Restored:
    """Load a checkpoint into the given objects in place; every process of `group` calls it.

    Any replica count and stage split can load any checkpoint of the same model:
    replicated state is read in full by every process (4 replicas → 2, → 1 for
    evaluation), and optimizer state is matched by parameter name, so a pipeline's stages
    restore into the unsplit model and back. A checkpoint of a different model raises
    CheckpointMismatchError on every process, listing the keys that differ.

    Random generators (torch, CUDA, Python, NumPy): the process at (replica r, stage s)
    gets back the streams that (r, s) saved. A process with no saved counterpart (more
    replicas than before, or a different stage split) is seeded afresh from (step, r, s)
    and `rng_restored` is False: the run is then reproducible but not identical to an
    uninterrupted one, which changing the replica count makes it anyway.

    Nothing is unpickled: tensors load with weights_only, DCP's metadata through an
    allow-list of its own record types, and everything else is JSON.

    `share` (the asynchronous modes) names the optimizer state this process loads, under which
    names, and more tensors to load in place; every process loads the whole model.
    """
    path = Path(path)
    share = share or Share()
    failure: Exception | None = None
    try:
        named = named_modules(modules)
        info = read_info(path)
        # Optimizer records merge by parameter name over every record file: stages, servers, sync groups.
        records = {p.stem: _record(p, info["format"]) for p in sorted(path.glob("*.json")) if p.name != JOB_FILE}
        stages = {int(stem[5:]): record for stem, record in records.items() if re.fullmatch(r"stage\d+", stem)}
        stored = read_index(path)
        available = stored.tensors
        target = model_state(named)
        mismatch = check_model(target, available, partial=layout.num_stages > 1)
        if mismatch:
            raise CheckpointMismatchError(f"checkpoint {path} does not match the model: {mismatch}")
        names = {**share.names, **parameter_names(named)}
        optimizer_loads = [
            plan_optimizer(optimizer, names, index, records, stored, target, share.prefix(index), share.owns)
            for index, optimizer in enumerate(optimizers)
        ]
        scheduler_states = plan_schedulers(schedulers, stages, info, layout)
        saved_layout = Layout(0, int(info["num_replicas"]), 0, int(info["num_stages"]))
        # Per-process state belongs to a (replica, stage) of the same stage split only.
        same_split = int(info["num_stages"]) == layout.num_stages
        local_prefix = f"_local/{layout.tag}/"
        local_keys = [k for k in available if share.local and same_split and k.startswith(local_prefix)]
        for key in local_keys:
            spec = available[key]
            target[key] = torch.empty(tuple(spec.size), dtype=spec.properties.dtype)
        absent = [f"{key} {tuple(value.shape)}" for key, value in share.tensors.items()
                  if key not in available or tuple(available[key].size) != tuple(value.shape)]
        if absent:
            raise CheckpointMismatchError(f"checkpoint {path} lacks (or holds other shapes of) {listing(absent)}")
        target.update(share.tensors)
        stored.check_files(target)
    except Exception as error:  # shared below, so that no process waits in dcp.load for one that gave up
        failure = error
    if not everyone_agrees(failure is None, group):
        if failure is not None:
            raise failure
        raise CheckpointError(f"another process could not restore {path}; its error names the problem")

    try:
        with quiet_dcp():
            dcp.load(target, storage_reader=SafeReader(path), planner=TensorsOnlyPlanner(),
                     process_group=group if distributed(group) else None, no_dist=not distributed(group))
    except CheckpointException as error:  # DCP's own: raised on every process, its message a list of tracebacks
        raise CheckpointError(f"checkpoint {path} could not be read: {_first_failure(error)}") from error

    for name, module in named.items():
        prefix = f"{name}."
        own: dict[str, Any] = {k[len(prefix):]: v for k, v in target.items() if k.startswith(prefix)}
        set_model_state_dict(module, own, options=StateDictOptions(strict=True))
    for index, (optimizer, plan) in enumerate(zip(optimizers, optimizer_loads)):
        try:
            optimizer.load_state_dict(plan(target))
        except (ValueError, KeyError, ReplicatorUsageError) as error:  # the same on every process: the same state
            raise CheckpointMismatchError(f"checkpoint {path}: optimizer {index} ({type(optimizer).__name__}) cannot "
                                          f"take the saved state: {error}") from error
    for scheduler, state in zip(schedulers, scheduler_states):
        scheduler.load_state_dict(dict(state))

    local = {k[len(local_prefix):]: target[k] for k in local_keys}
    step = int(info["step"])
    rng_state = {k[4:]: v for k, v in local.items() if k.startswith("rng/")}
    restored_rng = False
    if rng:
        if rng_state:
            set_rng(rng_state)
            restored_rng = True
        else:
            fresh_seed(step, layout)
    input_state = {key: from_json(value, info["format"]) for key, value in info["input"].items()}
    input_state.update({k[6:]: v for k, v in local.items() if k.startswith("input/")})
    return Restored(path, step, input_state, from_json(info["extra"], info["format"]), saved_layout, restored_rng,
                    dict(info.get("regime", {})))
