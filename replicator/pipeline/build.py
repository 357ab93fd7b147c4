"""build_pipeline: partition a model and return this process's stage, ready to train."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from replicator.pipeline.batchnorm import convert_deferred_batchnorm
from replicator.pipeline.hooks import StageHooks, with_no_sync
from replicator.pipeline.materialize import Init, check_meta, materialize
from replicator.pipeline.partition import Balance, check_stage_count, layers_of, resolve_balance, split
from replicator.pipeline.recompute import resolve_recompute
from replicator.pipeline.schedule import SCHEDULES, Op, Schedule, schedule_key
from replicator.pipeline.stage import PipelineStage, StageChunks

__all__ = ["build_pipeline", "agreed_balance"]


def agreed_balance(
    modules: nn.Sequential | Sequence[nn.Module],
    num_stages: int,
    balance: Balance,
    *,
    group: dist.ProcessGroup | None = None,  # what this adds to partition.resolve_balance
    sample: Any = None,
    device: torch.device | str | None = None,
) -> list[int]:
    """Layer counts per stage, identical on every process of `group`.

    Explicit counts and "params" are deterministic, so every process computes them. A
    "time" profile differs from process to process, so only the group's first rank
    profiles and broadcasts the result (every replica must cut the model the same way, or
    their gradients could not be averaged). A failure there is raised on every rank.
    """
    if balance != "time" or group is None or dist.get_world_size(group) == 1:
        return resolve_balance(modules, num_stages, balance, sample=sample, device=device)
    check_stage_count(len(layers_of(modules)), num_stages)  # the same verdict everywhere, before talking
    source = dist.get_global_rank(group, 0)
    message = torch.zeros(num_stages, dtype=torch.int64)
    error: Exception | None = None
    if dist.get_rank() == source:
        try:
            message = torch.tensor(resolve_balance(modules, num_stages, balance, sample=sample, device=device))
        except Exception as caught:  # tell the others, then raise here too
            error = caught
            message.fill_(-1)
    wire = message
    if dist.get_backend(group) == "nccl":  # NCCL only moves accelerator memory
        wire = message.to(
            torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
    dist.broadcast(wire, src=source, group=group)
    if error is not None:
        raise error
    counts = wire.cpu().tolist()
    if any(c < 1 for c in counts):
        raise ValueError(f'balance="time" failed on rank {source}, which profiles the layers; see the error there')
    return counts


def build_pipeline(
    modules: nn.Sequential | Sequence[nn.Module],
    *,
    # How the model is cut, and which piece this process keeps:
    stage_id: int,
    num_stages: int,
    balance: Balance = "params",
    sample: Any = None,
    balance_group: dist.ProcessGroup | None = None,
    deferred_batchnorm: bool = False,
    # Where the stage sits:
    stage_ranks: Sequence[int] | None = None,
    stage_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    replica: int = 0,
    # How it runs a step:
    chunks: int = 1,
    schedule: str | Schedule = "gpipe",
    recompute: str = "except_last",
    checkpoint: str | None = None,
    hooks: StageHooks | None = None,
    no_sync: Callable[[], AbstractContextManager[Any]] | None = None,
    record: bool = True,
    virtual_stages: int = 1,
    init: Init | None = None,
) -> PipelineStage:
    """Split `modules` into `num_stages` stages and return stage `stage_id` as a PipelineStage.

    Every process builds the whole model the same way (same seed) and calls this; each
    keeps its own stage, and the others are freed once the caller drops its references to
    `modules`. A model built on the meta device (`with torch.device("meta"):`) is
    materialized here, this stage's layers only (materialize.py). Args as in PipelineStage, plus:
        balance: layer counts per stage, "params" or "time" (profiles on `sample`).
        sample: a batch for the first layer, needed by balance="time".
        balance_group: a group spanning every process of the job (ProcessGroups.control) so
            that a timed balance is the same for all replicas; default: stage_group.
        deferred_batchnorm: replace nn.BatchNorm1d/2d/3d by DeferredBatchNorm, whose running
            statistics are those of the whole mini-batch (GPipe); default: per micro-batch.
        hooks: what the job does around a training step (StageHooks); `no_sync=` is
            folded into them, as PipelineStage does.
        checkpoint: the deprecated name of `recompute` (a DeprecationWarning).
        virtual_stages: V, model chunks per stage: the model is cut into K x V pieces (balance
            then counts K x V of them) and this stage keeps pieces stage_id, stage_id + K, ...
            Interleaved and zero-bubble schedules give a PipelineStage of StageChunks (V chunks).
        init: for layers on the meta device, what the model does to each layer once built
            (fn(layer), in place), run after every layer's reset_parameters(); default: nothing.
    """
    layers = layers_of(modules)  # a clear error for a model that is not a sequence of layers, before any collective
    check_meta(layers, balance, init)
    place = torch.device(device) if device is not None else torch.device("cpu")  # where meta layers materialize
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id must be in 0..{num_stages - 1}, got {stage_id}")
    if _runs_chunks(schedule, virtual_stages):
        _check_pieces(len(layers_of(modules)), num_stages, virtual_stages, balance)
        pieces = agreed_balance(modules, num_stages * virtual_stages, balance, sample=sample, device=device,
                                group=balance_group if balance_group is not None else stage_group)
        mine: list[nn.Module] = list(split(modules, pieces)[stage_id::num_stages])
        materialize(layers, _kept(pieces, range(stage_id, len(pieces), num_stages)), place, init)
        if deferred_batchnorm:
            mine = [convert_deferred_batchnorm(piece) for piece in mine]
        for piece in mine:
            if device is not None:
                piece.to(device)
        return PipelineStage(
            StageChunks(mine), stage_id=stage_id, num_stages=num_stages, stage_ranks=stage_ranks, group=stage_group,
            chunks=chunks, schedule=schedule, recompute=resolve_recompute(recompute, checkpoint), device=device,
            replica=replica, record=record, hooks=with_no_sync(hooks, no_sync),
        )
    counts = agreed_balance(modules, num_stages, balance, sample=sample, device=device,
                            group=balance_group if balance_group is not None else stage_group)
    module: nn.Module = split(modules, counts)[stage_id]
    materialize(layers, _kept(counts, [stage_id]), place, init)
    if deferred_batchnorm:
        module = convert_deferred_batchnorm(module)
    if device is not None:
        module.to(device)
    return PipelineStage(
        module, stage_id=stage_id, num_stages=num_stages, stage_ranks=stage_ranks, group=stage_group, chunks=chunks,
        schedule=schedule, recompute=resolve_recompute(recompute, checkpoint), device=device, replica=replica,
        record=record, hooks=with_no_sync(hooks, no_sync),
    )


def _kept(counts: list[int], pieces: Sequence[int]) -> set[int]:
    """The indices of the layers in `pieces` of a model cut into `counts` layers per piece."""
    starts = [sum(counts[:piece]) for piece in range(len(counts))]
    return {index for piece in pieces for index in range(starts[piece], starts[piece] + counts[piece])}


def _check_pieces(num_layers: int, num_stages: int, virtual_stages: int, balance: Balance) -> None:
    """Errors in the words of virtual stages, before partition's (which speak of stages) could mislead."""
    pieces = num_stages * virtual_stages
    if num_layers < pieces:
        raise ValueError(f"{num_stages} stages x {virtual_stages} virtual stages cut the model into {pieces} pieces, "
                         f"but it has {num_layers} layer(s); use fewer virtual stages or split the model into more "
                         "layers")
    if not isinstance(balance, str) and len(balance) != pieces:
        raise ValueError(f"with {num_stages} stages x {virtual_stages} virtual stages, balance needs {pieces} layer "
                         f"counts, one per piece (piece p runs on stage p % {num_stages}); got {list(balance)}")


def _runs_chunks(schedule: str | Schedule, virtual_stages: int) -> bool:
    """Whether `schedule` cuts the model into pieces per chunk: chunks per stage, or a split backward."""
    if isinstance(schedule, Schedule):
        split = {Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT}
        return schedule.virtual_stages > 1 or any(a.op in split for actions in schedule.stages for a in actions)
    return virtual_stages > 1 or schedule_key(schedule) not in SCHEDULES
