"""What a replica sees: InputContext for input_fn, ReplicaContext for step_fn."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.data import DistributedSampler

from replicator import evaluation
from replicator._tree import flatten
from replicator.comm import all_to_all as _all_to_all
from replicator.comm import collectives, objects
from replicator.comm.agreement import Agreement, Verdict, call_site
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
        self.epoch = 0  # the epoch of the batch step_fn is given (run() counts them)
        # This replica's share of the step's samples while step_fn runs a step whose replicas
        # hold unequal counts under uneven_batches="weighted"; None otherwise.
        self.sample_share: float | None = None
        # Seconds spent blocked in collectives are reported here (the step breakdown).
        self.on_wait: Callable[[float], None] = lambda seconds: None
        # The step loop's look at what this replica feeds into each collective (whose NaN it was).
        self.on_collective: Callable[[str, torch.Tensor], None] | None = None

    def _agree(self, operation: str, tensor: torch.Tensor, detail: str = "", values: Sequence[int] = (),
               any_length: bool = False) -> Verdict | None:
        """Check that every replica makes this call; `any_length`: dimension 0 may differ (it goes in
        `values`, whose extremes over the replicas come back in the Verdict)."""
        if not isinstance(tensor, torch.Tensor):
            raise ReplicatorUsageError(
                f"ctx.{operation} takes a torch.Tensor, got {type(tensor).__name__} "
                f"(replica {self.replica_id}, {call_site()}); wrap numbers with torch.tensor(...)"
            )
        if self.num_replicas == 1:
            return None
        self._sequence += 1
        shape = (f"(*{''.join(f', {size}' for size in tensor.shape[1:])})" if any_length and tensor.dim()
                 else str(tuple(tensor.shape)))
        # The device too: a host tensor may travel over the node's link where a GPU one takes NCCL. And
        # the call site: a stray call in a branch must not pair with another replica's call elsewhere.
        signature = (f"ctx.{operation}#{self._sequence} shape={shape} dtype={tensor.dtype} "
                     f"device={tensor.device.type}{detail} at {call_site()}")
        return self._agreement.require_same(signature, "", values)

    def _call(self, operation: str, tensor: torch.Tensor, *args: Any, detail: str = "") -> torch.Tensor:
        started = time.perf_counter()
        self._agree(operation, tensor, detail)
        if self.on_collective is not None:
            self.on_collective(operation, tensor)
        result = getattr(collectives, operation)(tensor, *args, self.group)
        self.on_wait(time.perf_counter() - started)
        return result

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over replicas; differentiable."""
        return self._call("all_sum", tensor)

    def all_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise mean over replicas; differentiable.

        With uneven_batches="weighted", in a step whose replicas hold unequal batches, each
        replica weighs by its share of the samples: the mean loss over the global batch.
        """
        if self.sample_share is not None and isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return self._call("all_sum", tensor * self.sample_share)
        return self._call("all_mean", tensor)

    def all_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum; the gradient goes to the replicas that attained it."""
        return self._call("all_max", tensor)

    def all_min(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise minimum; the gradient goes to the replicas that attained it."""
        return self._call("all_min", tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every replica's tensor concatenated along dimension 0, in replica order; differentiable.

        Dimension 0 may differ between replicas (the predictions of an uneven last batch); the
        other dimensions, the dtype and the device must match.
        """
        started = time.perf_counter()
        rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else 0
        verdict = self._agree("all_gather", tensor, values=[rows], any_length=True)
        # The common case, equal lengths, costs nothing more: the check above carried them.
        lengths = None if verdict is None or verdict.unanimous else collectives.first_dims(tensor, self.group)
        result = collectives.all_gather(tensor, self.group, lengths)
        self.on_wait(time.perf_counter() - started)
        return result

    def broadcast(self, tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Replica `source`'s tensor on every replica; differentiable."""
        if not 0 <= source < self.num_replicas:
            raise ReplicatorUsageError(f"broadcast source {source} is not a replica id in [0, {self.num_replicas})")
        return self._call("broadcast", tensor, source, detail=f" source={source}")

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over replicas, split along dimension 0; replica r keeps slice r."""
        return self._call("reduce_scatter", tensor)

    def all_to_all(self, tensor: torch.Tensor, input_split_sizes: _all_to_all.Splits = None,
                   output_split_sizes: _all_to_all.Splits = None) -> torch.Tensor:
        """Rows of `tensor` sent to each replica, rows from each received, in replica order; differentiable.

        This replica sends its first `input_split_sizes[0]` rows to replica 0, the next
        `input_split_sizes[1]` to replica 1, and so on (equal parts when left out), as
        torch.distributed.all_to_all_single does. `output_split_sizes` (rows from each replica)
        may be left out: it is worked out from the others' input splits, and checked when given.
        """
        started = time.perf_counter()
        even = input_split_sizes is None and output_split_sizes is None
        rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else 0
        verdict = self._agree("all_to_all", tensor, detail=" splits=" + ("even" if even else "given"),
                              values=[rows], any_length=True)
        if even and (verdict is None or verdict.unanimous):
            # Every replica cuts the same number of rows into equal parts: nothing to exchange (or to check).
            send = receive = _all_to_all.even_routes(rows, self.num_replicas)
        else:
            send, receive = _all_to_all.routes(tensor, input_split_sizes, output_split_sizes, self.group)
        result = _all_to_all.all_to_all(tensor, send, receive, self.group)
        self.on_wait(time.perf_counter() - started)
        return result

    def evaluation_sampler(self, dataset: Any) -> evaluation.EvaluationSampler:
        """This replica's contiguous share of `dataset` for evaluation: in order, every sample once, no padding.

        Shares differ by at most one sample (1,797 over 2 replicas: 899 and 898), so the last
        batches may be uneven: gather_for_metrics takes them as they are. Concatenated in
        replica order the shares are the dataset.
        """
        return evaluation.EvaluationSampler(dataset, self.num_replicas, self.replica_id)

    def gather_for_metrics(self, values: Any, sampler: Any = None) -> Any:
        """Every replica's evaluation `values`, whole: each sample once, in dataset order, on every replica.

        `values`: a tensor, or a dict/list/tuple of tensors, whose dimension 0 runs over this
        replica's samples (predictions, labels, per-sample losses): concatenate the batches and
        gather once. With samples from `evaluation_sampler` (shares in order, no padding) the
        replicas' rows concatenated are the dataset's. With any other sampler pass it (or the
        DataLoader) as `sampler`: the rows are matched to its dataset indices, put in dataset
        order, and a sample it repeated to even the replicas out (DistributedSampler's padding)
        is kept once. Dimension 0 may differ between replicas.
        """
        leaves, spec = flatten(values)
        if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise ReplicatorUsageError(
                f"ctx.gather_for_metrics takes a tensor or a dict/list/tuple of tensors, got {type(values).__name__} "
                f"(replica {self.replica_id}, {call_site()}); numbers and strings go through ctx.all_gather_object")
        columns = [leaf.reshape(1) if leaf.dim() == 0 else leaf for leaf in leaves]
        rows = {int(column.shape[0]) for column in columns}
        indices = None if sampler is None else torch.tensor(evaluation.sampler_indices(sampler), dtype=torch.int64,
                                                            device=columns[0].device)
        wrong = len(rows) > 1 or (indices is not None and {len(indices)} != rows)
        # Agreed first, so that a replica whose values do not fit raises on every replica instead of one.
        verdict = self._agree("gather_for_metrics", torch.empty(0), detail=f" leaves={len(columns)}",
                              values=[int(wrong)], any_length=True)
        if wrong or (verdict is not None and verdict.maxima[0]):
            mine = (f"its values have {sorted(rows)} rows" + (f" for the {len(indices)} indices its sampler gives"
                                                               if indices is not None else ""))
            raise ReplicatorUsageError(
                f"ctx.gather_for_metrics at {call_site()} got values that do not match their samples on some replica "
                f"(on replica {self.replica_id} {mine}; raised on every replica): concatenate every batch's "
                "values (torch.cat) and gather once after the evaluation loop, with the sampler that gave them")
        gathered = [self.all_gather(column) for column in columns]
        if indices is not None:
            gathered = evaluation.in_dataset_order(gathered, self.all_gather(indices))
        return pytree.tree_unflatten(gathered, spec)

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every replica's `value` (a config, metrics, a string), in replica order.

        Values travel as JSON with their containers' types, never pickled: None, bool, int,
        float, str, bytes, and lists, tuples and dicts of those. Anything else raises an
        error naming where it sits in the value, on every replica.
        """
        started = time.perf_counter()
        self._agree("all_gather_object", torch.empty(0, dtype=torch.uint8), any_length=True)
        result = objects.all_gather_values(value, self.group)
        self.on_wait(time.perf_counter() - started)
        return result

    def broadcast_object(self, value: Any = None, source: int = 0) -> Any:
        """Replica `source`'s `value` on every replica (what the others pass is ignored); encoded
        as all_gather_object's values are."""
        if not 0 <= source < self.num_replicas:
            raise ReplicatorUsageError(f"broadcast source {source} is not a replica id in [0, {self.num_replicas})")
        started = time.perf_counter()
        self._agree("broadcast_object", torch.empty(0, dtype=torch.uint8), detail=f" source={source}",
                    any_length=True)
        result = objects.broadcast_value(value, source, self.group)
        self.on_wait(time.perf_counter() - started)
        return result


_active_context: ReplicaContext | None = None


def active_context() -> ReplicaContext | None:
    """The ReplicaContext of the Replicator constructed last in this process, if any."""
    return _active_context


def set_active_context(context: ReplicaContext | None) -> None:
    global _active_context
    _active_context = context
