"""How a pipeline step ends: every stage learns whether any stage failed, and all raise the same PipelineError.

A failed stage keeps walking its schedule, sending aborts in place of data, so no
neighbour is left waiting. A training step then ends with one status message per stage
to the next; an evaluation step, whose messages flow downstream only, with one small
all-reduce. See docs/concepts/design.md, 'Pipeline failures'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from replicator.pipeline.batchnorm import commit_deferred_batchnorm
from replicator.pipeline.links import StageLinks
from replicator.pipeline.step import PipelineError, StepState

__all__ = ["end_training_step", "end_evaluation_step"]

_FAILURE_TEXT_BYTES = 2048


def end_training_step(step: StepState, links: StageLinks, module: nn.Module, where: str) -> None:
    """End a training step without a collective: each stage tells the next whether the step failed.

    Only the stages downstream of a failed backward have not heard of it yet, and they do
    through this status message; every other failure reached every stage through the
    activations and gradients. Raises PipelineError on every stage when any failed.
    """
    if links.from_previous is not None:
        message = links.from_previous.recv(("status",))
        if message.is_abort:
            step.fail(message.error or "", where)
    if links.to_next is not None:
        if step.ok:
            links.to_next.send(("status",), None, microbatch=-1, microbatch_size=0, batch_size=0, allow_none=True)
        else:
            links.to_next.send_abort(("status",), step.failure or "", microbatch=-1)
    # Every send completes before the step returns: a work dropped while in flight (say,
    # with a pipeline the caller discards) would lose its message.
    links.settle_sends()
    commit_deferred_batchnorm(module, keep=step.ok)
    if not step.ok:
        raise_failed(step, str(step.failure), where)


def end_evaluation_step(step: StepState, links: StageLinks, module: nn.Module, where: str, *, stage_id: int,
                        num_stages: int, stage_ranks: Sequence[int], group: dist.ProcessGroup | None,
                        device: torch.device) -> None:
    """End an evaluation step: every stage learns, through one all-reduce, whether any failed."""
    links.settle_sends()
    own = 2.0 if step.cause is not None else (1.0 if step.failure is not None else 0.0)
    flags_tensor = torch.zeros(num_stages, dtype=torch.float64, device=device)
    flags_tensor[stage_id] = own
    if num_stages > 1:
        dist.all_reduce(flags_tensor, group=group)
    flags = flags_tensor.tolist()
    commit_deferred_batchnorm(module, keep=not any(flags))
    if any(flags):
        origins = [s for s, flag in enumerate(flags) if flag == 2.0]
        if origins:
            reason = _failure_text(step, origins[0], stage_id=stage_id, num_stages=num_stages,
                                   stage_ranks=stage_ranks, group=group, device=device)
        else:
            reason = step.failure or "a stage failed"
        if len(origins) > 1:
            reason += f" (stages {origins} failed)"
        raise_failed(step, reason, where)


def raise_failed(step: StepState, reason: str, where: str) -> NoReturn:
    """Every stage ends a failed step with the same error, naming where it was reported."""
    reported = "" if step.cause is not None else f" [reported on {where}]"
    step.drop_state()
    raise PipelineError(
        f"pipeline step failed: {reason}{reported}. Every stage stopped this step; gradients may be partly "
        "accumulated, so zero them before the next step",
        reason=reason,
    ) from step.cause


def _failure_text(step: StepState, origin: int, *, stage_id: int, num_stages: int, stage_ranks: Sequence[int],
                  group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The failing stage's own description of its error, shared with every stage."""
    if num_stages == 1:
        return step.failure or ""
    # Only on the failure path: evaluation messages flow downstream only, so a stage
    # upstream of a failure never hears of it through them; the first failing stage
    # broadcasts its text.
    text = torch.zeros(_FAILURE_TEXT_BYTES, dtype=torch.uint8)
    raw = (step.failure or "").encode("utf-8")[:_FAILURE_TEXT_BYTES] if stage_id == origin else b""
    if raw:
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = text.to(device)
    dist.broadcast(text, src=stage_ranks[origin], group=group)
    return bytes(text.cpu().tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
