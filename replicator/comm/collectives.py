"""Autograd-aware collectives over a process group; the identity for a single replica.

The backward of each is the collective that makes the total loss Σ_replicas L_r
differentiate correctly: a sum's gradient is the sum of every replica's upstream gradient,
a gather's gradient is that sum sliced back to this replica's part, and so on. This is
what lets cross-replica batch norm be written with these functions alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm.local_link import LocalLink

__all__ = ["all_sum", "all_mean", "all_max", "all_min", "all_gather", "broadcast", "reduce_scatter", "group_size",
           "attach_link", "detach_link"]

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


def _link_for(group: Group, tensor: torch.Tensor) -> LocalLink | None:
    if (group is None or tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.numel() == 0
            or tensor.numel() * tensor.element_size() > LINK_BYTES):
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
    link = _link_for(group, tensor)
    if link is None:
        dist.all_gather(parts, tensor, group=group)
        return
    for part, row in zip(parts, _exchange(link, tensor)):
        part.copy_(row)


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _summed(tensor: torch.Tensor, group: Group, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    link = _link_for(group, tensor)
    if link is not None:
        return _reduce_rows(_exchange(link, tensor), op)
    result = tensor.detach().clone(memory_format=torch.contiguous_format)
    if group is not None:
        dist.all_reduce(result, op=op, group=group)
    return result


class _AllSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group, scale: float) -> torch.Tensor:
        ctx.group, ctx.scale = group, scale
        result = _summed(tensor, group)
        return result.mul_(scale) if scale != 1.0 else result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        summed = _summed(grad, ctx.group)
        return (summed.mul_(ctx.scale) if ctx.scale != 1.0 else summed), None, None


class _AllExtreme(torch.autograd.Function):
    """Max or min; the gradient flows to the elements that attained it, split among ties."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group, op: Any) -> torch.Tensor:
        ctx.group = group
        result = _summed(tensor, group, op)
        attained = (tensor.detach() == result).to(tensor.dtype)
        ctx.save_for_backward(attained, _summed(attained, group))
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        attained, ties = ctx.saved_tensors
        return _summed(grad, ctx.group) * attained / ties.clamp_min(1), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.length = group, tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(group_size(group))]
        _all_gather_into(parts, tensor.detach().contiguous(), group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = _group_rank(ctx.group) * ctx.length
        return _summed(grad, ctx.group)[start : start + ctx.length], None


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
        dist.broadcast(result, src=dist.get_global_rank(members, source), group=group)
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
        parts = [torch.empty_like(grad) for _ in range(group_size(ctx.group))]
        _all_gather_into(parts, grad.contiguous(), ctx.group)
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


def all_gather(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Concatenate every replica's tensor along dimension 0, in replica order."""
    return tensor if group_size(group) == 1 else _AllGather.apply(tensor, group)


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
