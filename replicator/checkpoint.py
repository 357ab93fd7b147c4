"""Checkpoints on torch.distributed.checkpoint: atomic, resharding, loaded without unpickling code."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pickle
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from replicator.errors import ReplicatorError, ReplicatorUsageError

__all__ = [
    "Layout",
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

FORMAT = 1
JOB_FILE = "replicator.json"  # written last, by rank 0: a directory without it is not a checkpoint
PARTIAL_SUFFIX = ".partial"
_STEP_NAME = re.compile(r"^step_(\d+)$")
_LISTED = 20  # how many mismatched keys an error message names before it summarises


class CheckpointError(ReplicatorError):
    """A checkpoint is missing, incomplete, or holds something replicator refuses to load."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was written for a different model or optimizer than the one restoring it."""


@dataclass(frozen=True)
class Layout:
    """Where this process sits: replica `replica` of `num_replicas`, pipeline stage `stage` of `num_stages`."""

    replica: int = 0
    num_replicas: int = 1
    stage: int = 0
    num_stages: int = 1

    @property
    def tag(self) -> str:
        return f"r{self.replica}s{self.stage}"


@dataclass
class Restored:
    """What `restore` hands back besides the objects it loaded in place."""

    path: Path
    step: int
    input_state: dict[str, Any]  # the job-wide part, plus this process's tensors where it had any
    extra: dict[str, Any]
    saved_layout: Layout  # replica/stage counts of the job that wrote it (replica = stage = 0)
    rng_restored: bool  # False: this process had no saved streams and was seeded afresh


# A test hook: called on every rank once its files are written and before the commit, so a
# test can kill a process at the worst moment. Never set outside tests.
_after_write: Callable[[Path], None] | None = None


# -- where checkpoints live ------------------------------------------------------------
def step_path(directory: str | os.PathLike[str], step: int) -> Path:
    """The checkpoint path for `step` inside `directory` (zero-padded, so names sort by step)."""
    return Path(directory) / f"step_{step:09d}"


def _committed(path: Path) -> bool:
    return path.is_dir() and (path / JOB_FILE).is_file()


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in `directory` (partial writes are ignored), or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_NAME.match(p.name)) and _committed(p)]
    return max(found)[1] if found else None


def prune(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and any abandoned partial ones."""
    if keep < 1:
        raise ReplicatorUsageError(f"keep must be at least 1 (the checkpoint just written), got {keep}")
    directory = Path(directory)
    complete = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_NAME.match(p.name)) and _committed(p))
    doomed = [p for _, p in complete[:-keep]]
    doomed += [p for p in directory.iterdir() if p.name.endswith(PARTIAL_SUFFIX) and p.is_dir()]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def read_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The job-wide JSON of a complete checkpoint: step, layout, input position, extra."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    if not _committed(path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {JOB_FILE}): its write was interrupted; use latest(directory) "
            "to find the last complete one"
        )
    info = json.loads((path / JOB_FILE).read_text())
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {info.get('format')!r}; this replicator reads format {FORMAT}")
    return info


# -- JSON for everything that is not a tensor -----------------------------------------------
def _to_json(value: Any, where: str) -> Any:
    """Plain JSON, with tuples, Counters and non-string keys tagged so they come back as they were."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, collections.Counter):
        return {"__counter__": [[_to_json(k, where), _to_json(v, where)] for k, v in value.items()]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _to_json(v, f"{where}.{k}") for k, v in value.items()}
        return {"__items__": [[_to_json(k, where), _to_json(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise CheckpointError(
        f"{where} is a {type(value).__name__}; a checkpoint stores tensors and JSON values (numbers, strings, "
        "lists, dicts) only, so that loading it never runs pickled code"
    )


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if set(value) == {"__counter__"}:
            return collections.Counter({_hashable(_from_json(k)): _from_json(v) for k, v in value["__counter__"]})
        if set(value) == {"__items__"}:
            return {_hashable(_from_json(k)): _from_json(v) for k, v in value["__items__"]}
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _write_json(path: Path, payload: Any) -> None:
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# -- names -----------------------------------------------------------------------------
def _named_modules(modules: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    named = {"model": modules} if isinstance(modules, nn.Module) else dict(modules)
    for name, module in named.items():
        if not isinstance(module, nn.Module):
            raise TypeError(f"modules[{name!r}] is a {type(module).__name__}, not an nn.Module")
        if not name or name.startswith("_") or "/" in name:
            raise ReplicatorUsageError(f"module name {name!r} must be non-empty, without '/', and not start with '_'")
    return named


def _model_state(named: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Every module's state under `name.fqn`, the keys a plain dcp.load({name: sd}) would also use."""
    state: dict[str, torch.Tensor] = {}
    for name, module in named.items():
        for key, value in get_model_state_dict(module).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"{name}.{key} is a {type(value).__name__}, not a tensor; module extra state would need pickle "
                    "to save, which replicator checkpoints never use"
                )
            state[f"{name}.{key}"] = value
    return state


def _parameter_names(named: Mapping[str, nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, module in named.items():
        for key, param in module.named_parameters():
            # The model's keys come from get_model_state_dict, which drops torch.compile's wrapper.
            names.setdefault(id(param), f"{name}.{key.replace('_orig_mod.', '')}")
    return names


def _optimizer_params(optimizer: torch.optim.Optimizer, names: Mapping[int, str], index: int) -> list[list[str]]:
    """Each parameter group's parameters by name: the stable identity that survives resharding."""
    groups: list[list[str]] = []
    for group in optimizer.param_groups:
        listed: list[str] = []
        for param in group["params"]:
            if id(param) not in names:
                raise ReplicatorUsageError(
                    f"optimizer {index} holds a parameter of shape {tuple(param.shape)} that is in none of the modules "
                    "passed to the checkpoint; pass every module whose parameters the optimizers update"
                )
            listed.append(names[id(param)])
        groups.append(listed)
    return groups


# -- random number generators ---------------------------------------------------------
def _rng_tensors() -> dict[str, torch.Tensor]:
    """This process's torch, CUDA, Python and NumPy generator states, all as tensors."""
    import numpy as np

    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_extra": torch.tensor([float(np_pos), float(np_has_gauss), float(np_gauss)], dtype=torch.float64),
    }
    if np_name != "MT19937":
        del state["numpy"], state["numpy_extra"]
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{index}"] = cuda_state
    return state


def _set_rng(state: Mapping[str, torch.Tensor]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    python = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((int(python[0]), tuple(int(v) for v in python[1:]), gauss if has_gauss else None))
    if "numpy" in state:
        pos, np_has_gauss, np_gauss = state["numpy_extra"].tolist()
        np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), int(pos), int(np_has_gauss), np_gauss))
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            if f"cuda{index}" in state:
                torch.cuda.set_rng_state(state[f"cuda{index}"], index)


def _fresh_seed(step: int, layout: Layout) -> None:
    """Distinct, reproducible streams for a process that had none in the checkpoint."""
    import numpy as np

    seed = (step * 1_000_003 + layout.replica * 1_009 + layout.stage) % (2**63)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (2**32))


# -- the DCP reader that never unpickles code -----------------------------------------
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch's own object
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; accept only DCP's own record types, as weights_only does for tensors."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"the checkpoint's .metadata refers to {module}.{name}, which is not part of DCP's metadata; "
            "refusing to load it (it could run arbitrary code)"
        )


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled through an allow-list; tensors load weights_only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"  # DCP's name for the collective (rank-0) metadata file
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as DCP's own reader does, for its logging
        return metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """Replicator writes no pickled entries, so one found at load time is refused, not unpickled."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn} is pickled bytes, which replicator never writes; "
            "refusing to unpickle it"
        )


def _tensor_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    metadata = _SafeReader(path).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# -- collectives -------------------------------------------------------------------------
def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if _distributed(group) else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _distributed(group):
        dist.barrier(group=group)


def _all_ok(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """True when every process of `group` is ok: a verdict reached by one is shared, never a hang."""
    if not _distributed(group):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    # DCP warns that it "assumes a single process" whenever no group is initialised: that is
    # exactly the intent of a one-process save or an evaluation-time load.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- save ----------------------------------------------------------------------------------
def save(
    path: str | os.PathLike[str],
    *,
    modules: nn.Module | Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    step: int = 0,
    input_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    layout: Layout = Layout(),
    group: dist.ProcessGroup | None = None,
    keep: int | None = None,
) -> Path:
    """Write a checkpoint to `path` atomically; every process of `group` calls it together.

    Args:
        modules: a module (saved as "model") or {name: module}. A pipeline stage passes
            its own stage module under the name the unsplit model uses: stage modules keep
            the original layer indices, so the stages' keys together are the whole model's.
        optimizers, schedulers: saved by parameter name, so they reshard and merge.
        step: the number of completed steps.
        input_state: where the input stands. JSON values (epoch, batches consumed) are the
            job's, written by rank 0; tensors (e.g. the generator state the epoch began
            with) are this process's own.
        extra: any JSON-able job metadata.
        layout: this process's replica and stage (and their counts).
        group: a process group spanning the whole job that can reduce CPU tensors (Gloo):
            Replicator's `groups.control`. None on one process.
        keep: afterwards keep only the newest `keep` checkpoints of `path`'s directory.

    Replicated tensors (every replica has the same) are written once: DCP deduplicates
    them across the group. Files go to `<path>.partial`; after every process has written
    and a barrier, rank 0 writes the job file and renames the directory to `path`, so
    `path` exists only when complete. Returns `path`.
    """
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    rank = _rank(group)
    failure: Exception | None = None
    try:
        if keep is not None and keep < 1:
            raise ReplicatorUsageError(f"keep must be at least 1 (the checkpoint being written), got {keep}")
        tensors, stage_record, job = _gather(modules, optimizers, schedulers, step, input_state, extra, layout)
    except Exception as error:  # e.g. a value JSON cannot hold: every process must learn of it, or the rest would wait
        failure = error
    if not _all_ok(failure is None, group):
        if failure is not None:
            raise failure
        raise CheckpointError(f"another process could not prepare checkpoint {path}; its error names the problem")

    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a previous attempt's leftovers
        partial.mkdir(parents=True)
    _barrier(group)
    with _quiet_dcp():
        dcp.save(tensors, storage_writer=FileSystemWriter(partial, sync_files=True),
                 process_group=group if _distributed(group) else None, no_dist=not _distributed(group))
    if layout.replica == 0:
        _write_json(partial / f"stage{layout.stage}.json", stage_record)
    if _after_write is not None:
        _after_write(partial)
    _barrier(group)  # every shard and stage file is on disk
    if rank == 0:
        _write_json(partial / JOB_FILE, job)
        _fsync_directory(partial)
        _commit(partial, path)
        if keep is not None:
            prune(path.parent, keep)
    _barrier(group)  # nobody returns before the checkpoint is visible
    return path


def _gather(
    modules: nn.Module | Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    step: int,
    input_state: Mapping[str, Any] | None,
    extra: Mapping[str, Any] | None,
    layout: Layout,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """This process's tensors for DCP, its stage's JSON record and the job's JSON record."""
    named = _named_modules(modules)
    tensors = _model_state(named)
    names = _parameter_names(named)
    optimizer_records = []
    for index, optimizer in enumerate(optimizers):
        optimizer_tensors, record = _optimizer_state(optimizer, names, index)
        tensors.update(optimizer_tensors)
        optimizer_records.append(record)
    scheduler_records = [_scheduler_state(scheduler, index) for index, scheduler in enumerate(schedulers)]
    local = {f"rng/{k}": v for k, v in _rng_tensors().items()}
    job_input: dict[str, Any] = {}
    for key, value in (input_state or {}).items():
        if isinstance(value, torch.Tensor):
            local[f"input/{key}"] = value
        else:
            job_input[key] = _to_json(value, f"input_state[{key!r}]")
    for key, value in local.items():
        tensors[f"_local/{layout.tag}/{key}"] = value.detach().cpu()
    job = {
        "format": FORMAT,
        "step": int(step),
        "num_replicas": layout.num_replicas,
        "num_stages": layout.num_stages,
        "modules": sorted(named),
        "input": job_input,
        "extra": _to_json(dict(extra or {}), "extra"),
        "torch": torch.__version__,
    }
    return tensors, {"optimizers": optimizer_records, "schedulers": scheduler_records}, job


def _commit(partial: Path, path: Path) -> None:
    """Make the written directory visible under `path` in one rename (the previous one survives until then)."""
    if path.exists():
        retired = path.with_name(path.name + ".old" + PARTIAL_SUFFIX)
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(path, retired)
        os.rename(partial, path)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(partial, path)
    _fsync_directory(path.parent)


def _optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], index: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch's optimizer state_dict with parameter numbers replaced by parameter names.

    (torch's get_optimizer_state_dict would do this too, but on an optimizer without state
    it first runs a zero-learning-rate step, which on a wrapped optimizer is a gradient
    all-reduce and, for Adam, leaves step=1 behind.)
    """
    groups = _optimizer_params(optimizer, names, index)
    order = [name for group in groups for name in group]
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for number, entry in state_dict["state"].items():
        name = order[int(number)]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"_optim/{name}/{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = _to_json(value, f"optimizer {index} state {name}.{key}")
    param_groups = []
    for group, listed in zip(state_dict["param_groups"], groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for key, value in hyper.items():
            if isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer {index} has a tensor-valued hyperparameter {key!r}; checkpoints support plain numbers"
                )
        param_groups.append({"hyper": _to_json(hyper, f"optimizer {index} hyperparameters"), "params": listed})
    return tensors, {"type": type(optimizer).__name__, "param_groups": param_groups, "scalars": scalars}


def _scheduler_state(scheduler: Any, index: int) -> Any:
    # Callables are code, not state: a wrapped scheduler's own step, LambdaLR's functions.
    state = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}
    return _to_json(state, f"scheduler {index}")


# -- restore -------------------------------------------------------------------------------
def restore(
    path: str | os.PathLike[str],
    *,
    modules: nn.Module | Mapping[str, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    layout: Layout = Layout(),
    group: dist.ProcessGroup | None = None,
    rng: bool = True,
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
    """
    path = Path(path)
    failure: Exception | None = None
    try:
        named = _named_modules(modules)
        info = read_info(path)
        stage_files = sorted(path.glob("stage*.json"))
        stages = {int(p.stem[5:]): _from_json(json.loads(p.read_text())) for p in stage_files}
        available = _tensor_metadata(path)
        target = _model_state(named)
        mismatch = _check_model(target, available, partial=layout.num_stages > 1)
        if mismatch:
            raise CheckpointMismatchError(f"checkpoint {path} does not match the model: {mismatch}")
        names = _parameter_names(named)
        optimizer_loads = [
            _plan_optimizer(optimizer, names, index, stages, available, target)
            for index, optimizer in enumerate(optimizers)
        ]
        scheduler_states = _plan_schedulers(schedulers, stages, info, layout)
        saved_layout = Layout(0, int(info["num_replicas"]), 0, int(info["num_stages"]))
        # Per-process state belongs to a (replica, stage) of the same stage split only.
        same_split = int(info["num_stages"]) == layout.num_stages
        local_prefix = f"_local/{layout.tag}/"
        local_keys = [k for k in available if same_split and k.startswith(local_prefix)]
        for key in local_keys:
            spec = available[key]
            target[key] = torch.empty(tuple(spec.size), dtype=spec.properties.dtype)
    except Exception as error:  # shared below, so that no process waits in dcp.load for one that gave up
        failure = error
    if not _all_ok(failure is None, group):
        if failure is not None:
            raise failure
        raise CheckpointError(f"another process could not restore {path}; its error names the problem")

    with _quiet_dcp():
        dcp.load(target, storage_reader=_SafeReader(path), planner=_TensorsOnlyPlanner(),
                 process_group=group if _distributed(group) else None, no_dist=not _distributed(group))

    for name, module in named.items():
        prefix = f"{name}."
        own = {k[len(prefix):]: v for k, v in target.items() if k.startswith(prefix)}
        set_model_state_dict(module, own, options=StateDictOptions(strict=True))
    for optimizer, plan in zip(optimizers, optimizer_loads):
        optimizer.load_state_dict(plan(target))
    for scheduler, state in zip(schedulers, scheduler_states):
        scheduler.load_state_dict(dict(state))

    local = {k[len(local_prefix):]: target[k] for k in local_keys}
    step = int(info["step"])
    rng_state = {k[4:]: v for k, v in local.items() if k.startswith("rng/")}
    restored_rng = False
    if rng:
        if rng_state:
            _set_rng(rng_state)
            restored_rng = True
        else:
            _fresh_seed(step, layout)
    input_state = dict(_from_json(info["input"]))
    input_state.update({k[6:]: v for k, v in local.items() if k.startswith("input/")})
    return Restored(path, step, input_state, _from_json(info["extra"]), saved_layout, restored_rng)


def _listing(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_LISTED])
    return f"{shown}, ... ({len(keys)} in all)" if len(keys) > _LISTED else shown


def _check_model(target: Mapping[str, torch.Tensor], available: Mapping[str, TensorStorageMetadata], partial: bool) -> str:
    """'' when the checkpoint has every tensor of the model with the same shape, else what differs."""
    saved = {k for k in available if not k.startswith("_")}
    missing = [k for k in target if k not in available]
    # A pipeline stage holds a slice of the model, so only the keys it lacks are suspicious there.
    unexpected = [] if partial else [k for k in saved if k not in target]
    shapes = [
        f"{k} (checkpoint {tuple(available[k].size)}, model {tuple(target[k].shape)})"
        for k in target if k in available and tuple(available[k].size) != tuple(target[k].shape)
    ]
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {_listing(unexpected)}")
    if shapes:
        parts.append(f"different shapes: {_listing(shapes)}")
    return "; ".join(parts)


def _plan_optimizer(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    index: int,
    stages: Mapping[int, Any],
    available: Mapping[str, TensorStorageMetadata],
    target: dict[str, torch.Tensor],
) -> Callable[[Mapping[str, torch.Tensor]], dict[str, Any]]:
    """Add this optimizer's tensors to `target`; return what builds its state_dict once they are loaded."""
    groups = _optimizer_params(optimizer, names, index)
    # Every saved parameter group of every stage, by parameter name (stages own disjoint names).
    saved_group: dict[str, tuple[str, dict[str, Any]]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for stage in stages.values():
        for record in stage["optimizers"]:
            for group in record["param_groups"]:
                for name in group["params"]:
                    saved_group[name] = (record["type"], group["hyper"])
            scalars.update(record["scalars"])
    kind = type(optimizer).__name__
    missing = [name for group in groups for name in group if name not in saved_group]
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint does not match the model: optimizer {index} ({kind}) updates parameters the checkpoint has "
            f"no optimizer state for: {_listing(missing)}"
        )
    hypers = []
    for number, group in enumerate(groups):
        found = {json.dumps(saved_group[name], sort_keys=True) for name in group}
        if len(found) != 1:
            raise CheckpointMismatchError(
                f"checkpoint does not match the model: parameter group {number} of optimizer {index} mixes parameters "
                "that were saved under different optimizers or hyperparameters"
            )
        saved_kind, hyper = saved_group[group[0]]
        if saved_kind != kind:
            raise CheckpointMismatchError(
                f"checkpoint does not match the model: optimizer {index} is a {kind} but the checkpoint's state for "
                f"its parameters comes from a {saved_kind}"
            )
        hypers.append(hyper)
    order = [name for group in groups for name in group]
    keys: dict[str, list[tuple[str, str]]] = {name: [] for name in order}
    for key, spec in available.items():
        if key.startswith("_optim/"):
            name, _, state_key = key[len("_optim/"):].rpartition("/")
            if name in keys:
                keys[name].append((state_key, key))
                target[key] = torch.empty(tuple(spec.size), dtype=spec.properties.dtype)

    def build(loaded: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        state: dict[int, dict[str, Any]] = {}
        for number, name in enumerate(order):
            entry = dict(scalars.get(name, {}))
            entry.update({state_key: loaded[key] for state_key, key in keys[name]})
            if entry:
                state[number] = entry
        param_groups, start = [], 0
        for hyper, group in zip(hypers, groups):
            param_groups.append({**hyper, "params": list(range(start, start + len(group)))})
            start += len(group)
        return {"state": state, "param_groups": param_groups}

    return build


def _plan_schedulers(
    schedulers: Sequence[Any], stages: Mapping[int, Any], info: Mapping[str, Any], layout: Layout
) -> list[dict[str, Any]]:
    if not schedulers:
        return []
    # The same stage when the split is unchanged; otherwise stage 0's, which steps in lockstep with the others.
    source = layout.stage if int(info["num_stages"]) == layout.num_stages else 0
    saved = stages.get(source, {}).get("schedulers", [])
    if len(saved) != len(schedulers):
        raise CheckpointMismatchError(
            f"checkpoint does not match the model: it holds {len(saved)} LR scheduler(s) for stage {source} but "
            f"{len(schedulers)} were given to restore"
        )
    for index, (scheduler, state) in enumerate(zip(schedulers, saved)):
        # The class is not recorded, but the state's keys are the class's attributes.
        current = {k for k, v in scheduler.state_dict().items() if not callable(v)}
        if set(state) != current:
            raise CheckpointMismatchError(
                f"checkpoint does not match the model: LR scheduler {index} ({type(scheduler).__name__}) has state "
                f"{sorted(current)} but the checkpoint's has {sorted(state)}"
            )
    return list(saved)
