"""A model built on the meta device: each process allocates and initialises only its own stage's layers."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

__all__ = ["Init", "is_meta", "reset_parameters", "materialize", "refuse_meta"]

Init = Callable[[nn.Module], None]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` lies on the meta device (it has a shape but no values)."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def reset_parameters(module: nn.Module) -> None:
    """The default init: every submodule's `reset_parameters()`, children before their parent.

    That is the order in which building the module ran them (torch's layers call their own at
    the end of `__init__`, after their children were built), so the random numbers drawn, and
    the values, are those of building it on a real device with the same generator state.
    """
    for child in module.children():
        reset_parameters(child)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def materialize(layers: Sequence[tuple[str, nn.Module]], kept: Collection[int], device: torch.device,
                init: Init | None) -> None:
    """Give the `kept` layers (indices) storage on `device` and initialise them, in place; drop the others.

    Every layer on the meta device is initialised in model order, the others on a throwaway
    copy that lives for one layer only, so the random generator passes through the states it
    would building the whole model: a kept layer gets the values it would get there, and the
    generator ends where a whole build leaves it. Memory: this process's layers plus the
    largest other one. A tensor that `init` leaves unwritten (it was filled with NaN first)
    raises the same error on every process, naming the layer and the tensor.
    """
    fill = init if init is not None else reset_parameters
    seen: set[int] = set()
    for index, (name, layer) in enumerate(layers):
        if id(layer) in seen or not is_meta(layer):  # a layer listed twice was built, and is initialised, once
            continue
        seen.add(id(layer))
        target = layer if index in kept else copy.deepcopy(layer)
        target.to_empty(device=device)
        with torch.no_grad():
            for tensor in itertools.chain(target.parameters(), target.buffers()):
                if tensor.is_floating_point() or tensor.is_complex():
                    tensor.fill_(float("nan"))
            fill(target)
        _require_initialised(name, target, init is None)


def _require_initialised(name: str, layer: nn.Module, by_default: bool) -> None:
    """Raise if a floating-point tensor of `layer` still holds the NaN it was filled with before init."""
    for tensor_name, tensor in itertools.chain(layer.named_parameters(), layer.named_buffers()):
        if (tensor.is_floating_point() or tensor.is_complex()) and bool(torch.isnan(tensor).any()):
            how = ("its modules' reset_parameters() (the default init) left it unset"
                   if by_default else "the init= function left it unset (or wrote NaN)")
            raise ValueError(
                f"layer {name} ({type(layer).__name__}) was built on the meta device, and {tensor_name} has no values "
                f"after materializing it: {how}. Pass repl.pipeline(..., init=fn), where fn(layer) initialises every "
                "parameter and buffer of one layer in place (called on each layer on its device, in model order), "
                "or build that layer on a real device"
            )


def refuse_meta(layers: Sequence[tuple[str, nn.Module]], balance: object) -> None:
    """Raise for what a meta-device model cannot do: be profiled (balance="time")."""
    if balance == "time" and any(is_meta(layer) for _, layer in layers):
        raise ValueError(
            'balance="time" runs every layer to time it, but the model is on the meta device (no values); '
            'pass balance="params" or layer counts, or build the model on a real device'
        )
