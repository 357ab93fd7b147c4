"""The reducer registry: a reducer's name parsed, and the reducer built from it over the job's groups.

The shape of torch's `ddp_comm_hooks`: this registry on top, one module per reducer below it
(flat, shm, hierarchical, compression, powersgd) over shared internal machinery (`_summation`,
`_ring`, `_worker`), and the contract (`Reducer`, `PendingReduction`) underneath, in
`replicator.sync.bucket`. Nothing below imports this module.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replicator import _env
from replicator.comm.decision import everyone_agrees
from replicator.sync.bucket import PendingReduction, Reducer
from replicator.sync.reducers._summation import Summation
from replicator.sync.reducers._worker import SummationReducer
from replicator.sync.reducers.compression import CastReducer
from replicator.sync.reducers.flat import FlatReducer, FlatSum
from replicator.sync.reducers.hierarchical import HierarchicalSum, plan_levels, replicas_per_node
from replicator.sync.reducers.powersgd import PowerSGDReducer
from replicator.sync.reducers.shm import SharedMemorySum, host_memory_usable, shared_memory_usable
from replicator.topology import ProcessGroups

__all__ = ["Reducer", "PendingReduction", "FlatReducer", "make_reducer", "parse_reducer", "ReducerSpec",
           "REDUCER_NAMES"]

REDUCER_NAMES = (
    "'flat', 'shm' (through shared memory, replicas on one node, CPU), 'auto' (on CPU: shm on one node, "
    "hierarchical across nodes; on GPUs: flat), 'hierarchical', 'hierarchical:XxYxZ' (level sizes "
    "innermost first, e.g. 4x2x2 = 4 per node x 2 nodes per rack x 2 racks), "
    "'fp16', 'bf16' (add '+ef' for error feedback), 'powersgd:R' (rank R; '+noef' turns its error feedback "
    "off); a compressed one may name its topology after '@', e.g. 'fp16+ef@hierarchical' or 'powersgd:4@auto'"
)


@dataclass(frozen=True)
class ReducerSpec:
    """A parsed reducer name: an optional compressor over a topology."""

    topology: str  # "flat", "shm", "auto" or "hierarchical"
    levels: tuple[int, ...] | None = None  # explicit hierarchical levels, innermost first
    compressor: str | None = None  # "fp16", "bf16" or "powersgd"
    rank: int = 0  # PowerSGD's rank
    error_feedback: bool = False


_LEVELS = re.compile(r"hierarchical:(\d+(?:x\d+)*)")


def parse_reducer(spec: str) -> ReducerSpec:
    """Parse a reducer name (see REDUCER_NAMES); ValueError for anything else."""

    def unknown(why: str = "") -> ValueError:
        return ValueError(f"unknown reducer {spec!r}{why}; available: {REDUCER_NAMES} "
                          "(or pass an object with a reduce() method)")

    text = spec.strip().lower()
    compressor_text, at, topology_text = text.partition("@")
    head: str | None = compressor_text
    levels: tuple[int, ...] | None = None
    if not at:  # one word: a compressor over the flat topology, or a topology alone
        if compressor_text.startswith(("fp16", "bf16", "powersgd")):
            topology_text = "flat"
        else:
            head, topology_text = None, compressor_text
    if topology_text in ("flat", "shm", "auto", "hierarchical"):
        topology = topology_text
    elif (match := _LEVELS.fullmatch(topology_text)) is not None:
        topology, levels = "hierarchical", tuple(int(size) for size in match.group(1).split("x"))
        if min(levels) < 1:
            raise unknown(": level sizes must be at least 1")
    else:
        raise unknown()
    if head is None:
        return ReducerSpec(topology, levels)
    if topology == "shm":
        raise unknown(": shared memory carries no wire to compress; use 'shm' alone")
    compressor, *flags = head.split("+")
    rank = 0
    if compressor.startswith("powersgd"):
        match = re.fullmatch(r"powersgd:(\d+)", compressor)
        if match is None or int(match.group(1)) < 1:
            raise unknown(": PowerSGD takes its rank, e.g. 'powersgd:4'")
        compressor, rank = "powersgd", int(match.group(1))
    elif compressor not in ("fp16", "bf16"):
        raise unknown()
    error_feedback = compressor == "powersgd"
    for flag in flags:
        if flag not in ("ef", "noef"):
            raise unknown(f": {flag!r} is not a flag ('+ef' or '+noef')")
        error_feedback = flag == "ef"
    return ReducerSpec(topology, levels, compressor, rank, error_feedback)


def make_reducer(spec: str | Reducer, groups: ProcessGroups | None = None, *, timeout_s: float | None = None,
                 device: torch.device | None = None) -> Reducer:
    """A reducer from its name (see REDUCER_NAMES), or the reducer object itself.

    `groups` (the job's process groups) lets topology-aware and compressing reducers build
    their own groups, which they do here, collectively: every rank must call make_reducer
    with the same spec at the same point. With one replica nothing travels, so every name
    gives the flat reducer (after its name is checked). `timeout_s` bounds the reducer's
    collectives (None: REPLICATOR_TIMEOUT, else 300 s). `device` is where the gradients
    live (default CPU); 'auto' sums through shared memory only for host gradients.
    """
    if not isinstance(spec, str):
        if not _has_reduce(spec):
            raise TypeError(f"a reducer is a name or an object with a reduce(buffer, group, bucket) method, got "
                            f"{spec!r} (an older reduce(buffer, group) needs a third, ignored argument)")
        return spec
    parsed = parse_reducer(spec)
    if groups is None:
        if dist.is_initialized() and (parsed.topology != "flat" or parsed.compressor is not None):
            raise ValueError(f"reducer {spec!r} needs the job's process groups: make_reducer({spec!r}, groups)")
        return FlatReducer()
    if groups.replica is None or groups.mesh.num_replicas == 1:
        return FlatReducer()
    timeout_s = _env.timeout_s() if timeout_s is None else timeout_s
    return _build(spec, parsed, groups, timeout_s, torch.device("cpu") if device is None else torch.device(device))


def _build(spec: str, parsed: ReducerSpec, groups: ProcessGroups, timeout_s: float, device: torch.device) -> Reducer:
    # Whether /dev/shm can carry gradients decides which groups get built, so every rank must
    # reach the same answer: agreed on once, and only where shared memory could be chosen.
    host_memory = parsed.topology != "flat" and _every_process_shares_host_memory(groups, device)
    if host_memory:
        shared_memory_refusal = shared_memory_usable(groups, device)
    else:
        shared_memory_refusal = host_memory_usable(device) or "another process of the job cannot use /dev/shm"
    if parsed.topology == "shm":
        if shared_memory_refusal is not None:
            raise ValueError(f"reducer 'shm' cannot be used here: {shared_memory_refusal}; use 'flat' or 'auto'")
        return SummationReducer(SharedMemorySum(groups, timeout_s))
    if parsed.topology == "auto" and parsed.compressor is None and shared_memory_refusal is None:
        # One node, host memory: adding rows of a shared mapping beats any socket.
        return SummationReducer(SharedMemorySum(groups, timeout_s))
    levels: tuple[int, ...] | None = None
    if parsed.topology != "flat":
        partition, local_world_size = groups.mesh.replica_partition, groups.mesh.local_world_size
        if parsed.topology == "auto":
            try:
                inner, outer = plan_levels(partition, local_world_size, None, spec)
            except ValueError:  # replicas spread unevenly over nodes: flat is the safe choice
                inner, outer = 1, 1
            # Hierarchy pays only when a node holds several replicas and there are several nodes, and
            # only over Gloo: NCCL already builds its own rings and trees over NVLink and the network.
            levels = (inner, outer) if inner > 1 and outer > 1 and device.type == "cpu" else None
        else:
            levels = plan_levels(partition, local_world_size, parsed.levels, spec)
    if parsed.compressor is None:
        if levels is None:
            return FlatReducer()
        return SummationReducer(_hierarchy(groups, levels, timeout_s, host_memory))
    summation = FlatSum(groups, timeout_s) if levels is None else _hierarchy(groups, levels, timeout_s, host_memory)
    if parsed.compressor == "powersgd":
        return PowerSGDReducer(summation, parsed.rank, error_feedback=parsed.error_feedback)
    return CastReducer(summation, parsed.compressor, error_feedback=parsed.error_feedback)


def _hierarchy(groups: ProcessGroups, levels: tuple[int, ...], timeout_s: float, host_memory: bool) -> Summation:
    """A hierarchical sum; when it has two levels, the inner one exactly the node's replicas and
    the outer one several nodes, and gradients are in host memory, the node's level goes
    through shared memory instead of socket rings."""
    per_node = replicas_per_node(groups.mesh.replica_partition[0], groups.mesh.local_world_size)
    if host_memory and len(levels) == 2 and levels[0] == per_node > 1 and levels[1] > 1:
        return SharedMemorySum(groups, timeout_s, per_node=per_node)
    return HierarchicalSum(groups, levels, timeout_s)


def _every_process_shares_host_memory(groups: ProcessGroups, device: torch.device) -> bool:
    """Whether every process can use /dev/shm for host gradients, agreed by all (on the Gloo control group)."""
    if device.type != "cpu":  # the same device type on every rank: no one asks
        return False
    return everyone_agrees(host_memory_usable(device) is None, groups.control)


def _has_reduce(reducer: object) -> bool:
    """Checked when the reducer is given, not at its first call from inside a backward pass."""
    reduce = getattr(reducer, "reduce", None)
    if not callable(reduce):
        return False
    try:
        inspect.signature(reduce).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (a builtin): trust it
        return True
    return True
