"""Spectral norm across replicas: its power-iteration buffers, which must stay equal and are never averaged.

`torch.nn.utils.parametrizations.spectral_norm` (and the older hook, `torch.nn.utils.spectral_norm`)
keeps estimates of the weight's leading singular vectors in buffers (`_u`, `_v`; `weight_u`,
`weight_v`) and refines them by one power iteration in every training-mode forward, from
the weight alone. Replicas that hold the same weights therefore keep the same buffers, and
match one process training on the global batch, as long as every replica runs the module's
training-mode forward the same number of times per step. Two things break that rule:

- replicas calling the module a different number of times (an extra discriminator call for
  logging on replica 0 only, a replica that skips a step): the buffers part, and so do the
  normalized weights. Averaging them would hide that and would not even help (the mean of
  two unit vectors is shorter than one, so eval-mode sigma comes out wrong), so replicator
  never averages them: `run()`'s closing check and `save()` name them instead.
- gradient accumulation (`repl.accumulate(n)`, `no_sync()`): every micro-batch runs the
  iteration, n times per update instead of once, so it is not the algorithm one process
  runs with the whole batch (BigGAN-PyTorch's caveat). Replicas stay equal; replicator warns.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm

__all__ = ["power_iteration_buffers", "spectral_normed", "SPECTRAL_NORM_RULE"]

SPECTRAL_NORM_RULE = (
    "Spectral norm's power-iteration buffers (_u, _v) advance once per training-mode forward, from the weights "
    "alone: they stay equal only if every replica runs the spectral-normed module the same number of times per "
    "step. Make every replica take the same discriminator calls (same n_dis, no extra call on replica 0 for "
    "logging: call it in eval() mode, which runs no iteration, or on every replica)."
)


def power_iteration_buffers(modules: Iterable[torch.nn.Module]) -> dict[int, str]:
    """id -> name of every spectral-norm power-iteration buffer in `modules` (either of torch's two forms)."""
    found: dict[int, str] = {}
    for root in modules:
        for prefix, module in root.named_modules():
            names: list[str] = []
            if isinstance(module, _SpectralNorm):
                names = ["_u", "_v"]
            for hook in module._forward_pre_hooks.values():
                if isinstance(hook, SpectralNorm):
                    names += [f"{hook.name}_u", f"{hook.name}_v"]
            for name in names:
                buffer = module._buffers.get(name)
                if buffer is not None:
                    found[id(buffer)] = f"{prefix}.{name}" if prefix else name
    return found


def spectral_normed(modules: Iterable[torch.nn.Module]) -> list[str]:
    """Names of the modules in `modules` whose weights are spectral-normed (any form)."""
    names = []
    for root in modules:
        for prefix, module in root.named_modules():
            parametrized = getattr(module, "parametrizations", None)  # parametrize's ModuleDict of lists
            owned = isinstance(parametrized, torch.nn.Module) and any(
                isinstance(child, _SpectralNorm) for child in parametrized.modules())
            if owned or any(isinstance(hook, SpectralNorm) for hook in module._forward_pre_hooks.values()):
                names.append(prefix or type(module).__name__)
    return names
