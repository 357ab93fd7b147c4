"""Internal: which server holds which parameters (balanced by size), and a shard's persistent flat buffers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Shard", "ShardMap", "assign_shards"]


def assign_shards(sizes: Sequence[int], servers: int) -> list[list[int]]:
    """Indices of `sizes` per server: largest first onto the least-loaded server (greedy LPT).

    Whole tensors, never split: a server then applies the optimizer to real parameters, whose
    per-parameter state (momentum, Adam's moments) it keeps. Ties go to the lower server, so
    every process computes the same assignment.
    """
    loads = [0] * servers
    shards: list[list[int]] = [[] for _ in range(servers)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(servers), key=lambda s: (loads[s], s))
        shards[server].append(index)
        loads[server] += sizes[index]
    return [sorted(shard) for shard in shards]


class Shard:
    """Some parameters and, once bound, one persistent flat host buffer per dtype that holds their values.

    Bound, a CPU parameter is a view of its flat buffer: a message's bytes land in the
    parameters themselves, and a reply is sent from them, without a copy. A parameter on an
    accelerator keeps its own memory; `gather` and `settle` copy it to and from the buffer.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.dtypes = sorted({p.dtype for p in self.params}, key=str)
        self.numel = sum(p.numel() for p in self.params)
        self.flats: list[torch.Tensor] = []
        self._apart: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its view) where they are not one

    def empty(self) -> list[torch.Tensor]:
        """Buffers, one per dtype, in host memory (what the peer link carries)."""
        return [torch.empty(sum(p.numel() for p in self.params if p.dtype == dtype), dtype=dtype)
                for dtype in self.dtypes]

    def bind(self) -> list[torch.Tensor]:
        """The flat buffers, made once from the parameters' current values; CPU parameters become views of them."""
        if self.flats or not self.params:
            return self.flats
        self.flats = self.empty()
        with torch.no_grad():
            for param, view in zip(self.params, self.unpack(self.flats), strict=True):
                view.copy_(param)
                if param.device.type == "cpu":
                    param.data = view  # the same Parameter (optimizer state and hooks stay): its storage moves
                else:
                    self._apart.append((param, view))
        return self.flats

    def move(self, flats: Sequence[torch.Tensor]) -> None:
        """Bound, make `flats` (the same sizes and dtypes) the buffers: they take the values, CPU parameters become
        views of them (a shared segment's reply slot, where a server's reply lands)."""
        with torch.no_grad():
            for new, old in zip(flats, self.flats, strict=True):
                new.copy_(old)
            self._apart = []
            for param, view in zip(self.params, self.unpack(flats), strict=True):
                if param.device.type == "cpu":
                    param.data = view
                else:
                    self._apart.append((param, view))
        self.flats = list(flats)

    @property
    def apart(self) -> bool:
        """Are some parameters not views of the buffers (on an accelerator), so that a receive must be settled?"""
        return bool(self._apart)

    def gather(self) -> None:
        """Parameters that are not views of the buffers (on an accelerator) into them, before a send."""
        if not self._apart:
            return
        with torch.no_grad():
            for param, view in self._apart:
                view.copy_(param)

    def settle(self) -> None:
        """The buffers into the parameters that are not views of them, after a receive."""
        if not self._apart:
            return
        with torch.no_grad():
            for param, view in self._apart:
                param.copy_(view)

    def unpack(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of `flats` shaped as the parameters, in parameter order."""
        offsets = dict.fromkeys(self.dtypes, 0)
        by_dtype = dict(zip(self.dtypes, flats, strict=True))
        views = []
        for p in self.params:
            start = offsets[p.dtype]
            views.append(by_dtype[p.dtype][start:start + p.numel()].view_as(p))
            offsets[p.dtype] = start + p.numel()
        return views


class ShardMap:
    """Every wrapped optimizer's parameters cut into one Shard per server, the same on every process.

    The assignment balances the servers' total size over all optimizers together; each optimizer
    keeps its own shards, because each optimizer.step() is its own update.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], servers: int) -> None:
        self.optimizers = list(optimizers)
        owned = [(k, p) for k, optimizer in enumerate(self.optimizers)
                 for group in optimizer.param_groups for p in group["params"]]
        server_of = {}
        for server, indices in enumerate(assign_shards([p.numel() for _, p in owned], servers)):
            server_of.update(dict.fromkeys(indices, server))
        self.shards = [[Shard([p for i, (k, p) in enumerate(owned) if k == optimizer and server_of[i] == server])
                        for server in range(servers)] for optimizer in range(len(self.optimizers))]

    def shard(self, optimizer: int, server: int) -> Shard:
        return self.shards[optimizer][server]
