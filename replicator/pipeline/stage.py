"""PipelineStage: this process's stage of a pipeline, running its schedule over point-to-point messages."""

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
from replicator.pipeline.hooks import StageHooks, with_no_sync
from replicator.pipeline.links import StageLinks, delivered_counts, settle_delivered
from replicator.pipeline.microbatch import gather, microbatch_sizes, scatter, shared_batch_size, unshared
from replicator.pipeline.outcome import replicas_failed
from replicator.pipeline.recompute import resolve_recompute, run_forward, should_recompute
from replicator.pipeline.schedule import Action, Op, Schedule, check_schedule, forward_only, make_schedule
from replicator.pipeline.step import PipelineError, StepState, checked_normalizer
from replicator.pipeline.timeline import Event, Timeline

__all__ = ["PipelineStage", "PipelineError"]

LossFn = Callable[[Any, Any], torch.Tensor]


class PipelineStage:
    """One stage of a K-stage pipeline that splits each mini-batch into `chunks` micro-batches.

    Every stage calls `train_step` (or `eval_step`) with the same arguments; the first stage
    uses the inputs, the last the targets and the loss function. The stage walks its list
    of actions from the schedule: forwards and backwards of micro-batches, and the sends
    and receives that link it to its neighbours (p2p.Link). Sends are started without
    waiting and completed at the end of the step; receives wait.

    Failures never leave a neighbour waiting: a stage whose forward, backward, loss or
    input fails keeps walking its schedule without computing, each send becoming an
    *abort* message that carries the error, and every stage then raises PipelineError
    naming the stage that failed and why (see failures.py). No message is left unmatched,
    so the pipeline can run the next step (zero the gradients first: a failed step may
    have accumulated some). See docs/design.md, 'Pipeline failures'.

    Args:
        module: this stage's layers (called as `module(x)`, where x is a tensor or a
            tuple/list/dict of tensors exactly as the previous stage returned it).
        stage_id: this stage's index, 0 ... num_stages - 1.
        num_stages: K.
        stage_ranks: the global ranks of the K stages of this replica (ProcessGroups.stage_ranks).
        group: a process group holding those ranks (ProcessGroups.stage); None when K == 1.
        chunks: M, the number of micro-batches per mini-batch.
        schedule: "gpipe", "1f1b" or a Schedule for (K, M).
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
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.chunks = chunks
        self.recompute = resolve_recompute(recompute, checkpoint)
        self.schedule = _training_schedule(schedule, num_stages, chunks)
        self._forward_schedule = forward_only(num_stages, chunks)
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
        backwards = [a.microbatch for a in self.schedule.stages[stage_id] if a.op is Op.BACKWARD]
        self._last_backward = backwards[-1]
        self._train_delivered = delivered_counts(self.schedule, stage_id)
        self._eval_delivered = delivered_counts(self._forward_schedule, stage_id)
        gradient_sends = [a for a in self.schedule.stages[stage_id] if a.op is Op.SEND_GRADIENT]
        self._last_gradient_send = gradient_sends[-1] if gradient_sends else None
        self.links = StageLinks.connect(stage_id, num_stages, self.stage_ranks, group, self.device)

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
        return self.links.message_count

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This stage's parameters (give them to this stage's optimizer); an empty placeholder if it has none."""
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

        Around the step, the hooks: the gradient averaging is held for the whole step; then
        every process of the job learns how every step went. After a success everywhere the
        held averaging is released; after a failure anywhere every replica drops it and
        raises the same PipelineError, so the replicas stay identical.
        """
        hooks = self.hooks
        failure: PipelineError | None = None
        with hooks.hold_gradients() if hooks.hold_gradients is not None else contextlib.nullcontext():
            try:
                loss = self._run_training_step(inputs, targets, loss_fn, reduction, normalizer)
            except PipelineError as error:
                failure = error
        if hooks.agree_on_outcome is not None:
            outcomes = hooks.agree_on_outcome(None if failure is None else failure.reason)
            if outcomes:
                if hooks.abandon_gradients is not None:
                    hooks.abandon_gradients()
                raise replicas_failed(failure, list(outcomes)) from failure
        if failure is not None:
            raise failure
        if hooks.release_gradients is not None:
            hooks.release_gradients()
        return loss

    def _run_training_step(self, inputs: Any, targets: Any, loss_fn: LossFn | None, reduction: str,
                           normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
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
            for action, delivered in zip(self.schedule.stages[self.stage_id], self._train_delivered):
                with self.timeline.record(action.op.value, action.microbatch):
                    self._act(action, step, targets, loss_fn, reduction, delivered)
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
            for action, delivered in zip(self._forward_schedule.stages[self.stage_id], self._eval_delivered):
                with self.timeline.record(action.op.value, action.microbatch):
                    self._act(action, step, None, None, "mean", delivered)
            if self.is_last and step.ok:
                try:
                    result = gather([step.outputs.pop(i) for i in range(self.chunks)])
                except Exception as error:
                    step.fail(error, self._where())
        end_evaluation_step(step, self.links, self.module, self._where(), stage_id=self.stage_id,
                            num_stages=self.num_stages, stage_ranks=self.stage_ranks, group=self.group,
                            device=self.device)
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

    def _act(self, action: Action, step: StepState, targets: Any, loss_fn: LossFn | None, reduction: str,
             delivered: int) -> None:
        op, i = action.op, action.microbatch
        links = self.links
        if op is Op.FORWARD or op is Op.BACKWARD:
            if step.ok:
                try:
                    if op is Op.FORWARD:
                        self._forward(i, step, loss_fn, reduction)
                    else:
                        self._backward(i, step)
                except Exception as error:
                    step.fail(error, self._where())
        elif op is Op.SEND_ACTIVATION:
            assert links.to_next is not None
            self._send(links.to_next, ("activation", step.training, i), i, step, step.outputs.pop(i, None),
                       keep=step.training)
        elif op is Op.SEND_GRADIENT:
            loss = None
            if action == self._last_gradient_send:  # every micro-batch's loss is in by now: pass it on
                loss = self._known_loss(step)
            assert links.to_previous is not None
            self._send(links.to_previous, ("gradient", i), i, step, step.grads_out.pop(i, None), keep=False, loss=loss)
        elif op is Op.RECV_ACTIVATION:
            assert links.from_previous is not None
            message = links.from_previous.recv(("activation", step.training, i))
            settle_delivered(links.to_previous, step.sent_before, delivered)
            if message.is_abort:
                step.fail(message.error or "", self._where())
            elif step.ok:
                try:
                    self._accept_input(i, message, step, targets)
                except Exception as error:
                    step.fail(error, self._where())
        else:  # RECV_GRADIENT
            assert links.from_next is not None
            message = links.from_next.recv(("gradient", i))
            settle_delivered(links.to_next, step.sent_before, delivered)
            if message.is_abort:
                step.fail(message.error or "", self._where())
            else:
                if message.loss is not None:
                    step.loss_relayed = message.loss
                if step.ok:
                    step.grads_in[i] = message.value

    def _send(self, link: p2p.Link, key: Hashable, i: int, step: StepState, value: Any, keep: bool,
              loss: float | None = None) -> None:
        if step.ok:
            if keep:
                step.outputs[i] = value  # the graph stays for backward; only the packed bytes travel
            link.send(key, value, microbatch=i, microbatch_size=step.sizes.get(i, 0), batch_size=step.batch_size,
                      allow_none=True, loss=loss)
        else:
            link.send_abort(key, step.failure or "", microbatch=i)

    def _known_loss(self, step: StepState) -> float | None:
        if not step.ok:
            return None
        if self.is_last:
            return None if step.loss_total is None else float(step.loss_total)
        return step.loss_relayed

    def _accept_input(self, i: int, message: p2p.Message, step: StepState, targets: Any) -> None:
        if message.microbatch != i:
            raise RuntimeError(f"expected micro-batch {i} from the previous stage but received {message.microbatch}: "
                               "the stages run different schedules or chunks")
        step.inputs[i] = message.value
        step.sizes[i] = message.microbatch_size
        if step.batch_size == 0:
            step.batch_size = message.batch_size
            if self.is_last and step.training:
                self._split_targets(step, targets)

    def _forward(self, i: int, step: StepState, loss_fn: LossFn | None, reduction: str) -> None:
        x = step.inputs[i] if step.training else step.inputs.pop(i)
        recompute = step.training and should_recompute(self.recompute, i, self.chunks)
        output = run_forward(self.module, x, recompute)
        if not self.is_last:
            p2p.encode_structure(output, path=f"the output of stage {self.stage_id} (micro-batch {i})")
            step.outputs[i] = output
        elif not step.training:
            step.outputs[i] = output
        else:
            assert loss_fn is not None and step.targets is not None
            loss = loss_fn(output, step.targets[i])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
                if isinstance(loss, torch.Tensor):
                    shown = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
                else:
                    shown = f"a {type(loss).__name__}"
                raise ValueError(
                    f"loss_fn must return a scalar floating-point tensor (reduce it, e.g. with .mean()), but for "
                    f"micro-batch {i} it returned {shown}"
                )
            weight = step.loss_weight(i, reduction)
            step.losses[i] = loss.reshape(()) * weight
            contribution = loss.detach().reshape(()).to(torch.float64) * weight
            step.loss_total = contribution if step.loss_total is None else step.loss_total + contribution

    def _backward(self, i: int, step: StepState) -> None:
        no_sync = self.hooks.no_sync
        quiet = no_sync is not None and i != self._last_backward
        with no_sync() if no_sync is not None and quiet else contextlib.nullcontext():
            if self.is_last:
                step.losses.pop(i).backward()
            else:
                output = step.outputs.pop(i)
                grads = step.grads_in.pop(i)
                # The tensors in the order the wire carried them, which is the order of the gradients back.
                _, sent = p2p.encode_structure(output)
                outputs = [t for t in sent if t.requires_grad]
                if len(grads) != len(outputs):
                    raise RuntimeError(f"received {len(grads)} gradients for {len(outputs)} outputs of micro-batch {i}")
                pairs = [(t, g) for t, g in zip(outputs, grads) if g is not None]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        x = step.inputs.pop(i)
        if not self.is_first:
            step.grads_out[i] = tuple(t.grad for t in tensors(x) if t.requires_grad)

    def _step_loss(self, step: StepState) -> torch.Tensor:
        """The mini-batch loss of a successful training step: summed here on the last stage, relayed elsewhere."""
        if self.is_last:
            assert step.loss_total is not None
            return step.loss_total
        assert step.loss_relayed is not None, "the next stage's last gradient message carried no loss"
        return torch.tensor(step.loss_relayed, dtype=torch.float64, device=self.device)


def _training_schedule(schedule: str | Schedule, num_stages: int, chunks: int) -> Schedule:
    """`schedule` by name, or checked to fit (num_stages, chunks) and to train."""
    if not isinstance(schedule, Schedule):
        return make_schedule(schedule, num_stages, chunks)
    if (schedule.num_stages, schedule.num_microbatches) != (num_stages, chunks):
        raise ValueError(
            f"the schedule is for {schedule.num_stages} stages x {schedule.num_microbatches} micro-batches, "
            f"but this pipeline has {num_stages} stages x {chunks} chunks"
        )
    if not schedule.training:
        raise ValueError("a training schedule needs backward actions; this one only runs forwards")
    check_schedule(schedule)
    return schedule
