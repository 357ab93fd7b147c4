"""Autograd-aware collectives over a process group; the identity for a single replica.

The backward of each is the collective that makes the total loss Σ_replicas L_r
differentiate correctly: a sum's gradient is the sum of every replica's upstream gradient,
a gather's gradient is that sum sliced back to this replica's part, and so on. This is
what lets cross-replica batch norm be written with these functions alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm import dtypes
from replicator.comm.local_link import LocalLink

__all__ = ["all_sum", "all_mean", "all_max", "all_min", "all_gather", "broadcast", "reduce_scatter", "group_size",
           "first_dims", "attach_link", "detach_link"]

Group = dist.ProcessGroup | None

# Host tensors up to a link's largest message (a loss, batch-norm statistics) go over a group's
# LocalLink when it has one: one message to each peer, several times faster than a Gloo
# collective. Larger ones stay on the backend, whose bandwidth is better.
LINK_BYTES = LocalLink.MAX_PAYLOAD
_links: dict[dist.ProcessGroup, LocalLink] = {}


def attach_link(group: dist.ProcessGroup, link: LocalLink) -> None:
    """Send small host tensors of `group`'s collectives over `link`: its members must be the
    group's, in the group's order. Every member must then pass tensors of one size, device and
    layout to each collective (as Gloo needs anyway), so that all of them take the same path."""
    _links[group] = link


def detach_link(group: dist.ProcessGroup, link: LocalLink) -> None:
    if _links.get(group) is link:
        del _links[group]


def _link_for(group: Group, tensor: torch.Tensor, nbytes: int | None = None) -> LocalLink | None:
    """The link for `tensor`'s collective, or None for the backend. `nbytes`: the largest message
    any member sends, where members' sizes differ (every member must decide the same)."""
    nbytes = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
    if (group is None or tensor.device.type != "cpu" or tensor.layout != torch.strided or nbytes == 0
            or nbytes > LINK_BYTES):
        return None
    return _links.get(group)


def _exchange(link: LocalLink, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every member's `tensor` over the link, in group order."""
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    mine = flat.view(torch.uint8).numpy().tobytes()
    payloads = link.collect(link.post(mine))
    sizes = [len(mine) if at == link.position else len(payload) for at, payload in enumerate(payloads)]
    if len(set(sizes)) > 1:
        raise RuntimeError(f"replicas passed tensors of different sizes to one collective ({sizes} bytes in replica "
                           f"order; this replica's has shape {tuple(tensor.shape)} and dtype {tensor.dtype}): every "
                           "replica must pass the same shape and dtype")
    return [tensor.detach() if at == link.position else
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)
            for at, payload in enumerate(payloads)]


_COMBINE: dict[Any, Callable[..., torch.Tensor]] = {
    dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum,
}


def _reduce_rows(rows: list[torch.Tensor], op: Any) -> torch.Tensor:
    """Rows combined in group order on every member, so every member gets the same bits."""
    combine = _COMBINE[op]
    result = rows[0].clone(memory_format=torch.contiguous_format)
    for row in rows[1:]:
        combine(result, row, out=result)
    return result


def _all_gather_into(parts: list[torch.Tensor], tensor: torch.Tensor, group: Group) -> None:
    """`parts` (contiguous, one per member) receive every member's contiguous `tensor`."""
    link = _link_for(group, tensor)
    if link is None:
        if dtypes.carried(tensor):
            dist.all_gather(parts, tensor, group=group)
        else:
            dist.all_gather([dtypes.as_bytes(part) for part in parts], dtypes.as_bytes(tensor), group=group)
        return
    for part, row in zip(parts, _exchange(link, tensor)):
        part.copy_(row)


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _summed(tensor: torch.Tensor, group: Group, op: Any = dist.ReduceOp.SUM, scale: float = 1.0) -> torch.Tensor:
    """A new tensor: the members' tensors combined by `op`, times `scale`, in `tensor`'s dtype."""
    wide, wide_op, restore = dtypes.reducible(tensor, op)
    link = _link_for(group, wide)
    if link is not None:
        result = _reduce_rows(_exchange(link, wide), wide_op)
    else:
        result = wide.detach().clone(memory_format=torch.contiguous_format)
        if group is not None:
            dist.all_reduce(result, op=wide_op, group=group)
    return restore(result.mul_(scale) if scale != 1.0 else result)


def first_dims(tensor: torch.Tensor, group: Group = None) -> list[int]:
    """Every member's `tensor.shape[0]`, in group order."""
    mine = torch.tensor([tensor.shape[0] if tensor.dim() else 0], dtype=torch.int64)
    return [int(length) for length in all_gather(mine, group)]


def _gather_uneven(tensor: torch.Tensor, lengths: Sequence[int], group: Group) -> torch.Tensor:
    """Members' contiguous tensors whose first dimensions are `lengths`, concatenated: over the link
    as they are, over the backend padded to the longest and trimmed."""
    rows, longest = tensor.shape[1:], max(lengths)
    row_bytes = math.prod(rows) * tensor.element_size()
    link = _link_for(group, tensor, nbytes=longest * row_bytes)
    if link is not None:
        payloads = link.collect(link.post(dtypes.as_bytes(tensor).numpy().tobytes()))
        parts = []
        for at, (length, payload) in enumerate(zip(lengths, payloads)):
            if at == link.position or length == 0:
                parts.append(tensor if at == link.position else tensor.new_empty((0, *rows)))
                continue
            if len(payload) != length * row_bytes:
                raise RuntimeError(f"replica {at} sent {len(payload)} bytes to an all_gather where {length} rows of "
                                   f"{row_bytes} bytes were announced")
            received = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            parts.append(received.view(tensor.dtype).view(length, *rows))
        return torch.cat(parts, dim=0)
    padded = tensor.new_zeros((longest, *rows))
    padded[: tensor.shape[0]] = tensor
    everyone = [torch.empty_like(padded) for _ in lengths]
    _all_gather_into(everyone, padded, group)
    return torch.cat([part[:length] for part, length in zip(everyone, lengths)], dim=0)


class _AllSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group, scale: float) -> torch.Tensor:
        ctx.group, ctx.scale = group, scale
        return _summed(tensor, group, scale=scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _summed(grad, ctx.group, scale=ctx.scale), None, None


class _AllExtreme(torch.autograd.Function):
    """Max or min; the gradient flows to the elements that attained it, split among ties."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group, op: Any) -> torch.Tensor:
        ctx.group, ctx.dtype = group, tensor.dtype
        result = _summed(tensor, group, op)
        if tensor.is_floating_point() and dtypes.carried(tensor):  # float8 has no == (nor much of autograd)
            attained = (tensor.detach() == result).to(tensor.dtype)
            ctx.save_for_backward(attained, _summed(attained, group))
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if not ctx.saved_tensors:
            raise TypeError(f"all_max/all_min of {ctx.dtype} tensors has no gradient: reduce them in float32")
        attained, ties = ctx.saved_tensors
        return _summed(grad, ctx.group) * attained / ties.clamp_min(1), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group, lengths: list[int]) -> torch.Tensor:
        ctx.group, ctx.lengths = group, lengths
        contiguous = tensor.detach().contiguous()
        if len(set(lengths)) > 1:
            return _gather_uneven(contiguous, lengths, group)
        parts = [torch.empty_like(contiguous) for _ in lengths]
        _all_gather_into(parts, contiguous, group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        rank = _group_rank(ctx.group)
        start = sum(ctx.lengths[:rank])
        return _summed(grad, ctx.group)[start : start + ctx.lengths[rank]], None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group, source: int) -> torch.Tensor:
        ctx.group, ctx.source = group, source
        link = _link_for(group, tensor)
        if link is not None:
            return _exchange(link, tensor)[source].clone(memory_format=torch.contiguous_format)
        result = tensor.detach().clone(memory_format=torch.contiguous_format)
        members = group if group is not None else dist.group.WORLD
        assert members is not None
        carried = result if dtypes.carried(result) else dtypes.as_bytes(result)
        dist.broadcast(carried, src=dist.get_global_rank(members, source), group=group)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        summed = _summed(grad, ctx.group)
        return (summed if _group_rank(ctx.group) == ctx.source else torch.zeros_like(summed)), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        size, rank = group_size(group), _group_rank(group)
        length = tensor.shape[0] // size
        if dist.get_backend(group) == "nccl":
            result = torch.empty((length, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
            dist.reduce_scatter_tensor(result, tensor.detach().contiguous(), group=group)
            return result
        # Gloo has no reduce-scatter; an all-reduce moves twice the bytes but is exact.
        return _summed(tensor, group)[rank * length : (rank + 1) * length].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        contiguous = grad.contiguous()
        parts = [torch.empty_like(contiguous) for _ in range(group_size(ctx.group))]
        _all_gather_into(parts, contiguous, ctx.group)
        return torch.cat(parts, dim=0), None


def all_sum(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Element-wise sum over replicas."""
    return tensor if group_size(group) == 1 else _AllSum.apply(tensor, group, 1.0)


def all_mean(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Element-wise mean over replicas (floating-point tensors)."""
    if not tensor.is_floating_point() and not tensor.is_complex():
        raise TypeError(f"all_mean needs a floating-point tensor, got {tensor.dtype}; use all_sum for integers")
    return tensor if group_size(group) == 1 else _AllSum.apply(tensor, group, 1.0 / group_size(group))


def all_max(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Element-wise maximum over replicas."""
    return tensor if group_size(group) == 1 else _AllExtreme.apply(tensor, group, dist.ReduceOp.MAX)


def all_min(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Element-wise minimum over replicas."""
    return tensor if group_size(group) == 1 else _AllExtreme.apply(tensor, group, dist.ReduceOp.MIN)


def all_gather(tensor: torch.Tensor, group: Group = None, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every replica's tensor along dimension 0, in replica order.

    `lengths`: every replica's dimension 0, in replica order, where they may differ (an uneven
    last batch; `first_dims` finds them); without it every replica must pass the same shape.
    """
    if tensor.dim() == 0:
        raise ValueError("all_gather concatenates along dimension 0, so it needs a tensor with at least one "
                         "dimension: pass tensor.reshape(1)")
    size = group_size(group)
    if lengths is not None and (len(lengths) != size or lengths[_group_rank(group)] != tensor.shape[0]):
        raise ValueError(f"lengths {list(lengths)} do not give this replica's {tensor.shape[0]} rows among "
                         f"{size} replicas")
    if size == 1:
        return tensor
    return _AllGather.apply(tensor, group, list(lengths) if lengths is not None else [tensor.shape[0]] * size)


def broadcast(tensor: torch.Tensor, source: int = 0, group: Group = None) -> torch.Tensor:
    """Every replica receives replica `source`'s tensor."""
    return tensor if group_size(group) == 1 else _Broadcast.apply(tensor, group, source)


def reduce_scatter(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum over replicas, then replica r keeps the r-th equal slice along dimension 0."""
    size = group_size(group)
    if tensor.dim() == 0 or tensor.shape[0] % size != 0:
        raise ValueError(
            f"reduce_scatter needs dimension 0 divisible by the {size} replicas, got shape {tuple(tensor.shape)}"
        )
    return tensor if size == 1 else _ReduceScatter.apply(tensor, group)
