"""All-to-all with split sizes (mixture-of-experts dispatch and its return), autograd-aware.

Replica r sends rows `send[q]` of its tensor, in order, to each replica q and receives
`receive[q]` rows from each, concatenated in replica order: the semantics of
`torch.distributed.all_to_all_single` with split sizes. The gradient is the same exchange run
backwards (the splits swap). `routes` works the splits out from what each replica knows, and
checks them together, so a wrong split raises the same error on every replica instead of
handing Gloo buffers of the wrong size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm import collectives, dtypes
from replicator.errors import ReplicatorUsageError

__all__ = ["all_to_all", "routes", "even_routes", "Splits"]

Group = dist.ProcessGroup | None
Splits = Sequence[int] | torch.Tensor | None

_VALID, _BAD_INPUT, _BAD_OUTPUT = 0, 1, 2


def _as_counts(splits: Splits, replicas: int, name: str) -> list[int]:
    """`splits` as a list of row counts, one per replica; ValueError saying what is wrong."""
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor or a sequence of ints, got a {splits.dim()}-D "
                             f"{splits.dtype} tensor")
        splits = splits.tolist()
    assert splits is not None
    counts = list(splits)
    if len(counts) != replicas or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise ValueError(f"{name} must hold {replicas} non-negative ints (one per replica), got {counts}")
    return counts


def even_routes(rows: int, replicas: int) -> list[int]:
    """The splits of `rows` into equal parts, one per replica; ValueError when they do not divide."""
    if rows % replicas:
        raise ValueError(f"an all_to_all without split sizes cuts dimension 0 into {replicas} equal parts, but it "
                         f"has {rows} rows: pass input_split_sizes")
    return [rows // replicas] * replicas


def routes(tensor: torch.Tensor, input_splits: Splits, output_splits: Splits,
           group: Group = None) -> tuple[list[int], list[int]]:
    """(rows this replica sends to each replica, rows it receives from each), agreed by all.

    Collective: every replica shares its splits (a row of a few integers), so output split
    sizes may be left out (they are worked out) and, when given, are checked against what the
    others send. Any inconsistency raises the same ReplicatorUsageError on every replica.
    """
    replicas, me = collectives.group_size(group), 0 if group is None else dist.get_rank(group)
    rows = tensor.shape[0]
    status, problem, send, receive = _VALID, "", [0] * replicas, [-1] * replicas
    try:
        send = (_as_counts(input_splits, replicas, "input_split_sizes") if input_splits is not None
                else even_routes(rows, replicas))
        if sum(send) != rows:
            raise ValueError(f"input_split_sizes {send} add up to {sum(send)} rows, but the tensor has {rows}")
    except ValueError as error:
        status, problem, send = _BAD_INPUT, str(error), [0] * replicas
    if status == _VALID and output_splits is not None:
        try:
            receive = _as_counts(output_splits, replicas, "output_split_sizes")
        except ValueError as error:
            status, problem = _BAD_OUTPUT, str(error)
    mine = torch.tensor([[status, *send, *receive]], dtype=torch.int64)
    table = collectives.all_gather(mine, group).tolist()
    bad = [(replica, row[0]) for replica, row in enumerate(table) if row[0] != _VALID]
    if bad:
        which = "; ".join(f"replica {replica}'s {'input' if kind == _BAD_INPUT else 'output'}_split_sizes"
                          for replica, kind in bad)
        detail = f" (here, on replica {me}: {problem})" if problem else ""
        raise ReplicatorUsageError(f"all_to_all: invalid split sizes from {which}{detail}")
    sent = [row[1 : 1 + replicas] for row in table]  # sent[q][r]: rows replica q sends to replica r
    for replica, row in enumerate(table):
        announced = row[1 + replicas :]
        expected = [sent[q][replica] for q in range(replicas)]
        if announced[0] >= 0 and announced != expected:
            raise ReplicatorUsageError(
                f"all_to_all: replica {replica} expects {announced} rows from replicas 0..{replicas - 1} "
                f"(output_split_sizes), but they send it {expected} (their input_split_sizes): raised on "
                f"replica {me}; leave output_split_sizes out to have them worked out"
            )
    return sent[me], [sent[q][me] for q in range(replicas)]


def _exchange(tensor: torch.Tensor, send: list[int], receive: list[int], group: Group) -> torch.Tensor:
    output = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    if dtypes.carried(tensor):
        dist.all_to_all_single(output, tensor, receive, send, group=group)
    else:
        dist.all_to_all_single(dtypes.rows_as_bytes(output), dtypes.rows_as_bytes(tensor), receive, send, group=group)
    return output


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group, send: list[int], receive: list[int]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return _exchange(tensor.detach().contiguous(), send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # Each received row's gradient goes back to the replica that sent it.
        return _exchange(grad.contiguous(), ctx.receive, ctx.send, ctx.group), None, None, None


def all_to_all(tensor: torch.Tensor, send: Sequence[int], receive: Sequence[int], group: Group = None) -> torch.Tensor:
    """Send `send[q]` rows to each replica q, receive `receive[q]` from each (splits from `routes`)."""
    if tensor.dim() == 0:
        raise ValueError("all_to_all splits dimension 0, so it needs a tensor with at least one dimension")
    if collectives.group_size(group) == 1:
        return tensor
    return _AllToAll.apply(tensor, group, list(send), list(receive))
