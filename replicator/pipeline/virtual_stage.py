"""VirtualPipelineStage: a process's V model chunks of a pipeline, for interleaved and zero-bubble schedules.

The model is cut into K x V pieces and piece p runs on stage p % K as its chunk p // K,
so activations travel round a ring of stages (the last stage passes them on to the first)
and gradients back round it. The stage walks its schedule's actions (actions.Action, each
naming a chunk) as PipelineStage does, with the same messages (p2p.Link), the same
failure protocol (a failed stage sends aborts in place of data; failures.py ends the
step with the same PipelineError everywhere) and the same step hooks; a split backward
runs its input and weight passes separately (split_backward.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from replicator._tree import tensors, to_device
from replicator.comm import p2p
from replicator.pipeline.failures import end_evaluation_step, end_training_step
from replicator.pipeline.hooks import StageHooks, with_no_sync
from replicator.pipeline.links import StageLinks
from replicator.pipeline.microbatch import gather, microbatch_sizes, scatter, shared_batch_size
from replicator.pipeline.recompute import recomputing, resolve_recompute, should_recompute
from replicator.pipeline.schedule import (
    Action,
    Op,
    Schedule,
    check_schedule,
    endpoint,
    forward_only_ring,
    make_schedule,
)
from replicator.pipeline.split_backward import WeightGradient, backward_input
from replicator.pipeline.step import PipelineError, StepState
from replicator.pipeline.timeline import Event, Timeline

__all__ = ["VirtualPipelineStage", "StageChunks"]

LossFn = Callable[[Any, Any], torch.Tensor]


class StageChunks(nn.Module):
    """The layers of all of a stage's chunks under their names in the whole model (for state_dict and optimizers).

    Not callable: a stage's chunks are not consecutive in the model; each runs on its own
    (`VirtualPipelineStage.chunk_modules`).
    """

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        super().__init__()
        for chunk in chunks:
            for name, layer in chunk.named_children():
                self.add_module(name, layer)

    def forward(self, *args: Any) -> Any:
        raise TypeError("a stage's chunks are not consecutive layers; call chunk_modules[v] for chunk v")


class VirtualPipelineStage:
    """Stage `stage_id` of a K-stage pipeline holding V chunks, running any schedule (interleaved, zero bubble).

    Same interface and arguments as PipelineStage, except `chunk_modules`: this stage's V
    pieces of the model, chunk v being piece v * K + stage_id. `schedule` is "interleaved",
    "zero_bubble" (or any name of make_schedule) or a Schedule for (K, M, V).
    """

    def __init__(
        self,
        chunk_modules: Sequence[nn.Module],
        *,
        stage_id: int,
        num_stages: int,
        stage_ranks: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        chunks: int = 1,
        schedule: str | Schedule = "interleaved",
        recompute: str = "except_last",
        device: torch.device | str | None = None,
        replica: int = 0,
        record: bool = True,
        hooks: StageHooks | None = None,
        no_sync: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        if not 0 <= stage_id < num_stages:
            raise ValueError(f"stage_id must be in 0..{num_stages - 1}, got {stage_id}")
        if chunks < 1:
            raise ValueError(f"chunks (micro-batches per mini-batch) must be at least 1, got {chunks}")
        self.chunk_modules = list(chunk_modules)
        self.virtual_stages = V = len(self.chunk_modules)
        self.module = StageChunks(self.chunk_modules)
        self.stage_id, self.num_stages, self.chunks = stage_id, num_stages, chunks
        self.recompute = resolve_recompute(recompute, None)
        self.schedule = _training_schedule(schedule, num_stages, chunks, V)
        self._forward_schedule = forward_only_ring(num_stages, chunks, V)
        if device is None:
            first = next(iter(self.module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.group = group
        self.stage_ranks = list(stage_ranks) if stage_ranks is not None else list(range(num_stages))
        if num_stages > 1 and (group is None or not dist.is_initialized()):
            raise ValueError(f"a pipeline of {num_stages} stages needs torch.distributed and the stage group")
        if num_stages > 1 and dist.get_rank() != self.stage_ranks[stage_id]:
            raise ValueError(f"this process has global rank {dist.get_rank()} but stage_ranks[{stage_id}] is "
                             f"{self.stage_ranks[stage_id]}; pass the stage ranks of this process's replica")
        self.replica = replica
        self.timeline = Timeline(stage_id, replica, enabled=record)
        self.hooks = with_no_sync(hooks, no_sync)
        self.holds_last = stage_id == num_stages - 1  # the last piece, which computes the loss
        actions = self.schedule.stages[stage_id]
        updates = [n for n, a in enumerate(actions) if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT)]
        self._last_update = updates[-1] if updates else -1
        self._outgoing: dict[int, p2p.Link] = {}
        self._incoming: dict[int, p2p.Link] = {}
        if num_stages > 1:
            assert group is not None
            for peer in {(stage_id + 1) % num_stages, (stage_id - 1) % num_stages}:
                self._outgoing[peer] = p2p.Link(self.stage_ranks[peer], group, self.device)
                self._incoming[peer] = p2p.Link(self.stage_ranks[peer], group, self.device)
        # The end-of-step status message runs down the stages, not round the ring.
        self.links = StageLinks(
            to_next=self._outgoing.get(stage_id + 1) if stage_id < num_stages - 1 else None,
            from_next=self._incoming.get(stage_id + 1) if stage_id < num_stages - 1 else None,
            to_previous=self._outgoing.get(stage_id - 1) if stage_id > 0 else None,
            from_previous=self._incoming.get(stage_id - 1) if stage_id > 0 else None,
        )
        self._weights: dict[int, WeightGradient] = {}
        self._losses_counted = 0

    # -- identity ----------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.holds_last

    @property
    def message_count(self) -> int:
        """Point-to-point messages this stage has posted so far, sends and receives."""
        return sum(link.messages for link in {*self._outgoing.values(), *self._incoming.values()})

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This stage's parameters, of all its chunks (give them to this stage's optimizer)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)

    def train(self, mode: bool = True) -> VirtualPipelineStage:
        self.module.train(mode)
        return self

    def eval(self) -> VirtualPipelineStage:
        return self.train(False)

    def _where(self) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return f"stage {self.stage_id} of {self.num_stages} (rank {rank})"

    def _slot(self, action: Action) -> int:
        return action.chunk * self.chunks + action.microbatch

    def _piece(self, chunk: int) -> int:
        return self.schedule.piece(self.stage_id, chunk)

    # -- steps -------------------------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None, loss_fn: LossFn | None = None, *,
                   reduction: str = "mean") -> torch.Tensor:
        """As PipelineStage.train_step: every micro-batch through every chunk, forward and backward."""
        hooks = self.hooks
        with hooks.hold_gradients() if hooks.hold_gradients is not None else contextlib.nullcontext():
            try:
                loss = self._run_training_step(inputs, targets, loss_fn, reduction)
            except PipelineError as error:
                if hooks.agree_on_outcome is not None:
                    hooks.agree_on_outcome(f"pipeline train_step failed: {error}"[:200])
                raise
        if hooks.agree_on_outcome is not None:
            hooks.agree_on_outcome("pipeline train_step succeeded")
        if hooks.release_gradients is not None:
            hooks.release_gradients()
        return loss

    def _run_training_step(self, inputs: Any, targets: Any, loss_fn: LossFn | None, reduction: str) -> torch.Tensor:
        step = self._begin(training=True)
        with torch.enable_grad():
            if reduction not in ("mean", "sum"):
                step.fail(ValueError(f'reduction must be "mean" or "sum", got {reduction!r}'), self._where())
            elif self.holds_last and not callable(loss_fn):
                step.fail(ValueError(f"train_step needs a loss_fn(output, target) on the last stage, got {loss_fn!r}"),
                          self._where())
            self._start(step, inputs, targets)
            for n, action in enumerate(self.schedule.stages[self.stage_id]):
                with self.timeline.record(action.op.value, action.microbatch, action.chunk):
                    self._act(n, action, step, targets, loss_fn, reduction)
        self._weights.clear()
        self._settle()
        end_training_step(step, self.links, self.module, self._where())
        if self.holds_last:
            assert step.loss_total is not None
            return step.loss_total.to(torch.float32)
        assert step.loss_relayed is not None, "no gradient message carried the loss"
        return torch.tensor(step.loss_relayed, dtype=torch.float32, device=self.device)

    def eval_step(self, inputs: Any = None) -> Any:
        """Forward only (no gradients); the joined output on the last stage, None on the others."""
        step = self._begin(training=False)
        result: Any = None
        with torch.no_grad():
            self._start(step, inputs, None)
            for n, action in enumerate(self._forward_schedule.stages[self.stage_id]):
                with self.timeline.record(action.op.value, action.microbatch, action.chunk):
                    self._act(n, action, step, None, None, "mean")
            if self.holds_last and step.ok:
                last = (self.virtual_stages - 1) * self.chunks
                try:
                    result = gather([step.outputs.pop(last + i) for i in range(self.chunks)])
                except Exception as error:
                    step.fail(error, self._where())
        self._settle()
        end_evaluation_step(step, self.links, self.module, self._where(), stage_id=self.stage_id,
                            num_stages=self.num_stages, stage_ranks=self.stage_ranks, group=self.group,
                            device=self.device)
        return result

    def gather_timeline(self) -> list[Event]:
        """Every stage's events of the last step, on every stage (collective over the stage group)."""
        if self.group is None or self.num_stages == 1:
            return list(self.timeline.events)
        ops = [op.value for op in Op]
        rows = [[e.stage, ops.index(e.op), e.microbatch, e.start, e.end, e.replica, e.chunk]
                for e in self.timeline.events]
        mine = torch.tensor(rows, dtype=torch.float64).reshape(-1, 7).to(self.device)
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.num_stages)]
        dist.all_gather(counts, torch.tensor([len(rows)], device=self.device), group=self.group)
        sizes = [int(c.item()) for c in counts]
        padded = torch.zeros(max(sizes), 7, dtype=torch.float64, device=self.device)
        padded[: len(rows)] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.num_stages)]
        dist.all_gather(gathered, padded, group=self.group)
        return [Event(int(r[0]), ops[int(r[1])], int(r[2]), float(r[3]), float(r[4]), int(r[5]), int(r[6]))
                for tensor, size in zip(gathered, sizes) for r in tensor[:size].cpu().tolist()]

    # -- the schedule's actions --------------------------------------------------------
    def _begin(self, training: bool) -> StepState:
        self.timeline.clear()
        self._losses_counted = 0  # micro-batch losses summed so far on the last piece
        return StepState(training=training)

    def _settle(self) -> None:
        # Every send completes before the step ends; each peer has received them all by the
        # end of its own schedule, so this never waits on a peer that waits on us.
        for link in self._outgoing.values():
            link.settle_all()

    def _start(self, step: StepState, inputs: Any, targets: Any) -> None:
        if not step.ok or not self.is_first:
            return
        try:
            if inputs is None:
                raise ValueError("the first stage needs the inputs: call train_step/eval_step(inputs, ...) on every "
                                 "stage")
            size = shared_batch_size(inputs)
            assert size is not None
            step.batch_size = size
            step.sizes = dict(enumerate(microbatch_sizes(size, self.chunks)))
            step.inputs = {i: to_device(chunk, self.device) for i, chunk in enumerate(scatter(inputs, self.chunks))}
            if self.holds_last and step.training:
                self._split_targets(step, targets)
        except Exception as error:
            step.fail(error, self._where())

    def _split_targets(self, step: StepState, targets: Any) -> None:
        size = None if targets is None else shared_batch_size(targets)
        if size is None:
            step.targets = [to_device(targets, self.device)] * self.chunks
            return
        if size != step.batch_size:
            raise ValueError(f"the targets hold {size} samples but the inputs {step.batch_size}; pass the targets of "
                             "the same batch")
        step.targets = [to_device(t, self.device) for t in scatter(targets, self.chunks)]

    def _act(self, n: int, action: Action, step: StepState, targets: Any, loss_fn: LossFn | None,
             reduction: str) -> None:
        op, slot = action.op, self._slot(action)
        if op.is_compute:
            if not step.ok:
                return
            try:
                if op is Op.FORWARD:
                    self._forward(action, step, loss_fn, reduction)
                else:
                    quiet = self.hooks.no_sync is not None and n != self._last_update
                    with self.hooks.no_sync() if quiet and self.hooks.no_sync is not None else contextlib.nullcontext():
                        self._backward(action, step)
            except Exception as error:
                step.fail(error, self._where())
            return
        peer, there = endpoint(self.schedule if step.training else self._forward_schedule, self.stage_id, action)
        if op is Op.SEND_ACTIVATION:
            key: Hashable = ("activation", step.training, there.chunk, action.microbatch)
            self._send(self._outgoing[peer], key, action.microbatch, step, step.outputs.pop(slot, None),
                       keep_at=slot if step.training else None)
        elif op is Op.SEND_GRADIENT:
            self._send(self._outgoing[peer], ("gradient", there.chunk, action.microbatch), action.microbatch, step,
                       step.grads_out.pop(slot, None), loss=self._known_loss(step))
        elif op is Op.RECV_ACTIVATION:
            message = self._incoming[peer].recv(("activation", step.training, action.chunk, action.microbatch))
            if message.is_abort:
                step.fail(message.error or "", self._where())
            elif step.ok:
                try:
                    self._accept_input(action, message, step, targets)
                except Exception as error:
                    step.fail(error, self._where())
        else:  # RECV_GRADIENT
            message = self._incoming[peer].recv(("gradient", action.chunk, action.microbatch))
            if message.is_abort:
                step.fail(message.error or "", self._where())
            else:
                if message.loss is not None:
                    step.loss_relayed = message.loss
                if step.ok:
                    step.grads_in[slot] = message.value

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
        if self.holds_last:
            complete = step.loss_total is not None and self._losses_counted == self.chunks
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
            if self.holds_last and step.training:
                self._split_targets(step, targets)

    def _forward(self, action: Action, step: StepState, loss_fn: LossFn | None, reduction: str) -> None:
        slot, i, c = self._slot(action), action.microbatch, action.chunk
        x = step.inputs[slot] if step.training else step.inputs.pop(slot)
        module = self.chunk_modules[c]
        if step.training and should_recompute(self.recompute, i, self.chunks):
            output = checkpoint(module, x, use_reentrant=False,
                                context_fn=lambda: (contextlib.nullcontext(), _Recomputing(module)))
        else:
            output = module(x)
        if self._piece(c) < self.schedule.num_pieces - 1:
            p2p.encode_structure(output, path=f"the output of piece {self._piece(c)} (micro-batch {i})")
            step.outputs[slot] = output
        elif not step.training:
            step.outputs[slot] = output
        else:
            assert loss_fn is not None and step.targets is not None
            loss = loss_fn(output, step.targets[i])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                raise ValueError(f"loss_fn must return a scalar floating-point tensor (reduce it, e.g. with .mean()), "
                                 f"but for micro-batch {i} it returned {type(loss).__name__}"
                                 + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            weight = step.sizes[i] / step.batch_size if reduction == "mean" else 1.0
            step.losses[slot] = loss.reshape(()) * weight
            contribution = loss.detach().reshape(()).to(torch.float64) * weight
            step.loss_total = contribution if step.loss_total is None else step.loss_total + contribution
            self._losses_counted += 1

    def _backward(self, action: Action, step: StepState) -> None:
        slot = self._slot(action)
        if action.op is Op.BACKWARD_WEIGHT:
            self._weights.pop(slot).run()
            return
        if self._piece(action.chunk) == self.schedule.num_pieces - 1:
            outputs, grads = [step.losses.pop(slot)], None
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
            found, self._weights[slot] = backward_input(outputs, grads, wanted, params)
        if self._piece(action.chunk) > 0:
            step.grads_out[slot] = tuple(found)


class _Recomputing:
    """recompute.recomputing(module) that can be entered again: a split backward recomputes in each of its passes."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._open: list[AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        context = recomputing(self.module)
        self._open.append(context)
        context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._open.pop().__exit__(*exc)


def _training_schedule(schedule: str | Schedule, num_stages: int, chunks: int, virtual_stages: int) -> Schedule:
    if not isinstance(schedule, Schedule):
        return make_schedule(schedule, num_stages, chunks, virtual_stages)
    shape = (schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages)
    if shape != (num_stages, chunks, virtual_stages):
        raise ValueError(f"the schedule is for {shape[0]} stages x {shape[1]} micro-batches x {shape[2]} chunks, but "
                         f"this pipeline has {num_stages} stages x {chunks} micro-batches x {virtual_stages} chunks")
    if not schedule.training:
        raise ValueError("a training schedule needs backward actions; this one only runs forwards")
    check_schedule(schedule)
    return schedule
