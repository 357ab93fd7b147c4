"""How a server steps the user's optimizer: torch's own `step`, without its profiler label when nothing would see it."""

from __future__ import annotations

from types import CodeType

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["step"]


def _wrapper_code() -> CodeType | None:
    """The code of the wrapper torch puts around every optimizer class's `step` (hooks, then a profiler label)."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    return None if wrap is None else getattr(wrap(lambda *args, **kwargs: None), "__code__", None)


_TORCH_WRAPPER = _wrapper_code()
_PROFILING = getattr(torch.autograd, "_profiler_enabled", None)  # is a torch profiler recording?


def step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()` as its class defines it (past replicator's own wrapping of the instance).

    A server calls this once per update, so torch's wrapper costs it a fixed 30–40 µs a round trip, most of it
    the `record_function` label for a profiler. Where that wrapper is torch's own (no other library wrapped the
    class's step), no step hook is registered and no torch profiler is recording, the function it wraps runs
    instead: the same update, the same grad mode, nothing anyone could observe left out. Otherwise torch's
    whole wrapper runs, hooks and label included."""
    hooked = type(optimizer).step
    inner = getattr(hooked, "__wrapped__", None)
    torchs = _TORCH_WRAPPER is not None and getattr(hooked, "__code__", None) is _TORCH_WRAPPER
    if inner is None or not torchs or _observed(optimizer):
        hooked(optimizer)
        return
    inner(optimizer)  # what the wrapper adds past this is for a profiler, and none records


def _observed(optimizer: torch.optim.Optimizer) -> bool:
    """Would anything see the steps: a step hook (this optimizer's or global), or a recording profiler?"""
    tables = [getattr(optimizer, "_optimizer_step_pre_hooks", None),
              getattr(optimizer, "_optimizer_step_post_hooks", None),
              getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
              getattr(torch_optimizer, "_global_optimizer_post_hooks", None)]
    # What this torch lacks (a table, the profiler's switch) counts as a listener: torch's whole step runs, as ever.
    return any(table is None or len(table) for table in tables) or _PROFILING is None or bool(_PROFILING())
