"""Split a sequence of layers into K contiguous stages: by layer counts, parameters or measured time.

`balance` is either an explicit list of layer counts (one per stage), or a cost to
balance: "params" (parameter count of each layer) or "time" (forward+backward time of each
layer on a sample batch). For a cost, the split minimises the cost of the most expensive
stage, since the slowest stage sets the pace of the whole pipeline.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from replicator._tree import map_tensors, tensors

__all__ = [
    "Balance",
    "layers_of",
    "check_stage_count",
    "solve_balance",
    "balance_by_params",
    "profile_times",
    "balance_by_time",
    "resolve_balance",
    "split",
    "partition",
]

Balance = Sequence[int] | str


def layers_of(modules: nn.Sequential | nn.ModuleList | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(name, layer) pairs; an nn.Sequential keeps its own names so stage state_dict keys match."""
    if isinstance(modules, (nn.Sequential, nn.ModuleList)):
        # Not named_children(): it yields a module used twice (tied weights) once, and the
        # stages would silently lose a layer. Sequential.forward runs every entry.
        layers = [(name, layer) for name, layer in modules._modules.items() if layer is not None]
    elif isinstance(modules, nn.Module):
        raise TypeError(
            f"a pipeline splits a sequence of layers; got a single {type(modules).__name__}. Pass an nn.Sequential "
            "or a list of modules whose outputs feed each other in order"
        )
    else:
        layers = [(str(i), m) for i, m in enumerate(modules)]
    for name, layer in layers:
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {name} is a {type(layer).__name__}, not an nn.Module")
    if not layers:
        raise ValueError("cannot build a pipeline from an empty list of layers")
    return layers


def check_stage_count(num_layers: int, num_stages: int) -> None:
    """Raise ValueError unless `num_layers` layers can fill `num_stages` stages."""
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layer(s) into {num_stages} stages: every stage needs at least one layer. "
            "Use fewer stages or split the model into more layers"
        )


def solve_balance(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layer counts of the contiguous split of `costs` whose most expensive stage is cheapest."""
    n = len(costs)
    check_stage_count(n, num_stages)
    prefix = [0.0]
    for cost in costs:
        if cost < 0 or math.isnan(cost):
            raise ValueError(f"layer costs must be non-negative numbers, got {list(costs)}")
        prefix.append(prefix[-1] + float(cost))
    inf = float("inf")
    # best[k][j]: the cheapest bottleneck for the first j layers in k stages; cut[k][j]: where stage k starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                candidate = max(best[k - 1][i], prefix[j] - prefix[i])
                # On ties prefer the later cut: earlier stages also wait for the pipeline to fill.
                if candidate <= best[k][j]:
                    best[k][j], cut[k][j] = candidate, i
    counts: list[int] = []
    j = n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def balance_by_params(modules: nn.Sequential | Sequence[nn.Module], num_stages: int) -> list[int]:
    """Balance the number of parameters (a proxy for memory and, often, time) per stage."""
    layers = layers_of(modules)
    costs = [sum(p.numel() for p in layer.parameters()) for _, layer in layers]
    return solve_balance(costs, num_stages)


def _detached(value: Any) -> Any:
    """`value` cut from any graph, its floating-point tensors leaves that want a gradient."""
    def detach(tensor: torch.Tensor) -> torch.Tensor:
        leaf = tensor.detach()
        return leaf.requires_grad_(True) if leaf.is_floating_point() else leaf

    return map_tensors(detach, value)


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_times(
    modules: nn.Sequential | Sequence[nn.Module],
    sample: Any,
    *,
    repeat: int = 3,
    device: torch.device | str | None = None,
) -> list[float]:
    """Seconds each layer takes for forward + backward on `sample` (the input of the first layer).

    The fastest of `repeat` runs counts (the others mostly measure interference). Buffers
    (batch-norm statistics), gradients and the random number generator are restored
    afterwards, so profiling leaves the model as it found it.
    """
    layers = layers_of(modules)
    device = torch.device(device) if device is not None else None
    saved_buffers = [(b, b.detach().clone()) for _, layer in layers for b in layer.buffers()]
    saved_grads = [(p, p.grad) for _, layer in layers for p in layer.parameters()]
    for param, _ in saved_grads:
        param.grad = None  # else backward would add into the saved tensors, in place
    times: list[float] = []
    devices = [device] if device is not None and device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            x = sample if device is None else map_tensors(lambda t: t.to(device), sample)
            for name, layer in layers:
                best = float("inf")
                output: Any = None
                for _ in range(max(1, repeat)):
                    inputs = _detached(x)
                    _synchronize(device)
                    started = time.perf_counter()
                    output = layer(inputs)
                    outs = [t for t in tensors(output) if t.requires_grad]
                    if outs:
                        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                    _synchronize(device)
                    best = min(best, time.perf_counter() - started)
                times.append(best)
                x = output
                if not tensors(x):
                    raise TypeError(f"layer {name} returned {type(x).__name__}, not a tensor or a structure of tensors")
    finally:
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
        for param, grad in saved_grads:
            param.grad = grad
    return times


def balance_by_time(
    modules: nn.Sequential | Sequence[nn.Module],
    num_stages: int,
    sample: Any,
    *,
    repeat: int = 3,
    device: torch.device | str | None = None,
) -> list[int]:
    """Balance measured forward+backward time per stage, so the slowest stage is as fast as it can be."""
    layers = layers_of(modules)
    check_stage_count(len(layers), num_stages)
    return solve_balance(profile_times(modules, sample, repeat=repeat, device=device), num_stages)


def resolve_balance(
    modules: nn.Sequential | Sequence[nn.Module],
    num_stages: int,
    balance: Balance,
    *,
    sample: Any = None,
    device: torch.device | str | None = None,
) -> list[int]:
    """Turn `balance` (layer counts, "params" or "time") into checked layer counts per stage."""
    layers = layers_of(modules)
    check_stage_count(len(layers), num_stages)
    if isinstance(balance, str):
        if balance == "params":
            return balance_by_params(modules, num_stages)
        if balance == "time":
            if sample is None:
                raise ValueError(
                    'balance="time" profiles each layer on a sample batch: pass sample=<a batch for the first layer>'
                )
            return balance_by_time(modules, num_stages, sample, device=device)
        raise ValueError(f'balance must be a list of layer counts, "params" or "time", got {balance!r}')
    counts = [int(c) for c in balance]
    if any(c != b for c, b in zip(counts, balance)):
        raise ValueError(f"balance must hold whole numbers of layers, got {list(balance)}")
    if len(counts) != num_stages:
        raise ValueError(f"balance {counts} has {len(counts)} entries but the pipeline has {num_stages} stages")
    if any(c < 1 for c in counts):
        raise ValueError(f"balance {counts} gives a stage no layers; every stage needs at least one")
    if sum(counts) != len(layers):
        raise ValueError(
            f"balance {counts} covers {sum(counts)} layers but the model has {len(layers)}; the counts must add up "
            "to the number of layers"
        )
    return counts


def split(modules: nn.Sequential | Sequence[nn.Module], balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut the layers into stages of `balance[k]` consecutive layers each (checked for shared layers)."""
    layers = layers_of(modules)
    counts = resolve_balance(modules, len(balance), list(balance))
    stages: list[nn.Sequential] = []
    start = 0
    for count in counts:
        stages.append(nn.Sequential(OrderedDict(layers[start : start + count])))
        start += count
    owner: dict[int, int] = {}
    for k, stage in enumerate(stages):
        named = [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            first = owner.setdefault(id(tensor), k)
            if first != k:
                kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
                raise ValueError(
                    f"{kind} {name} is shared by stages {first} and {k}; stages live in different processes and "
                    f"cannot share a {kind}. Keep a layer used twice, or tied layers, in one stage (adjust balance)"
                )
    return stages


def partition(
    modules: nn.Sequential | Sequence[nn.Module],
    num_stages: int,
    balance: Balance = "params",
    *,
    sample: Any = None,
    device: torch.device | str | None = None,
) -> list[nn.Sequential]:
    """Split `modules` into `num_stages` nn.Sequential stages according to `balance`."""
    return split(modules, resolve_balance(modules, num_stages, balance, sample=sample, device=device))
