"""Internal: checkpoints of the parameter-server regime: the workers hand their state to the servers, which write.

A save is a consistent cut at a step S that every live sync group reaches: each group asks
every server to save (a SAVE request, after its members have put their own state in the job's
store) and waits; a server keeps serving the other groups until every group still in the run
is waiting at the cut, so its shard then holds every group's first S updates and nothing
more (no update happens between the snapshots of shard 0 and shard K). The servers then write
one checkpoint through replicator.checkpoint over their own group (each its shard's parameters
and optimizer state; server 0 also the buffers, the schedulers and the input positions that
the workers handed over), commit it, and answer every waiting group with the current
parameters. No collective spans a worker, so a group that died earlier does not stop a save.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from replicator import checkpoint
from replicator.asynchronous.parameter_server.shards import ShardMap
from replicator.checkpoint.rng import rng_tensors
from replicator.checkpoint.state import model_state, named_modules, parameter_names
from replicator.comm import objects
from replicator.errors import ReplicatorUsageError
from replicator.topology import Mesh

__all__ = ["worker_state", "write_cut", "restore_share"]


def _tensor(value: torch.Tensor) -> dict[str, Any]:
    value = value.detach().cpu().contiguous()
    return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
            "data": value.reshape(-1).view(torch.uint8).numpy().tobytes()}


def _from(entry: Mapping[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a tensor's record: dtype {entry['dtype']!r}")
    flat = torch.frombuffer(bytearray(entry["data"]), dtype=torch.uint8) if entry["data"] else torch.empty(
        0, dtype=torch.uint8)
    return flat.view(dtype).reshape(entry["shape"]).clone()


def trained_names(modules: Mapping[str, torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> set[str]:
    names = parameter_names(named_modules(modules))
    return {names[id(p)] for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}


def worker_state(trained: Mapping[str, Any], *, leader: bool, path: Path, step: int, keep: int | None,
                 extra: Mapping[str, Any] | None, input_state: Mapping[str, Any]) -> bytes:
    """What a worker hands the servers for a save (`trained`: its checkpoint objects), as a store value.

    Every worker: its generators and input position. A group's leader also: the optimizers'
    options (the learning rate its schedulers set), the schedulers' state, and the model's
    entries that no server trains (buffers such as BatchNorm statistics, frozen parameters).
    """
    local = {f"rng/{key}": value for key, value in rng_tensors().items()}
    local.update({f"input/{key}": value for key, value in input_state.items() if isinstance(value, torch.Tensor)})
    state: dict[str, Any] = {
        "path": str(path), "step": step, "keep": keep, "extra": dict(extra or {}),
        "input": {key: value for key, value in input_state.items() if not isinstance(value, torch.Tensor)},
        "local": {key: _tensor(value) for key, value in local.items()},
    }
    if leader:
        optimizers, modules = trained["optimizers"], trained["modules"]
        state["options"] = [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                            for optimizer in optimizers]
        state["schedulers"] = [{k: v for k, v in s.state_dict().items() if not callable(v)}
                               for s in trained["schedulers"]]
        learned = trained_names(modules, optimizers)
        model = model_state(named_modules(modules))
        state["model"] = {key: _tensor(value) for key, value in model.items() if key not in learned}
    return objects.encode(state)


def write_cut(states: Mapping[int, bytes], trained: Mapping[str, Any], mesh: Mesh, shards: ShardMap,
              servers: dist.ProcessGroup | None, regime: Mapping[str, Any]) -> Path:
    """Write the checkpoint of a cut from the servers (every server calls it): `states` by worker rank."""
    decoded = {rank: objects.decode(state) for rank, state in sorted(states.items())}
    lead = decoded[min(decoded)]  # the first live group's leader speaks for the job
    paths = {state["path"] for state in decoded.values()}
    if len(paths) > 1:
        raise ReplicatorUsageError(f"the sync groups asked to save to different paths {sorted(paths)}: call "
                                   "repl.save() with the same path on every process")
    index = mesh.rank - mesh.num_stepping
    modules, optimizers, schedulers = trained["modules"], trained["optimizers"], trained["schedulers"]
    for optimizer, options in zip(optimizers, lead["options"], strict=True):
        for group, saved in zip(optimizer.param_groups, options, strict=True):
            group.update(saved)
    names = parameter_names(named_modules(modules))
    mine = {names[id(p)] for k in range(len(optimizers)) for p in shards.shard(k, index).params}
    learned = trained_names(modules, optimizers)
    tensors: dict[str, torch.Tensor] = {}
    if index == 0:
        model = model_state(named_modules(modules))
        with torch.no_grad():
            for key, entry in lead["model"].items():
                model[key].copy_(_from(entry))
        for scheduler, state in zip(schedulers, lead["schedulers"], strict=True):
            scheduler.load_state_dict(state)
        for rank, state in decoded.items():
            tag = checkpoint.Layout(rank, mesh.num_stepping).tag
            tensors.update({f"_local/{tag}/{key}": _from(entry) for key, entry in state["local"].items()})
    share = checkpoint.Share(owns=lambda name: name in mine or (index == 0 and name not in learned),
                             record="stage0" if index == 0 else f"server{index}", tensors=tensors, local=False,
                             regime=regime)
    return checkpoint.save(lead["path"], modules=modules, optimizers=optimizers, schedulers=schedulers,
                           step=int(lead["step"]), input_state=lead["input"], extra=lead["extra"],
                           layout=checkpoint.Layout(0, mesh.num_stepping), group=servers, keep=lead["keep"],
                           share=share)


def restore_share(trained: Mapping[str, Any], mesh: Mesh, shards: ShardMap) -> tuple[checkpoint.Share,
                                                                                        checkpoint.Layout]:
    """What this process loads of a checkpoint (every process loads the whole model): a server, the optimizer
    state of its shard under the current cut into shards; a worker, its generators and input tensors."""
    if not mesh.serves:
        return checkpoint.Share(owns=lambda name: False), checkpoint.Layout(mesh.rank, mesh.num_stepping)
    names = parameter_names(named_modules(trained["modules"]))
    index = mesh.rank - mesh.num_stepping
    mine = {names[id(p)] for k in range(len(shards.optimizers)) for p in shards.shard(k, index).params}
    return checkpoint.Share(owns=mine.__contains__, local=False), checkpoint.Layout(0, mesh.num_stepping)
