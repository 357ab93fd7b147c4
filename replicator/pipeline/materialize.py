"""A model built on the meta device: each process allocates and initialises only its own stage's layers."""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

__all__ = ["Init", "is_meta", "give_storage", "reset_parameters", "materialize", "check_meta"]

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
    """Give the `kept` layers (indices) storage on `device` and initialise them, in place; leave the others on meta.

    Building the whole model would run every layer's reset_parameters() in model order and
    then, for a model that re-initialises itself once built (`init`), init on every layer in
    model order. Both passes are replayed over every layer on the meta device: a kept layer
    in place, any other on a throwaway copy that lives for one layer only. So the random
    generator passes through the states of a whole build: a kept layer gets the values it
    would get there, and the generator ends where a whole build leaves it. Memory: this
    process's layers plus the largest other one. Each tensor is filled with NaN first; one
    left unset raises the same error on every process, naming the layer and the tensor.
    """
    seen: set[int] = set()
    built: list[tuple[int, str, nn.Module]] = []
    for index, (name, layer) in enumerate(layers):
        if id(layer) not in seen and is_meta(layer):  # a layer listed twice was built, and is initialised, once
            seen.add(id(layer))
            built.append((index, name, layer))
    for index, name, layer in built:
        target = _emptied(layer, device, in_place=index in kept)
        reset_parameters(target)
        if init is None:
            _require_initialised(name, target, None)
    if init is None:
        return
    for index, name, layer in built:
        target = layer if index in kept else _emptied(layer, device, in_place=False)
        if target is not layer:
            with _draws_discarded(device):  # what the first pass set, with no draws: only init's count here
                reset_parameters(target)
        with torch.no_grad():
            init(target)
        _require_initialised(name, target, init)


def _emptied(layer: nn.Module, device: torch.device, *, in_place: bool) -> nn.Module:
    """`layer` (or a copy) with storage on `device`, every floating-point tensor NaN, so that an unset one shows."""
    target = layer if in_place else copy.deepcopy(layer)
    for module in target.modules():
        give_storage(module, device)
    return target


def give_storage(module: nn.Module, device: torch.device) -> None:
    """Storage on `device` for `module`'s own meta tensors (not its children's), NaN where floating-point.

    The Parameter objects stay the same (their contents are swapped), so an optimizer built
    over the meta parameters keeps them.
    """
    for param in module._parameters.values():
        if param is not None and param.is_meta:
            fresh = nn.Parameter(_nan_like(param, device), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, fresh)
    for key, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            module._buffers[key] = _nan_like(buffer, device)


def _nan_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    empty = torch.empty_like(tensor, device=device)
    return empty.fill_(float("nan")) if empty.is_floating_point() or empty.is_complex() else empty


def _draws_discarded(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Random numbers drawn inside leave the generators (CPU and `device`'s) as they were."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def _require_initialised(name: str, layer: nn.Module, init: Init | None) -> None:
    """Raise if a floating-point tensor of `layer` still holds the NaN it was filled with before init."""
    for tensor_name, tensor in itertools.chain(layer.named_parameters(), layer.named_buffers()):
        if (tensor.is_floating_point() or tensor.is_complex()) and bool(torch.isnan(tensor).any()):
            how = ("its modules' reset_parameters() left it unset" if init is None
                   else "neither its modules' reset_parameters() nor init= set it (or one wrote NaN)")
            raise ValueError(
                f"layer {name} ({type(layer).__name__}) was built on the meta device, and {tensor_name} has no values "
                f"after materializing it: {how}. Pass repl.pipeline(..., init=fn), where fn(layer) sets every "
                "parameter and buffer of one layer in place (called after reset_parameters(), on each layer in model "
                "order, on its device), or build that layer on a real device"
            )


def check_meta(layers: Sequence[tuple[str, nn.Module]], balance: object, init: Init | None) -> None:
    """Raise, the same on every process, for a model half on meta, init= without meta, or balance="time" on meta."""
    meta = [name for name, layer in layers if is_meta(layer)]
    real = [name for name, layer in layers if not is_meta(layer) and _holds_tensors(layer)]
    if meta and real:
        raise ValueError(
            f"{_are(meta)} on the meta device but {_are(real)} not: build every layer "
            "on the meta device or none (a layer built for real drew its random numbers when it was built, so the "
            "stages could not replay a whole build's)"
        )
    if init is not None and not meta:
        raise ValueError("init= initialises layers built on the meta device, and no layer is on it: build the layers "
                         "under `with torch.device(\"meta\"):`, or drop init= and initialise them as you build them")
    if balance == "time" and meta:
        raise ValueError(
            'balance="time" runs every layer to time it, but the model is on the meta device (no values); '
            'pass balance="params" or layer counts, or build the model on a real device'
        )


def _are(names: list[str]) -> str:
    return f"layer {names[0]} is" if len(names) == 1 else f"layers {', '.join(names)} are"


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in itertools.chain(module.parameters(), module.buffers()))
