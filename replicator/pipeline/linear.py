"""Schedules with one model chunk per stage: GPipe, 1F1B and forward-only, built from per-stage compute orders.

A schedule is built in two steps. First each stage gets a *compute order*, the order of
its forward and backward passes over the micro-batches: GPipe runs every forward and then
every backward (last micro-batch first), 1F1B runs a few forwards to fill the pipeline and
then alternates one forward with one backward, so a stage never holds the activations of
more than K micro-batches. Then the send and receive actions are woven in, from the last
stage to the first, so that each stage sends to and receives from its downstream
neighbour in exactly the order the neighbour receives and sends. With that rule the
schedules here complete even if every send blocks until its receive is posted
(rendezvous), which `simulator.simulate` checks by matching sends to receives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from replicator.pipeline.actions import Action, B, F, Op, Schedule, ScheduleError, check_sizes

__all__ = ["gpipe", "one_f_one_b", "forward_only", "from_compute_orders"]


def _gpipe_order(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    # Backward runs last micro-batch first: its activations are the freshest, which is
    # why recompute="except_last" can skip re-materialising it.
    return [F(i) for i in range(num_microbatches)] + [B(i) for i in reversed(range(num_microbatches))]


def _one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [F(i) for i in range(warmup)]
    for i in range(warmup, num_microbatches):
        order += [F(i), B(i - warmup)]
    order += [B(i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order


def _forward_order(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    return [F(i) for i in range(num_microbatches)]


def from_compute_orders(name: str, compute_orders: Sequence[Sequence[Action]], num_microbatches: int) -> Schedule:
    """Weave sends and receives into per-stage compute orders.

    A stage receives its input just before the forward that needs it and sends its input
    gradient just after the backward that makes it; with its downstream neighbour it
    follows the neighbour's order, sending an activation as soon as it exists and
    receiving a gradient no earlier than its backward needs it. Raises ScheduleError when
    neighbouring orders cannot be reconciled (a stage would have to send an activation
    it has not computed yet).
    """
    num_stages = len(compute_orders)
    check_sizes(num_stages, num_microbatches)
    for stage, order in enumerate(compute_orders):
        _check_compute_order(stage, list(order), num_microbatches, name)
    stages: list[list[Action]] = [[] for _ in range(num_stages)]
    for stage in reversed(range(num_stages)):
        first, last = stage == 0, stage == num_stages - 1
        # What the downstream stage expects from us, in its order: a receive of its
        # activation is our send, a send of its input gradient is our receive.
        channel: deque[Action] = deque()
        if not last:
            for action in stages[stage + 1]:
                if action.op is Op.RECV_ACTIVATION:
                    channel.append(Action(Op.SEND_ACTIVATION, action.microbatch))
                elif action.op is Op.SEND_GRADIENT:
                    channel.append(Action(Op.RECV_GRADIENT, action.microbatch))
        done_forward: set[int] = set()
        received: set[int] = set()
        actions = stages[stage]
        for action in compute_orders[stage]:
            i = action.microbatch
            if action.op is Op.FORWARD:
                if not first:
                    actions.append(Action(Op.RECV_ACTIVATION, i))
                actions.append(action)
                done_forward.add(i)
                _send_ready(channel, done_forward, actions)
                continue
            while not last and i not in received:
                if not channel:
                    raise ScheduleError(f"{name}: stage {stage + 1} never sends the gradient of micro-batch {i}")
                head = channel[0]
                if head.op is Op.SEND_ACTIVATION:
                    raise ScheduleError(
                        f"{name}: stage {stage} needs the gradient of micro-batch {i} from stage {stage + 1} "
                        f"before it can compute activation {head.microbatch}, which stage {stage + 1} needs first"
                    )
                actions.append(channel.popleft())
                received.add(head.microbatch)
            _send_ready(channel, done_forward, actions)
            actions.append(action)
            if not first:
                actions.append(Action(Op.SEND_GRADIENT, i))
        _send_ready(channel, done_forward, actions)
        if channel:
            raise ScheduleError(f"{name}: stage {stage} never performs {list(channel)} expected by stage {stage + 1}")
    return Schedule(name, num_stages, num_microbatches, tuple(tuple(s) for s in stages))


def _send_ready(channel: deque[Action], done_forward: set[int], actions: list[Action]) -> None:
    """Move the activation sends at the head of `channel` whose forwards are done into `actions`."""
    while channel and channel[0].op is Op.SEND_ACTIVATION and channel[0].microbatch in done_forward:
        actions.append(channel.popleft())


def _check_compute_order(stage: int, order: list[Action], num_microbatches: int, name: str) -> None:
    forwards = [a.microbatch for a in order if a.op is Op.FORWARD]
    backwards = [a.microbatch for a in order if a.op is Op.BACKWARD]
    if any(a.op not in (Op.FORWARD, Op.BACKWARD) or a.chunk for a in order):
        raise ScheduleError(f"{name}: a compute order holds only forward and backward actions of chunk 0 "
                            f"(stage {stage}); split backwards and chunks are built by replicator.pipeline.interleaved")
    if sorted(forwards) != list(range(num_microbatches)):
        raise ScheduleError(
            f"{name}: stage {stage} must forward each of {num_microbatches} micro-batches once, got {forwards}"
        )
    if backwards and sorted(backwards) != list(range(num_microbatches)):
        raise ScheduleError(
            f"{name}: stage {stage} must backward each of {num_microbatches} micro-batches once, got {backwards}"
        )
    seen: set[int] = set()
    for action in order:
        if action.op is Op.FORWARD:
            seen.add(action.microbatch)
        elif action.microbatch not in seen:
            raise ScheduleError(
                f"{name}: stage {stage} runs the backward of micro-batch {action.microbatch} before its forward"
            )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward; each stage holds all M micro-batches' activations."""
    check_sizes(num_stages, num_microbatches)
    orders = [_gpipe_order(s, num_stages, num_microbatches) for s in range(num_stages)]
    return from_compute_orders("gpipe", orders, num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: GPipe's bubble, but stage s holds at most K - s micro-batches' activations at once."""
    check_sizes(num_stages, num_microbatches)
    orders = [_one_f_one_b_order(s, num_stages, num_microbatches) for s in range(num_stages)]
    return from_compute_orders("1f1b", orders, num_microbatches)


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Evaluation: forwards only, micro-batches in order."""
    check_sizes(num_stages, num_microbatches)
    orders = [_forward_order(s, num_stages, num_microbatches) for s in range(num_stages)]
    return from_compute_orders("forward", orders, num_microbatches)
