"""State by name: modules, optimizers and schedulers to DCP's flat tensors and JSON records, and back (internal).

Optimizer state is keyed by parameter name rather than torch's parameter numbers, so that
a checkpoint reshards: any replica count, and any stage split of the same model, restores it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from replicator._torch_names import DTensor
from replicator.checkpoint.errors import CheckpointError, CheckpointMismatchError
from replicator.checkpoint.layout import Layout
from replicator.checkpoint.optimizer_check import check_entry
from replicator.checkpoint.safe_load import Index
from replicator.checkpoint.values import from_json, to_json
from replicator.errors import ReplicatorUsageError

__all__: list[str] = []

LISTED = 20  # how many mismatched keys an error message names before it summarises


def named_modules(modules: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    named = {"model": modules} if isinstance(modules, nn.Module) else dict(modules)
    for name, module in named.items():
        if not isinstance(module, nn.Module):
            raise TypeError(f"modules[{name!r}] is a {type(module).__name__}, not an nn.Module")
        if not name or name.startswith("_") or "/" in name:
            raise ReplicatorUsageError(f"module name {name!r} must be non-empty, without '/', and not start with '_'")
    return named


def model_state(named: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
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


def parameter_names(named: Mapping[str, nn.Module]) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, module in named.items():
        for key, param in module.named_parameters():
            # The model's keys come from get_model_state_dict, which drops torch.compile's wrapper.
            names.setdefault(id(param), f"{name}.{key.replace('_orig_mod.', '')}")
    return names


def optimizer_params(optimizer: torch.optim.Optimizer, names: Mapping[int, str], index: int,
                     prefix: str = "") -> list[list[str]]:
    """Each parameter group's parameters by name (after `prefix`): the stable identity that survives resharding."""
    groups: list[list[str]] = []
    for group in optimizer.param_groups:
        listed: list[str] = []
        for param in group["params"]:
            if id(param) not in names:
                raise ReplicatorUsageError(
                    f"optimizer {index} holds a parameter of shape {tuple(param.shape)} that is in none of the modules "
                    "passed to the checkpoint; pass every module whose parameters the optimizers update"
                )
            listed.append(prefix + names[id(param)])
        groups.append(listed)
    return groups


def optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], index: int, prefix: str = "",
    owns: Callable[[str], bool] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch's optimizer state_dict with parameter numbers replaced by parameter names (after `prefix`).

    With `owns`, only the state of the parameters it names (unprefixed) is kept: a parameter
    server's shard. The parameter groups and their options list every parameter.

    (torch's get_optimizer_state_dict would do this too, but on an optimizer without state
    it first runs a zero-learning-rate step, which on a wrapped optimizer is a gradient
    all-reduce and, for Adam, leaves step=1 behind.)
    """
    groups = optimizer_params(optimizer, names, index, prefix)
    order = [name for group in groups for name in group]
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for number, entry in state_dict["state"].items():
        name = order[int(number)]
        if owns is not None and not owns(name[len(prefix):]):
            continue
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"_optim/{name}/{key}"] = value
            else:
                scalars.setdefault(name, {})[key] = to_json(value, f"optimizer {index} state {name}.{key}")
    param_groups = []
    for group, listed in zip(state_dict["param_groups"], groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for key, value in hyper.items():
            if isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer {index} has a tensor-valued hyperparameter {key!r}; checkpoints support plain numbers"
                )
        param_groups.append({"hyper": to_json(hyper, f"optimizer {index} hyperparameters"), "params": listed})
    return tensors, {"type": type(optimizer).__name__, "param_groups": param_groups, "scalars": scalars}


def scheduler_state(scheduler: Any, index: int) -> Any:
    # Callables are code, not state: a wrapped scheduler's own step, LambdaLR's functions.
    state = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}
    return to_json(state, f"scheduler {index}")


def read_record(record: Mapping[str, Any], checkpoint_format: int) -> dict[str, Any]:
    """A record file's optimizer and scheduler records with their values decoded (what optimizer_state wrote)."""
    optimizers = [{**saved, "scalars": {name: {key: from_json(value, checkpoint_format) for key, value in entry.items()}
                                        for name, entry in saved["scalars"].items()},
                   "param_groups": [{**group, "hyper": from_json(group["hyper"], checkpoint_format)}
                                    for group in saved["param_groups"]]}
                  for saved in record["optimizers"]]
    schedulers = [from_json(state, checkpoint_format) for state in record["schedulers"]]
    return {"optimizers": optimizers, "schedulers": schedulers}


def listing(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:LISTED])
    return f"{shown}, ... ({len(keys)} in all)" if len(keys) > LISTED else shown


def check_model(
    target: Mapping[str, torch.Tensor], available: Mapping[str, TensorStorageMetadata], partial: bool
) -> str:
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
        parts.append(f"missing from the checkpoint: {listing(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {listing(unexpected)}")
    if shapes:
        parts.append(f"different shapes: {listing(shapes)}")
    return "; ".join(parts)


def plan_optimizer(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    index: int,
    records: Mapping[str, Any],
    stored: Index,
    target: dict[str, torch.Tensor],
    prefix: str = "",
    owns: Callable[[str], bool] | None = None,
) -> Callable[[Mapping[str, torch.Tensor]], dict[str, Any]]:
    """Add this optimizer's tensors to `target`; return what builds its state_dict once they are loaded.

    `records` are every record file's (by stem); `stored` is the checkpoint's tensor index; `prefix`
    and `owns` as for `optimizer_state` (state is loaded only for the parameters `owns` names). The
    state of each parameter is checked first: every key its optimizer keeps, each of the right shape.
    """
    available = stored.tensors
    files = ", ".join(str(stored.path / f"{stem}.json") for stem in sorted(records))
    groups = optimizer_params(optimizer, names, index, prefix)
    # Every saved parameter group of every record, by parameter name (stages own disjoint names;
    # parameter servers list the same groups, each with the state of its own shard).
    saved_group: dict[str, tuple[str, dict[str, Any]]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for stage in records.values():
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
            f"no optimizer state for ({f'no record file of {files} lists them' if files else 'it holds no record file'}"
            f"): {listing(missing)}"
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
    params = dict(zip(order, (p for group in optimizer.param_groups for p in group["params"])))
    keys: dict[str, list[tuple[str, str]]] = {name: [] for name in order}
    for key, spec in available.items():
        if key.startswith("_optim/"):
            name, _, state_key = key[len("_optim/"):].rpartition("/")
            if name in keys and (owns is None or owns(name[len(prefix):])):
                keys[name].append((state_key, key))
                param, size = params[name], tuple(spec.size)
                # The state of a parameter sharded with shard="parameters" (a DTensor) is read into this
                # replica's shards of it, laid out as the parameter; whole tensors everywhere else.
                target[key] = (torch.empty_like(param, dtype=spec.properties.dtype)
                               if isinstance(param, DTensor) and tuple(param.shape) == size
                               else torch.empty(size, dtype=spec.properties.dtype))
    for hyper, group in zip(hypers, groups):
        for name in group:
            if owns is None or owns(name[len(prefix):]):
                saved = {**{key: None for key in scalars.get(name, {})},
                         **{state_key: tuple(available[key].size) for state_key, key in keys[name]}}
                check_entry(stored, index, type(optimizer), name, f"_optim/{name}/", params[name], hyper, saved, files)

    def build(loaded: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        state: dict[int, dict[str, Any]] = {}
        for number, name in enumerate(order):
            entry = dict(scalars.get(name, {})) if owns is None or owns(name[len(prefix):]) else {}
            entry.update({state_key: loaded[key] for state_key, key in keys[name]})
            if entry:
                state[number] = entry
        param_groups, start = [], 0
        for hyper, group in zip(hypers, groups):
            param_groups.append({**hyper, "params": list(range(start, start + len(group)))})
            start += len(group)
        return {"state": state, "param_groups": param_groups}

    return build


def plan_schedulers(
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
            f"{len(schedulers)} were given to restore (precision='fp16' keeps its loss scale as one more, after them)"
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
