"""The asynchronous regime's arguments, checked alike on every process before any group is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicator.errors import ReplicatorUsageError
from replicator.topology import discover

__all__ = ["AsyncSettings", "check_shardable"]

MODES = ("sync", "diloco", "async", "actor_learner")  # actor_learner: asynchronous.roles


@dataclass(frozen=True)
class AsyncSettings:
    """`Replicator(mode="async", parameter_servers=P, sync_group_size=G, max_staleness=S)`.

    The last P processes serve parameters; the others are workers in sync groups of G
    consecutive ranks. S bounds how many server updates a group's parameters may lag when its
    gradient is applied (0: bulk-synchronous, None: unbounded).
    """

    parameter_servers: int = 1
    sync_group_size: int = 1
    max_staleness: int | None = None

    @classmethod
    def of(cls, mode: str, parameter_servers: int, sync_group_size: int, max_staleness: int | None,
           stages: int, world_size: int | None = None, servers_name: str = "parameter_servers") -> AsyncSettings | None:
        """The settings of `mode` ("sync" gives None), or a ReplicatorUsageError saying what to change (naming the
        server count as the caller spelled it: `servers_name`).

        Every process gets the same arguments and world size (the launcher's, by default), so every
        process raises alike, before any process group exists."""
        world_size = discover().world_size if world_size is None else world_size
        if mode not in MODES:
            raise ReplicatorUsageError(f"unknown mode={mode!r}: use one of {', '.join(map(repr, MODES))}")
        if mode != "async":  # "sync" and "diloco" (whose own arguments replicator.asynchronous.diloco checks)
            if parameter_servers or max_staleness is not None:
                raise ReplicatorUsageError(
                    "parameter_servers and max_staleness belong to the parameter-server regime: pass mode='async' "
                    "with them")
            return None
        if stages > 1:
            raise ReplicatorUsageError(
                f"mode='async' with stages={stages} is not supported yet: parameter servers hold whole models; "
                "use stages=1, or mode='sync' for a pipeline")
        if not isinstance(parameter_servers, int):  # e.g. rp.ParameterServers(...) given to the keyword
            raise ReplicatorUsageError(
                f"{servers_name} must be a number of servers, got {parameter_servers!r}: pass a config object as "
                "mode=rp.ParameterServers(...)")
        if parameter_servers < 1:
            raise ReplicatorUsageError(f"mode='async' needs {servers_name} >= 1, got {parameter_servers}")
        if max_staleness is not None and max_staleness < 0:
            raise ReplicatorUsageError(
                f"max_staleness={max_staleness} is negative: use 0 (bulk-synchronous), a positive bound, or None "
                "(unbounded)")
        if parameter_servers >= world_size:
            raise ReplicatorUsageError(
                f"{servers_name}={parameter_servers} leaves no worker in a job of {world_size} process(es): "
                f"launch at least {parameter_servers + sync_group_size} processes or use fewer servers")
        workers = world_size - parameter_servers
        if sync_group_size < 1 or workers % sync_group_size:
            raise ReplicatorUsageError(
                f"the {workers} workers ({world_size} processes less {parameter_servers} server(s)) do not divide "
                f"into sync groups of sync_group_size={sync_group_size}: pick a divisor of {workers} or launch "
                f"{parameter_servers} + a multiple of {max(sync_group_size, 1)} processes")
        return cls(parameter_servers, sync_group_size, max_staleness)

    @property
    def bound(self) -> str:
        return "unbounded" if self.max_staleness is None else f"S = {self.max_staleness}"


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose update cannot be split by parameter across servers.

    Servers apply the user's optimizer to the parameters they hold, so its update must be a
    function of each parameter's own gradient and state. LBFGS flattens every parameter into
    one vector and re-evaluates the loss through a closure: neither can be cut into shards.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ReplicatorUsageError(
            "mode='async' cannot shard torch.optim.LBFGS: its state is one vector over all parameters and its step "
            "re-evaluates the loss through a closure, which a parameter server cannot run. Use a per-parameter "
            "optimizer (SGD, Adam, AdamW, RMSprop, ...) or mode='sync'")
