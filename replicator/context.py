"""What a replica sees: InputContext for input_fn, ReplicaContext for step_fn."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from replicator.comm import collectives
from replicator.comm.agreement import Agreement, call_site
from replicator.errors import ReplicatorUsageError

__all__ = ["InputContext", "ReplicaContext"]


@dataclass(frozen=True)
class InputContext:
    """Handed to input_fn: which shard of the data this input pipeline reads."""

    num_replicas: int
    replica_id: int
    input_pipeline_id: int
    num_input_pipelines: int

    def per_replica_batch_size(self, global_batch_size: int) -> int:
        """The global batch split evenly, or a clear error when it does not divide."""
        if global_batch_size <= 0 or global_batch_size % self.num_replicas != 0:
            lower = max(self.num_replicas, global_batch_size - global_batch_size % self.num_replicas)
            raise ReplicatorUsageError(
                f"global batch size {global_batch_size} does not divide across {self.num_replicas} replicas "
                f"(raised on replica {self.replica_id}): use a multiple of {self.num_replicas}, "
                f"for example {lower} or {lower + self.num_replicas}"
            )
        return global_batch_size // self.num_replicas

    def sampler(self, dataset: Any, shuffle: bool = True, seed: int = 0, drop_last: bool = True) -> DistributedSampler:
        """This pipeline's shard of a map-style dataset: disjoint from the others', same size.

        drop_last=True (the default) trims the dataset so every replica sees the same
        number of equal batches; False pads by repeating samples, as DistributedSampler does.
        """
        return DistributedSampler(
            dataset, num_replicas=self.num_input_pipelines, rank=self.input_pipeline_id,
            shuffle=shuffle, seed=seed, drop_last=drop_last,
        )


class ReplicaContext:
    """Handed to step_fn: this replica's identity and the cross-replica primitives.

    Each primitive first agrees with the other replicas on what is being called (a tiny
    fixed-size exchange), so a collective issued by only some replicas raises a clear
    error on all of them instead of hanging.
    """

    def __init__(self, replica_id: int, num_replicas: int, group: dist.ProcessGroup | None,
                 agreement: Agreement) -> None:
        self.replica_id = replica_id
        self.num_replicas = num_replicas
        self.group = group
        self._agreement = agreement
        self._sequence = 0
        self.step = 0
        # Seconds spent blocked in collectives are reported here (the step breakdown).
        self.on_wait: Callable[[float], None] = lambda seconds: None

    def _agree(self, operation: str, tensor: torch.Tensor, detail: str = "") -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ReplicatorUsageError(
                f"ctx.{operation} takes a torch.Tensor, got {type(tensor).__name__} "
                f"(replica {self.replica_id}, {call_site()}); wrap numbers with torch.tensor(...)"
            )
        if self.num_replicas == 1:
            return
        self._sequence += 1
        # The device too: a host tensor may travel over the node's link where a GPU one takes NCCL. And
        # the call site: a stray call in a branch must not pair with another replica's call elsewhere.
        signature = (f"ctx.{operation}#{self._sequence} shape={tuple(tensor.shape)} dtype={tensor.dtype} "
                     f"device={tensor.device.type}{detail} at {call_site()}")
        self._agreement.require_same(signature)

    def _call(self, operation: str, tensor: torch.Tensor, *args: Any, detail: str = "") -> torch.Tensor:
        started = time.perf_counter()
        self._agree(operation, tensor, detail)
        result = getattr(collectives, operation)(tensor, *args, self.group)
        self.on_wait(time.perf_counter() - started)
        return result

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over replicas; differentiable."""
        return self._call("all_sum", tensor)

    def all_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise mean over replicas; differentiable."""
        return self._call("all_mean", tensor)

    def all_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum; the gradient goes to the replicas that attained it."""
        return self._call("all_max", tensor)

    def all_min(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise minimum; the gradient goes to the replicas that attained it."""
        return self._call("all_min", tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every replica's tensor concatenated along dimension 0; differentiable."""
        return self._call("all_gather", tensor)

    def broadcast(self, tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Replica `source`'s tensor on every replica; differentiable."""
        if not 0 <= source < self.num_replicas:
            raise ReplicatorUsageError(f"broadcast source {source} is not a replica id in [0, {self.num_replicas})")
        return self._call("broadcast", tensor, source, detail=f" source={source}")

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over replicas, split along dimension 0; replica r keeps slice r."""
        return self._call("reduce_scatter", tensor)


_active_context: ReplicaContext | None = None


def active_context() -> ReplicaContext | None:
    """The ReplicaContext of the Replicator constructed last in this process, if any."""
    return _active_context


def set_active_context(context: ReplicaContext | None) -> None:
    global _active_context
    _active_context = context
