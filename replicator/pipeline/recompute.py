"""Activation recomputation: a stage keeps only its input per micro-batch and recomputes its forward in backward.

GPipe calls this re-materialisation; the keyword is `recompute=` so that it is not mistaken
for saved-state checkpoints (replicator.checkpoint). Built on torch.utils.checkpoint
(non-reentrant). While a forward is being recomputed, `is_recomputing()` is true and batch
norms in training mode update throwaway copies of their running statistics, so the
statistics are never counted twice. The forward and its recomputation each see their own
copy of the input tensors that want no gradient: a stage that changes one in place (say
`mask.add_(1)`) would otherwise change it twice, and its gradients would be those of
another input.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from replicator._tree import map_tensors
from replicator.errors import ReplicatorUsageError

__all__ = [
    "check_pipeline_arguments",
    "RECOMPUTE_MODES",
    "check_mode",
    "resolve_recompute",
    "should_recompute",
    "is_recomputing",
    "recomputing",
    "run_forward",
]

RECOMPUTE_MODES = ("always", "except_last", "never")
_DEFAULT_MODE = "except_last"  # the default of recompute= on build_pipeline and PipelineStage

_state = threading.local()


def check_mode(mode: str) -> str:
    """Return `mode` if it is a recomputation mode, else raise a ValueError naming the choices."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    return mode


def check_pipeline_arguments(stages: int, chunks: int, recompute: str, deprecated_checkpoint: str | None) -> str:
    """Refuse stage and micro-batch counts below 1; the recompute mode (see resolve_recompute)."""
    if stages < 1 or chunks < 1:
        raise ReplicatorUsageError(f"stages and chunks must be at least 1, got stages={stages}, chunks={chunks}")
    return resolve_recompute(recompute, deprecated_checkpoint)


def resolve_recompute(recompute: str, deprecated_checkpoint: str | None) -> str:
    """The mode from `recompute=`, or from its old name `checkpoint=` with a DeprecationWarning."""
    if deprecated_checkpoint is None:
        return check_mode(recompute)
    warnings.warn(
        "checkpoint= of a pipeline stage means activation recomputation and is deprecated: pass recompute= (same "
        "modes); saved-state checkpoints are replicator.checkpoint",
        DeprecationWarning,
        stacklevel=3,
    )
    if recompute not in (_DEFAULT_MODE, deprecated_checkpoint):
        raise ValueError(f"recompute={recompute!r} and checkpoint={deprecated_checkpoint!r} disagree; pass recompute= "
                         "alone")
    return check_mode(deprecated_checkpoint)


def should_recompute(mode: str, microbatch: int, num_microbatches: int) -> bool:
    """Whether a micro-batch's forward is recomputed in backward under `mode`.

    "except_last" keeps the last micro-batch's activations: its backward follows its
    forward soonest (at once on the last stage), so recomputing it would buy no memory.
    """
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch != num_microbatches - 1
    return False


def is_recomputing() -> bool:
    """True while a forward is being recomputed during backward (in this thread)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def recomputing(module: nn.Module) -> Iterator[None]:
    """Mark a recomputation and stop `module`'s batch norms from updating running statistics again."""
    # The recomputation must save the same tensors as the first forward (checkpoint checks),
    # so the batch norms keep running statistics, only throwaway copies of them.
    names = ("running_mean", "running_var", "num_batches_tracked")
    frozen: list[tuple[_BatchNorm, dict[str, torch.Tensor]]] = []
    for bn in module.modules():
        if isinstance(bn, _BatchNorm) and bn.training and bn.track_running_stats:
            originals = {n: buffer for n in names if (buffer := bn._buffers.get(n)) is not None}
            frozen.append((bn, originals))
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        for bn, originals in frozen:
            for name, tensor in originals.items():
                bn._buffers[name] = tensor.clone()
        yield
    finally:
        for bn, originals in frozen:
            bn._buffers.update(originals)
        _state.depth -= 1


def run_forward(module: nn.Module, inputs: Any, recompute: bool) -> Any:
    """`module(inputs)`, optionally keeping only `inputs` and recomputing the rest in backward.

    An error of the recomputed forward's first run is raised after `checkpoint()` has returned: a torch
    whose `checkpoint()` is left by an exception (2.11's) keeps its saved-tensor hooks pushed for as long as the
    error lives, and a pipeline keeps a failed step's error. Every later forward of this thread outside a
    recomputed one would then save its tensors through the failed micro-batch's hooks, and the backward that
    reads them would recompute that micro-batch and raise `CheckpointError` (seen on torch 2.11: "saved 12,
    recomputed 2"). The failed micro-batch itself is never backpropagated.
    """
    if not recompute or not torch.is_grad_enabled():
        return module(inputs)
    failures: list[Exception] = []

    def forward(kept: Any) -> Any:
        try:
            return module(_fresh_copies(kept))
        except Exception as error:
            if is_recomputing():  # in backward: the error is the backward's
                raise
            failures.append(error)
            return None

    output = checkpoint(forward, inputs, use_reentrant=False,
                        context_fn=lambda: (contextlib.nullcontext(), _Recomputing(module)))
    if failures:
        raise failures[0]
    return output


class _Recomputing:
    """`recomputing(module)` that can be entered again: a split backward (zero bubble) recomputes in each pass."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._open: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        context = recomputing(self.module)
        self._open.append(context)
        context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._open.pop().__exit__(*exc)


def _fresh_copies(inputs: Any) -> Any:
    """`inputs` with a copy of each tensor that wants no gradient, so the kept input stays as it was received.

    A tensor that wants a gradient needs no copy: autograd refuses to change such a leaf in place.
    """
    return map_tensors(lambda t: t if t.requires_grad else t.clone(), inputs)
