"""PipelineStage: this process's stage of a pipeline, running its schedule over point-to-point messages."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Hashable, Iterator, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import nn

from replicator.errors import ReplicatorError
from replicator.comm import p2p
from replicator.pipeline.batchnorm import commit_deferred_batchnorm
from replicator.pipeline.checkpointing import check_mode, run_forward, should_checkpoint
from replicator.pipeline.microbatch import batch_size as batch_size_of
from replicator.pipeline.microbatch import gather, iter_tensors, microbatch_sizes, scatter
from replicator.pipeline.schedule import Action, Op, Schedule, check_schedule, forward_only, make_schedule
from replicator.pipeline.timeline import Event, Timeline

__all__ = ["PipelineStage", "PipelineError"]

LossFn = Callable[[Any, Any], torch.Tensor]
_FAILURE_TEXT_BYTES = 2048


class PipelineError(ReplicatorError):
    """A pipeline step failed on some stage; every stage of that pipeline raises it."""


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        items = [_to_device(v, device) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device)) for k, v in value.items())
    return value


@dataclass
class _Step:
    """The state of one train or eval step on one stage."""

    training: bool
    failure: str | None = None  # what went wrong, as every stage will report it
    cause: BaseException | None = None  # the exception, when it was raised on this stage
    batch_size: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    loss_total: torch.Tensor | None = None  # the last stage's sum of the micro-batch losses
    loss_relayed: float | None = None  # the same, as the next stage's last gradient message carried it
    grads_in: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    grads_out: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    targets: list[Any] | None = None
    sent_before: dict[int, int] = field(default_factory=dict)  # transfers each neighbour had been sent before this step

    @property
    def ok(self) -> bool:
        return self.failure is None

    def drop_state(self) -> None:
        for store in (self.inputs, self.outputs, self.losses, self.grads_in, self.grads_out):
            store.clear()


class PipelineStage:
    """One stage of a K-stage pipeline that splits each mini-batch into `chunks` micro-batches.

    Every stage calls `train_step` (or `eval_step`) with the same arguments; the first stage
    uses the inputs, the last the targets and the loss function. The stage walks its list
    of actions from the schedule: forwards and backwards of micro-batches, and the sends
    and receives that link it to its neighbours (p2p.Link). Sends are started without
    waiting and completed at the end of the step; receives wait.

    Failures never leave a neighbour waiting. A stage whose forward, backward, loss or
    input fails keeps walking its schedule without computing: each send becomes an *abort*
    message that carries the error, each receive still takes its message. A training step
    then ends without a collective. In any schedule that `check_schedule` accepts, a
    stage's last gradient send comes after all its computing and receiving (a receive
    precedes the pass that needs it, a pass precedes its send), so every failure reaches
    the stages upstream of it as an aborted gradient, and the sum of the losses reaches the
    first stage in the header of each stage's last gradient message. Downstream, a failure
    travels as an aborted activation, except one that comes after a stage's last
    activation send (in a backward): for that, each stage passes a tiny *status* message
    (ok, or the failure) to the next once its actions are done. An evaluation step, whose
    messages flow downstream only, ends with one small all-reduce of a failure flag per
    stage. Every stage then raises PipelineError naming the stage that failed and why. No
    message is left unmatched, so the pipeline can run the next step (zero the gradients
    first: a failed step may have accumulated some).

    Args:
        module: this stage's layers (called as `module(x)`, where x is a tensor or a
            tuple/list/dict of tensors exactly as the previous stage returned it).
        stage_id: this stage's index, 0 ... num_stages - 1.
        num_stages: K.
        stage_ranks: the global ranks of the K stages of this replica (ProcessGroups.stage_ranks).
        group: a process group holding those ranks (ProcessGroups.stage); None when K == 1.
        chunks: M, the number of micro-batches per mini-batch.
        schedule: "gpipe", "1f1b" or a Schedule for (K, M).
        checkpoint: "always", "except_last" or "never" (re-materialisation, see checkpointing).
        device: where the stage computes and receives; default: where its parameters are.
        replica: the replica this stage belongs to (labels the timeline only).
        record: record a timeline of the last step's actions (`stage.timeline`).
        no_sync: a context manager factory (e.g. Replicator.no_sync) entered around every
            backward of a step but the stage's last one, so that a gradient synchronizer
            averages across replicas once per step, during the last backward.
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
        checkpoint: str = "except_last",
        device: torch.device | str | None = None,
        replica: int = 0,
        record: bool = True,
        no_sync: Callable[[], ContextManager[Any]] | None = None,
    ) -> None:
        if not 0 <= stage_id < num_stages:
            raise ValueError(f"stage_id must be in 0..{num_stages - 1}, got {stage_id}")
        if chunks < 1:
            raise ValueError(f"chunks (micro-batches per mini-batch) must be at least 1, got {chunks}")
        self.module = module
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.chunks = chunks
        self.checkpoint = check_mode(checkpoint)
        if isinstance(schedule, Schedule):
            if (schedule.num_stages, schedule.num_microbatches) != (num_stages, chunks):
                raise ValueError(
                    f"the schedule is for {schedule.num_stages} stages x {schedule.num_microbatches} micro-batches, "
                    f"but this pipeline has {num_stages} stages x {chunks} chunks"
                )
            if not schedule.training:
                raise ValueError("a training schedule needs backward actions; this one only runs forwards")
            check_schedule(schedule)
            self.schedule = schedule
        else:
            self.schedule = make_schedule(schedule, num_stages, chunks)
        self._forward_schedule = forward_only(num_stages, chunks)
        if device is None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
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
        self.no_sync = no_sync
        backwards = [a.microbatch for a in self.schedule.stages[stage_id] if a.op is Op.BACKWARD]
        self._last_backward = backwards[-1]
        self._train_delivered = _delivered_counts(self.schedule, stage_id)
        self._eval_delivered = _delivered_counts(self._forward_schedule, stage_id)
        gradient_sends = [a for a in self.schedule.stages[stage_id] if a.op is Op.SEND_GRADIENT]
        self._last_gradient_send = gradient_sends[-1] if gradient_sends else None
        # One link per neighbour and direction; activations and status messages share the
        # downstream one, which keeps them in the order both ends expect.
        self._to_next: p2p.Link | None = None
        self._from_next: p2p.Link | None = None
        self._to_previous: p2p.Link | None = None
        self._from_previous: p2p.Link | None = None
        if num_stages > 1:
            assert group is not None
            if not self.is_last:
                self._to_next = p2p.Link(self.stage_ranks[stage_id + 1], group, self.device)
                self._from_next = p2p.Link(self.stage_ranks[stage_id + 1], group, self.device)
            if not self.is_first:
                self._to_previous = p2p.Link(self.stage_ranks[stage_id - 1], group, self.device)
                self._from_previous = p2p.Link(self.stage_ranks[stage_id - 1], group, self.device)

    # -- identity ----------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1

    @property
    def message_count(self) -> int:
        """Point-to-point messages this stage has posted so far, sends and receives."""
        links = (self._to_next, self._from_next, self._to_previous, self._from_previous)
        return sum(link.messages for link in links if link is not None)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This stage's parameters (give them to this stage's optimizer)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)

    def train(self, mode: bool = True) -> "PipelineStage":
        self.module.train(mode)
        return self

    def eval(self) -> "PipelineStage":
        return self.train(False)

    def _where(self) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return f"stage {self.stage_id} of {self.num_stages} (rank {rank})"

    # -- steps -------------------------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None, loss_fn: LossFn | None = None, *,
                   reduction: str = "mean") -> torch.Tensor:
        """Forward and backward over all micro-batches; return the mini-batch loss on every stage.

        Call it on every stage with the same arguments: the first stage reads `inputs`, the
        last stage `targets` and `loss_fn(output, target)` (per micro-batch; must return a
        scalar). With reduction="mean" (a loss averaged over samples) each micro-batch's
        loss is weighted by its share of the batch, so the returned loss and the
        accumulated gradients equal those of the unsplit batch; with "sum" they are
        added. Gradients accumulate into `.grad` as loss.backward() would: zero them
        between steps. Returns a detached float32 scalar on this stage's device.
        """
        step = self._begin(training=True)
        with torch.enable_grad():
            if reduction not in ("mean", "sum"):
                self._fail(step, ValueError(f'reduction must be "mean" or "sum", got {reduction!r}'))
            elif self.is_last and not callable(loss_fn):
                self._fail(step, ValueError(f"train_step needs a loss_fn(output, target) on the last stage, got {loss_fn!r}"))
            self._start(step, inputs, targets)
            for action, delivered in zip(self.schedule.stages[self.stage_id], self._train_delivered):
                with self.timeline.record(action.op.value, action.microbatch):
                    self._act(action, step, targets, loss_fn, reduction, delivered)
        return self._finish_training(step).to(torch.float32)

    def eval_step(self, inputs: Any = None) -> Any:
        """Forward only (no gradients); return the joined output on the last stage, None on the others.

        Every stage must call it (with the inputs on the first stage). The module's mode
        (train/eval) is the caller's: call `stage.eval()` for inference behaviour.
        """
        step = self._begin(training=False)
        result: Any = None
        with torch.no_grad():
            self._start(step, inputs, None)
            for action, delivered in zip(self._forward_schedule.stages[self.stage_id], self._eval_delivered):
                with self.timeline.record(action.op.value, action.microbatch):
                    self._act(action, step, None, None, "mean", delivered)
            if self.is_last and step.ok:
                try:
                    result = gather([step.outputs.pop(i) for i in range(self.chunks)])
                except Exception as error:
                    self._fail(step, error)
        self._finish_evaluation(step)
        return result

    def gather_timeline(self) -> list[Event]:
        """Every stage's events of the last step, on every stage (collective over the stage group)."""
        if self.group is None or self.num_stages == 1:
            return list(self.timeline.events)
        # Numbers in a tensor, not all_gather_object: that would unpickle whatever the peers send.
        ops = [op.value for op in Op]
        rows = [[e.stage, ops.index(e.op), e.microbatch, e.start, e.end, e.replica] for e in self.timeline.events]
        mine = torch.tensor(rows, dtype=torch.float64).reshape(-1, 6).to(self.device)
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.num_stages)]
        dist.all_gather(counts, torch.tensor([len(rows)], device=self.device), group=self.group)
        sizes = [int(c.item()) for c in counts]
        if not max(sizes):
            return []
        padded = torch.zeros(max(sizes), 6, dtype=torch.float64, device=self.device)
        padded[: len(rows)] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.num_stages)]
        dist.all_gather(gathered, padded, group=self.group)
        return [
            Event(int(r[0]), ops[int(r[1])], int(r[2]), float(r[3]), float(r[4]), int(r[5]))
            for tensor, size in zip(gathered, sizes) for r in tensor[:size].cpu().tolist()
        ]

    # -- the step's pieces -------------------------------------------------------------
    def _begin(self, training: bool) -> _Step:
        step = _Step(training=training)
        for link in (self._to_next, self._to_previous):
            if link is not None:
                step.sent_before[link.peer] = link.sent
        self.timeline.clear()
        return step

    def _settle_sends(self) -> None:
        for link in (self._to_next, self._to_previous):
            if link is not None:
                link.settle_all()

    def _fail(self, step: _Step, error: BaseException | str) -> None:
        if step.failure is not None:
            return
        if isinstance(error, BaseException):
            step.failure = f"{self._where()} failed: {type(error).__name__}: {error}"
            step.cause = error
        else:
            step.failure = error
        step.drop_state()

    def _start(self, step: _Step, inputs: Any, targets: Any) -> None:
        if not step.ok or not self.is_first:
            return
        try:
            if inputs is None:
                raise ValueError("the first stage needs the inputs: call train_step/eval_step(inputs, ...) on every stage")
            chunks = scatter(inputs, self.chunks)
            size = batch_size_of(inputs)
            assert size is not None
            step.batch_size = size
            step.sizes = dict(enumerate(microbatch_sizes(size, self.chunks)))
            step.inputs = {i: _to_device(chunk, self.device) for i, chunk in enumerate(chunks)}
            if self.is_last and step.training:
                self._split_targets(step, targets)
        except Exception as error:
            self._fail(step, error)

    def _split_targets(self, step: _Step, targets: Any) -> None:
        if targets is None or batch_size_of(targets) is None:
            step.targets = [_to_device(targets, self.device)] * self.chunks
            return
        size = batch_size_of(targets)
        if size != step.batch_size:
            raise ValueError(
                f"the targets hold {size} samples but the inputs {step.batch_size}; pass the targets of the same batch"
            )
        step.targets = [_to_device(t, self.device) for t in scatter(targets, self.chunks)]

    def _act(self, action: Action, step: _Step, targets: Any, loss_fn: LossFn | None, reduction: str,
             delivered: int) -> None:
        op, i = action.op, action.microbatch
        if op is Op.FORWARD or op is Op.BACKWARD:
            if step.ok:
                try:
                    if op is Op.FORWARD:
                        self._forward(i, step, loss_fn, reduction)
                    else:
                        self._backward(i, step)
                except Exception as error:
                    self._fail(step, error)
        elif op is Op.SEND_ACTIVATION:
            assert self._to_next is not None
            self._send(self._to_next, ("activation", step.training, i), i, step, step.outputs.pop(i, None),
                       keep=step.training)
        elif op is Op.SEND_GRADIENT:
            loss = None
            if action == self._last_gradient_send:  # every micro-batch's loss is in by now: pass it on
                loss = self._known_loss(step)
            assert self._to_previous is not None
            self._send(self._to_previous, ("gradient", i), i, step, step.grads_out.pop(i, None), keep=False, loss=loss)
        elif op is Op.RECV_ACTIVATION:
            message = self._from_previous.recv(("activation", step.training, i))  # type: ignore[union-attr]
            self._settle(self._to_previous, step, delivered)
            if message.is_abort:
                self._fail(step, message.error or "")
            elif step.ok:
                try:
                    self._accept_input(i, message, step, targets)
                except Exception as error:
                    self._fail(step, error)
        else:  # RECV_GRADIENT
            message = self._from_next.recv(("gradient", i))  # type: ignore[union-attr]
            self._settle(self._to_next, step, delivered)
            if message.is_abort:
                self._fail(step, message.error or "")
            else:
                if message.loss is not None:
                    step.loss_relayed = message.loss
                if step.ok:
                    step.grads_in[i] = message.value

    def _send(self, link: p2p.Link, key: Hashable, i: int, step: _Step, value: Any, keep: bool,
              loss: float | None = None) -> None:
        if step.ok:
            if keep:
                step.outputs[i] = value  # the graph stays for backward; only the packed bytes travel
            link.send(key, value, microbatch=i, microbatch_size=step.sizes.get(i, 0), batch_size=step.batch_size,
                      allow_none=True, loss=loss)
        else:
            link.send_abort(key, step.failure or "", microbatch=i)

    @staticmethod
    def _settle(link: p2p.Link | None, step: _Step, delivered: int) -> None:
        """Let go of the packed copies of the sends to `link`'s peer that it has surely received.

        `delivered` counts this step's sends the peer had received before sending the
        message that just arrived (from the schedule): without this, the first stage would
        hold a copy of every activation it sent through its backwards, where its memory
        peaks.
        """
        if link is not None and delivered:
            link.settle(step.sent_before[link.peer] + delivered)

    def _known_loss(self, step: _Step) -> float | None:
        if not step.ok:
            return None
        if self.is_last:
            return None if step.loss_total is None else float(step.loss_total)
        return step.loss_relayed

    def _accept_input(self, i: int, message: p2p.Message, step: _Step, targets: Any) -> None:
        if message.microbatch != i:
            raise RuntimeError(f"expected micro-batch {i} from the previous stage but received {message.microbatch}: "
                               "the stages run different schedules or chunks")
        step.inputs[i] = message.value
        step.sizes[i] = message.microbatch_size
        if step.batch_size == 0:
            step.batch_size = message.batch_size
            if self.is_last and step.training:
                self._split_targets(step, targets)

    def _forward(self, i: int, step: _Step, loss_fn: LossFn | None, reduction: str) -> None:
        x = step.inputs[i] if step.training else step.inputs.pop(i)
        rematerialize = step.training and should_checkpoint(self.checkpoint, i, self.chunks)
        output = run_forward(self.module, x, rematerialize)
        if not self.is_last:
            p2p.encode_structure(output, path=f"the output of stage {self.stage_id} (micro-batch {i})")
            step.outputs[i] = output
        elif not step.training:
            step.outputs[i] = output
        else:
            assert loss_fn is not None and step.targets is not None
            loss = loss_fn(output, step.targets[i])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                shown = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor) \
                    else f"a {type(loss).__name__}"
                raise ValueError(
                    f"loss_fn must return a scalar floating-point tensor (reduce it, e.g. with .mean()), but for "
                    f"micro-batch {i} it returned {shown}"
                )
            weight = step.sizes[i] / step.batch_size if reduction == "mean" else 1.0
            step.losses[i] = loss.reshape(()) * weight
            contribution = loss.detach().reshape(()).to(torch.float64) * weight
            step.loss_total = contribution if step.loss_total is None else step.loss_total + contribution

    def _backward(self, i: int, step: _Step) -> None:
        quiet = self.no_sync is not None and i != self._last_backward
        with self.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[misc]
            if self.is_last:
                step.losses.pop(i).backward()
            else:
                output = step.outputs.pop(i)
                grads = step.grads_in.pop(i)
                tensors = [t for t in iter_tensors(output) if t.requires_grad]
                if len(grads) != len(tensors):
                    raise RuntimeError(f"received {len(grads)} gradients for {len(tensors)} outputs of micro-batch {i}")
                pairs = [(t, g) for t, g in zip(tensors, grads) if g is not None]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        x = step.inputs.pop(i)
        if not self.is_first:
            step.grads_out[i] = tuple(t.grad for t in iter_tensors(x) if t.requires_grad)

    def _finish_training(self, step: _Step) -> torch.Tensor:
        """End a training step without a collective: each stage tells the next whether the step failed.

        Only the stages downstream of a failed backward have not heard of it yet, and they
        do through this status message; every other failure reached every stage through
        the activations and gradients (see the class docstring).
        """
        if self._from_previous is not None:
            message = self._from_previous.recv(("status",))
            if message.is_abort:
                self._fail(step, message.error or "")
        if self._to_next is not None:
            if step.ok:
                self._to_next.send(("status",), None, microbatch=-1, microbatch_size=0, batch_size=0, allow_none=True)
            else:
                self._to_next.send_abort(("status",), step.failure or "", microbatch=-1)
        # Every send completes before the step returns: a work dropped while in flight (say,
        # with a pipeline the caller discards) would lose its message.
        self._settle_sends()
        commit_deferred_batchnorm(self.module, keep=step.ok)
        if not step.ok:
            self._raise_failed(step, str(step.failure))
        if self.is_last:
            assert step.loss_total is not None
            return step.loss_total
        assert step.loss_relayed is not None, "the next stage's last gradient message carried no loss"
        return torch.tensor(step.loss_relayed, dtype=torch.float64, device=self.device)

    def _finish_evaluation(self, step: _Step) -> None:
        """End an evaluation step: every stage learns, through one all-reduce, whether any failed."""
        self._settle_sends()
        own = 2.0 if step.cause is not None else (1.0 if step.failure is not None else 0.0)
        flags_tensor = torch.zeros(self.num_stages, dtype=torch.float64, device=self.device)
        flags_tensor[self.stage_id] = own
        if self.num_stages > 1:
            dist.all_reduce(flags_tensor, group=self.group)
        flags = flags_tensor.tolist()
        commit_deferred_batchnorm(self.module, keep=not any(flags))
        if any(flags):
            origins = [s for s, flag in enumerate(flags) if flag == 2.0]
            reason = self._failure_text(step, origins[0]) if origins else (step.failure or "a stage failed")
            if len(origins) > 1:
                reason += f" (stages {origins} failed)"
            self._raise_failed(step, reason)

    def _raise_failed(self, step: _Step, reason: str) -> NoReturn:
        """Every stage ends a failed step with the same error, naming where it was reported."""
        where = "" if step.cause is not None else f" [reported on {self._where()}]"
        step.drop_state()
        raise PipelineError(
            f"pipeline step failed: {reason}{where}. Every stage stopped this step; gradients may be partly "
            "accumulated, so zero them before the next step"
        ) from step.cause

    def _failure_text(self, step: _Step, origin: int) -> str:
        """The failing stage's own description of its error, shared with every stage."""
        if self.num_stages == 1:
            return step.failure or ""
        # Only on the failure path: evaluation messages flow downstream only, so a stage
        # upstream of a failure never hears of it through them; the first failing stage
        # broadcasts its text.
        text = torch.zeros(_FAILURE_TEXT_BYTES, dtype=torch.uint8)
        raw = (step.failure or "").encode("utf-8")[:_FAILURE_TEXT_BYTES] if self.stage_id == origin else b""
        if raw:
            text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        text = text.to(self.device)
        dist.broadcast(text, src=self.stage_ranks[origin], group=self.group)
        return bytes(text.cpu().tolist()).rstrip(b"\0").decode("utf-8", errors="replace")



def _delivered_counts(schedule: Schedule, stage: int) -> list[int]:
    """For each action of `stage`: if it receives, how many of the step's sends to that neighbour it proves delivered.

    The neighbour sent the message after receiving that many of ours (the schedule says
    how many), so those sends have completed. Other actions get 0.
    """
    actions = schedule.stages[stage]
    counts = [0] * len(actions)
    for neighbour, incoming, outgoing_there, incoming_there in (
        (stage - 1, Op.RECV_ACTIVATION, Op.SEND_ACTIVATION, Op.RECV_GRADIENT),
        (stage + 1, Op.RECV_GRADIENT, Op.SEND_GRADIENT, Op.RECV_ACTIVATION),
    ):
        if not 0 <= neighbour < schedule.num_stages:
            continue
        proven = []  # per message the neighbour sends us: our messages it had received by then
        received = 0
        for action in schedule.stages[neighbour]:
            if action.op is incoming_there:
                received += 1
            elif action.op is outgoing_there:
                proven.append(received)
        positions = [n for n, action in enumerate(actions) if action.op is incoming]
        for position, count in zip(positions, proven, strict=True):
            counts[position] = count
    return counts
