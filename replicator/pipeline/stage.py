"""PipelineStage: this process's stage of a pipeline (one model chunk or several), running its schedule over p2p."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from replicator._tree import tensors, to_device
from replicator.comm import p2p
from replicator.pipeline.failures import end_evaluation_step, end_training_step
from replicator.pipeline.hooks import StageHooks, around_training_step, with_no_sync
from replicator.pipeline.links import StageLinks, settle_delivered
from replicator.pipeline.microbatch import gather, microbatch_sizes, scatter, shared_batch_size, unshared
from replicator.pipeline.recompute import resolve_recompute, run_forward, should_recompute
from replicator.pipeline.schedule import (
    Action,
    Op,
    Schedule,
    check_schedule,
    endpoint,
    forward_only,
    forward_only_ring,
    make_schedule,
)
from replicator.pipeline.sharded import ShardedUnits
from replicator.pipeline.split_backward import backward_input
from replicator.pipeline.step import PipelineError, StepState, checked_normalizer
from replicator.pipeline.timeline import Event, Timeline, gather_events
from replicator.pipeline.walk import Move, walk

__all__ = ["PipelineStage", "PipelineError", "StageChunks"]

LossFn = Callable[[Any, Any], torch.Tensor]


class StageChunks(nn.Module):
    """A stage's V model chunks (virtual stages), its layers under their names in the whole model.

    Holds them for state_dict and optimizers; not callable, since a stage's chunks are not
    consecutive in the model: each runs on its own (`PipelineStage.chunk_modules`).
    """

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.chunks = list(chunks)  # a plain list: the layers are registered once, below, by their names
        for chunk in self.chunks:
            for name, layer in chunk.named_children():
                self.add_module(name, layer)

    def forward(self, *args: Any) -> Any:
        raise TypeError("a stage's chunks are not consecutive layers; call chunk_modules[v] for chunk v")


class PipelineStage:
    """One stage of a K-stage pipeline that splits each mini-batch into `chunks` micro-batches.

    Every stage calls `train_step` (or `eval_step`) with the same arguments; the first stage
    uses the inputs, the last the targets and the loss function. The stage walks its list
    of actions from the schedule: forwards and backwards (whole, or split into input and
    weight gradients) of micro-batches, and the sends and receives that link it to its
    neighbours (p2p.Link). Sends are started without waiting and completed once the
    schedule proves them received, or at the end of the step; receives wait. On Gloo,
    whose sends never block, each send starts right after the pass that computes it,
    before the receives around it, and receives are posted an exchange ahead (walk.py).

    A stage may hold V model chunks (virtual stages, for interleaved and zero-bubble
    schedules): pass `StageChunks`, chunk v being piece v * K + stage_id of the model, and
    activations travel round a ring of stages. With one chunk (any other module) piece
    and stage coincide.

    Failures never leave a neighbour waiting: a stage whose forward, backward, loss or
    input fails keeps walking its schedule without computing, each send becoming an
    *abort* message that carries the error, and every stage then raises PipelineError
    naming the stage that failed and why (see failures.py). No message is left unmatched,
    so the pipeline can run the next step (zero the gradients first: a failed step may
    have accumulated some). See docs/concepts/design.md, 'Pipeline failures'.

    Args:
        module: this stage's layers (called as `module(x)`, where x is a tensor or a
            tuple/list/dict of tensors exactly as the previous stage returned it), or
            StageChunks of its V chunks.
        stage_id: this stage's index, 0 ... num_stages - 1.
        num_stages: K.
        stage_ranks: the global ranks of the K stages of this replica (ProcessGroups.stage_ranks).
        group: a process group holding those ranks (ProcessGroups.stage); None when K == 1.
        chunks: M, the number of micro-batches per mini-batch.
        schedule: "gpipe", "1f1b", "interleaved", "zero_bubble" or a Schedule for (K, M, V).
        recompute: "always", "except_last" or "never" (activation recomputation, see recompute.py).
        device: where the stage computes and receives; default: where its parameters are.
        replica: the replica this stage belongs to (labels the timeline only).
        record: record a timeline of the last step's actions (`stage.timeline`).
        hooks: what the job does around a training step (StageHooks: gradient averaging
            held until every replica agrees on the step's outcome); default: nothing.
        no_sync: shorthand for hooks=StageHooks(no_sync=...): a context manager factory
            (e.g. Replicator.no_sync) entered around every backward of a step but the
            stage's last one, so that a gradient synchronizer averages once per step.
        checkpoint: the deprecated name of `recompute`.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage_id: int,
        num_stages: int,
        stage_ranks: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        chunks: int = 1,
        schedule: str | Schedule = "gpipe",
        recompute: str = "except_last",
        device: torch.device | str | None = None,
        replica: int = 0,
        record: bool = True,
        hooks: StageHooks | None = None,
        no_sync: Callable[[], AbstractContextManager[Any]] | None = None,
        checkpoint: str | None = None,
    ) -> None:
        if not 0 <= stage_id < num_stages:
            raise ValueError(f"stage_id must be in 0..{num_stages - 1}, got {stage_id}")
        if chunks < 1:
            raise ValueError(f"chunks (micro-batches per mini-batch) must be at least 1, got {chunks}")
        self.module = module
        self.chunk_modules: list[nn.Module] = module.chunks if isinstance(module, StageChunks) else [module]
        self.virtual_stages = V = len(self.chunk_modules)
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.chunks = chunks
        self.recompute = resolve_recompute(recompute, checkpoint)
        self.schedule = _training_schedule(schedule, num_stages, chunks, V)
        self._forward_schedule = (forward_only(num_stages, chunks) if V == 1
                                  else forward_only_ring(num_stages, chunks, V))
        if device is None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        # torch's optimizers refuse an empty parameter list: a stage without parameters offers
        # one empty placeholder, so `SGD(pipe.parameters())` works on every stage.
        self._placeholder = None if any(True for _ in module.parameters()) else nn.Parameter(
            torch.zeros(0, device=self.device))
        self.group = group
        self.stage_ranks = list(stage_ranks) if stage_ranks is not None else list(range(num_stages))
        if num_stages > 1:
            if group is None or not dist.is_initialized():
                raise ValueError(
                    f"a pipeline of {num_stages} stages needs torch.distributed and the stage group "
                    "(build_process_groups(topology, stages=K).stage)"
                )
            if len(self.stage_ranks) != num_stages:
                raise ValueError(f"stage_ranks {self.stage_ranks} should list {num_stages} global ranks, one per stage")
            if dist.get_rank() != self.stage_ranks[stage_id]:
                raise ValueError(
                    f"this process has global rank {dist.get_rank()} but stage_ranks[{stage_id}] is "
                    f"{self.stage_ranks[stage_id]}; pass the stage ranks of this process's replica"
                )
        self.replica = replica
        self.timeline = Timeline(stage_id, replica, enabled=record)
        self.hooks = with_no_sync(hooks, no_sync)
        self._scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None  # set during an fp16 training step
        self._fsdp_units = ShardedUnits(module)  # shard="parameters": gathered and reduce-scattered once per step
        actions = self.schedule.stages[stage_id]
        # The last pass that accumulates weight gradients: the gradient synchronizer averages after it.
        self._last_update = max(n for n, a in enumerate(actions) if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT))
        self.links = StageLinks.connect(stage_id, num_stages, self.stage_ranks, group, self.device, ring=V > 1)
        posts_ahead = all(link.posts_ahead for link in self.links.from_stage.values())
        self._train_walk = walk(self.schedule, stage_id, posts_ahead)
        self._eval_walk = walk(self._forward_schedule, stage_id, posts_ahead)

    # -- identity ----------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage holds the model's last piece, which computes the loss."""
        return self.stage_id == self.num_stages - 1

    @property
    def message_count(self) -> int:
        """Point-to-point messages this stage has posted so far, sends and receives."""
        return self.links.message_count

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This stage's parameters, of all its chunks (give them to this stage's optimizer); a placeholder if none."""
        if self._placeholder is not None:
            return iter([self._placeholder])
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)

    def train(self, mode: bool = True) -> PipelineStage:
        self.module.train(mode)
        return self

    def eval(self) -> PipelineStage:
        return self.train(False)

    def _where(self) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return f"stage {self.stage_id} of {self.num_stages} (rank {rank})"

    def _slot(self, action: Action) -> int:
        """Where a step keeps a micro-batch's tensors: one slot per chunk and micro-batch."""
        return action.chunk * self.chunks + action.microbatch

    def _holds_last_piece(self, chunk: int) -> bool:
        return self.schedule.piece(self.stage_id, chunk) == self.schedule.num_pieces - 1

    # -- steps -------------------------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None, loss_fn: LossFn | None = None, *,
                   reduction: str = "mean", normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward over all micro-batches; return the mini-batch loss on every stage.

        Call it on every stage with the same arguments: the first stage reads `inputs`, the
        last stage `targets` and `loss_fn(output, target)` (per micro-batch; must return a
        scalar). With reduction="mean" (a loss averaged over samples) each micro-batch's
        loss is weighted by its share of the batch, so the returned loss and the
        accumulated gradients equal those of the unsplit batch; with "sum" they are
        added, and divided by `normalizer` when one is given: for a loss averaged over
        anything but samples (tokens that are not padding, say), let loss_fn sum and pass
        what the unsplit loss would divide by, counted over the whole batch (with replicas,
        `ctx.all_mean(count)`). Gradients accumulate into `.grad` as loss.backward() would:
        zero them between steps. Returns a detached float32 scalar on this stage's device.

        Around the step, the hooks (hooks.around_training_step): after a failure on any
        replica every replica drops the step's gradient averaging and raises the same
        PipelineError, so the replicas stay identical.
        """
        scaling = self.hooks.scale_losses() if self.hooks.scale_losses is not None else contextlib.nullcontext(None)
        with scaling as self._scale_loss:  # fp16: the losses' backward starts from the loss scale
            return around_training_step(
                self.hooks, lambda: self._run_training_step(inputs, targets, loss_fn, reduction, normalizer),
                self._fsdp_units)

    def _run_training_step(self, inputs: Any, targets: Any, loss_fn: LossFn | None, reduction: str,
                           normalizer: float | torch.Tensor | None) -> torch.Tensor:
        step = self._begin(training=True)
        with torch.enable_grad():
            if reduction not in ("mean", "sum"):
                step.fail(ValueError(f'reduction must be "mean" or "sum", got {reduction!r}'), self._where())
            elif self.is_last and not callable(loss_fn):
                step.fail(ValueError(f"train_step needs a loss_fn(output, target) on the last stage, got {loss_fn!r}"),
                          self._where())
            elif normalizer is not None:
                try:
                    step.normalizer = checked_normalizer(normalizer, reduction)
                except ValueError as error:
                    step.fail(error, self._where())
            self._start(step, inputs, targets)
            for move in self._train_walk:
                self._run(move, step, targets, loss_fn, reduction)
        end_training_step(step, self.links, self.module, self._where())
        return self._step_loss(step).to(torch.float32)

    def eval_step(self, inputs: Any = None) -> Any:
        """Forward only (no gradients); return the joined output on the last stage, None on the others.

        Every stage must call it (with the inputs on the first stage). The module's mode
        (train/eval) is the caller's: call `stage.eval()` for inference behaviour.
        """
        step = self._begin(training=False)
        result: Any = None
        with torch.no_grad():
            self._start(step, inputs, None)
            for move in self._eval_walk:
                self._run(move, step, None, None, "mean")
            if self.is_last and step.ok:
                last = (self.virtual_stages - 1) * self.chunks
                try:
                    result = gather([step.outputs.pop(last + i) for i in range(self.chunks)])
                except Exception as error:
                    step.fail(error, self._where())
        end_evaluation_step(step, self.links, self.module, self._where(), stage_id=self.stage_id,
                            num_stages=self.num_stages, stage_ranks=self.stage_ranks, group=self.group,
                            device=self.device)
        return result

    def gather_timeline(self) -> list[Event]:
        """Every stage's events of the last step, on every stage (collective over the stage group)."""
        return gather_events(self.timeline.events, self.group, self.num_stages, self.device)

    # -- the schedule's actions --------------------------------------------------------
    def _begin(self, training: bool) -> StepState:
        step = StepState(training=training, sent_before=self.links.sent_so_far())
        self.timeline.clear()
        return step

    def _start(self, step: StepState, inputs: Any, targets: Any) -> None:
        if not step.ok or not self.is_first:
            return
        try:
            if inputs is None:
                raise ValueError(
                    "the first stage needs the inputs: call train_step/eval_step(inputs, ...) on every stage"
                )
            chunks = scatter(inputs, self.chunks)
            size = shared_batch_size(inputs)
            assert size is not None
            step.batch_size = size
            step.sizes = dict(enumerate(microbatch_sizes(size, self.chunks)))
            step.inputs = {i: unshared(to_device(chunk, self.device)) for i, chunk in enumerate(chunks)}
            if self.is_last and step.training:
                self._split_targets(step, targets)
        except Exception as error:
            step.fail(error, self._where())

    def _split_targets(self, step: StepState, targets: Any) -> None:
        if targets is None or shared_batch_size(targets) is None:
            step.targets = [to_device(targets, self.device)] * self.chunks
            return
        size = shared_batch_size(targets)
        if size != step.batch_size:
            raise ValueError(
                f"the targets hold {size} samples but the inputs {step.batch_size}; pass the targets of the same batch"
            )
        step.targets = [to_device(t, self.device) for t in scatter(targets, self.chunks)]

    def _run(self, move: Move, step: StepState, targets: Any, loss_fn: LossFn | None, reduction: str) -> None:
        """One move of the walk: post the receives it posts ahead, then run (and record) its action."""
        action = move.action
        for receive in move.post:
            peer, _ = endpoint(self.schedule if step.training else self._forward_schedule, self.stage_id, receive)
            self.links.from_stage[peer].post_recv(_receive_key(receive, step.training))
        with self.timeline.record(action.op.value, action.microbatch, action.chunk):
            self._act(move.index, action, step, targets, loss_fn, reduction, move.delivered)

    def _act(self, n: int, action: Action, step: StepState, targets: Any, loss_fn: LossFn | None, reduction: str,
             delivered: int) -> None:
        op, i, slot = action.op, action.microbatch, self._slot(action)
        if op.is_compute:
            if step.ok:
                try:
                    if op is Op.FORWARD:
                        self._forward(action, step, loss_fn, reduction)
                    else:
                        # Nothing to hold back where FSDP2 units accumulate until the step ends (ShardedUnits) or
                        # the stage has no parameters (with shard="parameters", the job's no_sync() is refused).
                        skip = self._placeholder is not None or self._fsdp_units.units
                        no_sync = None if skip else self.hooks.no_sync
                        with no_sync() if no_sync is not None and n != self._last_update else contextlib.nullcontext():
                            self._backward(action, step)
                except Exception as error:
                    step.fail(error, self._where())
            return
        peer, there = endpoint(self.schedule if step.training else self._forward_schedule, self.stage_id, action)
        if op is Op.SEND_ACTIVATION:
            self._send(self.links.to_stage[peer], ("activation", step.training, there.chunk, i), i, step,
                       step.outputs.pop(slot, None), keep_at=slot if step.training else None)
        elif op is Op.SEND_GRADIENT:
            self._send(self.links.to_stage[peer], ("gradient", there.chunk, i), i, step, step.grads_out.pop(slot, None),
                       loss=self._known_loss(step))
        else:
            gradient = op is Op.RECV_GRADIENT
            message = self.links.from_stage[peer].recv(_receive_key(action, step.training))
            settle_delivered(self.links.to_stage.get(peer), step.sent_before, delivered)
            if message.is_abort:
                step.fail(message.error or "", self._where())
                return
            if gradient and message.loss is not None:
                step.loss_relayed = message.loss
            if step.ok:
                try:
                    if gradient:
                        step.grads_in[slot] = message.value
                    else:
                        self._accept_input(action, message, step, targets)
                except Exception as error:
                    step.fail(error, self._where())

    def _send(self, link: p2p.Link, key: Hashable, i: int, step: StepState, value: Any, keep_at: int | None = None,
              loss: float | None = None) -> None:
        if step.ok:
            if keep_at is not None:
                step.outputs[keep_at] = value  # the graph stays for backward; only the packed bytes travel
            link.send(key, value, microbatch=i, microbatch_size=step.sizes.get(i, 0), batch_size=step.batch_size,
                      allow_none=True, loss=loss)
        else:
            link.send_abort(key, step.failure or "", microbatch=i)

    def _known_loss(self, step: StepState) -> float | None:
        """The mini-batch loss once complete (every micro-batch's loss summed), else None."""
        if not step.ok:
            return None
        if self.is_last:
            complete = step.loss_total is not None and step.losses_counted == self.chunks
            return float(step.loss_total) if complete and step.loss_total is not None else None
        return step.loss_relayed

    def _accept_input(self, action: Action, message: p2p.Message, step: StepState, targets: Any) -> None:
        if message.microbatch != action.microbatch:
            raise RuntimeError(f"expected micro-batch {action.microbatch} from the previous stage but received "
                               f"{message.microbatch}: the stages run different schedules or chunks")
        step.inputs[self._slot(action)] = message.value
        step.sizes[action.microbatch] = message.microbatch_size
        if step.batch_size == 0:
            step.batch_size = message.batch_size
            if self.is_last and step.training:
                self._split_targets(step, targets)

    def _forward(self, action: Action, step: StepState, loss_fn: LossFn | None, reduction: str) -> None:
        slot, i, c = self._slot(action), action.microbatch, action.chunk
        x = step.inputs[slot] if step.training else step.inputs.pop(slot)
        recompute = step.training and should_recompute(self.recompute, i, self.chunks)
        output = run_forward(self.chunk_modules[c], x, recompute)
        if not self._holds_last_piece(c):
            piece = self.schedule.piece(self.stage_id, c)
            where = f"stage {self.stage_id}" if self.virtual_stages == 1 else f"piece {piece}"
            p2p.encode_structure(output, path=f"the output of {where} (micro-batch {i})")
            step.outputs[slot] = output
        elif not step.training:
            step.outputs[slot] = output
        else:
            assert loss_fn is not None and step.targets is not None
            step.add_loss(slot, i, loss_fn(output, step.targets[i]), reduction)

    def _backward(self, action: Action, step: StepState) -> None:
        """A whole backward, an input-gradient pass (its weight pass kept for later), or that weight pass."""
        slot = self._slot(action)
        if action.op is Op.BACKWARD_WEIGHT:
            step.weight_passes.pop(slot).run()
            return
        if self._holds_last_piece(action.chunk):
            loss = step.losses.pop(slot)
            outputs, grads = [self._scale_loss(loss) if self._scale_loss is not None else loss], None
        else:
            output, received = step.outputs.pop(slot), step.grads_in.pop(slot)
            _, sent = p2p.encode_structure(output)  # the order the wire carried them, the order of the gradients
            needing = [t for t in sent if t.requires_grad]
            if len(received) != len(needing):
                raise RuntimeError(f"received {len(received)} gradients for {len(needing)} outputs of micro-batch "
                                   f"{action.microbatch}")
            pairs = [(t, g) for t, g in zip(needing, received) if g is not None]
            outputs, grads = [t for t, _ in pairs], [g for _, g in pairs]
        x = step.inputs.pop(slot)
        wanted = [t for t in tensors(x) if t.requires_grad]
        if action.op is Op.BACKWARD:
            if outputs:
                torch.autograd.backward(outputs, grads)
            found = [t.grad for t in wanted]
        else:
            params = list(self.chunk_modules[action.chunk].parameters())
            found, step.weight_passes[slot] = backward_input(outputs, grads, wanted, params)
        if self.schedule.piece(self.stage_id, action.chunk) > 0:
            step.grads_out[slot] = tuple(found)

    def _step_loss(self, step: StepState) -> torch.Tensor:
        """The mini-batch loss of a successful training step: summed here on the last stage, relayed elsewhere."""
        if self.is_last:
            assert step.loss_total is not None
            return step.loss_total
        assert step.loss_relayed is not None, "no gradient message carried the loss"
        return torch.tensor(step.loss_relayed, dtype=torch.float64, device=self.device)


def _receive_key(action: Action, training: bool) -> Hashable:
    """The key of the message a receive expects (p2p.Link keeps the last size per key)."""
    if action.op is Op.RECV_GRADIENT:
        return ("gradient", action.chunk, action.microbatch)
    return ("activation", training, action.chunk, action.microbatch)


def _training_schedule(schedule: str | Schedule, num_stages: int, chunks: int, virtual_stages: int) -> Schedule:
    """`schedule` by name, or checked to fit (num_stages, chunks, virtual_stages) and to train."""
    if not isinstance(schedule, Schedule):
        return make_schedule(schedule, num_stages, chunks, virtual_stages)
    shape = (schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages)
    if shape != (num_stages, chunks, virtual_stages):
        raise ValueError(f"the schedule is for {shape[0]} stages x {shape[1]} micro-batches x {shape[2]} model "
                         f"chunks, but this pipeline has {num_stages} stages x {chunks} chunks x {virtual_stages} "
                         "model chunks")
    if not schedule.training:
        raise ValueError("a training schedule needs backward actions; this one only runs forwards")
    check_schedule(schedule)
    return schedule
