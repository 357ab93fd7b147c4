"""Does a checkpoint's optimizer state fit the optimizer restoring it: every key there, each tensor's shape (internal).

torch's Optimizer.load_state_dict takes any state without looking: a key that is missing or a tensor of another shape
comes out at the first step, as a KeyError or a broadcast error, and with shard="optimizer" or "gradients" only on
the replicas whose slices hold that parameter (the others wait for them at the next collective). This check runs
before anything is loaded, on every process alike, and names the entry and the file it is in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from replicator._torch_names import DTensor
from replicator.checkpoint.errors import CheckpointMismatchError
from replicator.checkpoint.safe_load import Index

__all__: list[str] = []

Shape = tuple[int, ...] | None  # a state entry's tensor shape; None for a value that is not a tensor


def predicted_state(kind: type[torch.optim.Optimizer], param: torch.Tensor, hyper: Mapping[str, Any]
                    ) -> dict[str, Shape] | None:
    """The state torch's optimizer `kind` keeps for `param` once it has stepped: each key, with its tensor's shape.

    Found by one step of a throwaway `kind` over zeros of `param`'s (global) shape, on the meta device where the
    step allows (no memory), else on the CPU: no parameter of the model moves and nothing is communicated. None
    (nothing to check against) for optimizers defined outside torch.optim, whose state may come later or differ by
    design, and for those one plain step cannot drive (a closure: LBFGS; sparse gradients: SparseAdam).
    """
    if kind.__module__.split(".")[:2] != ["torch", "optim"]:  # "torch.optim.adam", and "torch.optim" for Adafactor
        return None
    for device in ("meta", "cpu"):  # some steps read a value (ASGD, Adafactor), which a meta tensor has not
        try:
            probe = torch.zeros(tuple(param.shape), dtype=param.dtype, device=device, requires_grad=True)
            probe.grad = torch.zeros_like(probe)
            throwaway = kind([{**hyper, "params": [probe]}])  # type: ignore[call-arg]  # torch's take defaults
            throwaway.step()
        except Exception:  # a step that needs what a plain zero gradient is not
            continue
        return {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None
                for key, value in throwaway.state[probe].items()}
    return None


def check_entry(stored: Index, optimizer: int, kind: type[torch.optim.Optimizer], name: str, key_of: str,
                param: torch.Tensor, hyper: Mapping[str, Any], saved: Mapping[str, Shape], records: str) -> None:
    """Refuse the saved state `saved` of parameter `name` (key -> shape) when the restoring optimizer cannot take it.

    `key_of` is the prefix of its entries in the checkpoint (`_optim/<name>/`), `records` the record files that list
    its values that are not tensors. A parameter without state (it never stepped) passes: the optimizer builds it.
    """
    if not saved:
        return
    expected = predicted_state(kind, param, hyper)
    if expected is None:
        if not isinstance(param, DTensor):
            return
        # FSDP2 lays out a state tensor as its parameter's shards, or keeps a scalar whole: no other shape is read.
        expected = {key: shape if shape in (tuple(param.shape), (), None) else tuple(param.shape)
                    for key, shape in saved.items()}
    where = f"checkpoint {stored.path}: optimizer {optimizer} ({kind.__name__})"
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise CheckpointMismatchError(
            f"{where} keeps {', '.join(sorted(expected))} for each parameter, but the checkpoint's state for {name} "
            f"has no {', '.join(missing)}: neither {stored.path / '.metadata'} lists "
            f"{', '.join(key_of + key for key in missing)} nor does a record ({records}) hold a value for it. The "
            "checkpoint is incomplete or was written by another program; restore another one")
    for key, shape in saved.items():
        wanted = expected.get(key)
        if shape is not None and wanted is not None and shape != wanted:
            raise CheckpointMismatchError(
                f"{where} keeps {key} of shape {wanted} for {name} (of shape {tuple(param.shape)}), but the "
                f"checkpoint's entry {stored.where(key_of + key)} has shape {shape}: its layout cannot be read into "
                "this optimizer (a slice of a sharded run's state saved as it was, or state written by another "
                "program?). Restore a checkpoint written by replicator's save, which gathers every slice")
