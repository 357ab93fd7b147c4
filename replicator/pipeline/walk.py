"""The order a stage runs its schedule in: within each exchange sends first, and receives posted one exchange ahead.

Internal to the pipeline. An *exchange* is a run of sends and receives between two
compute passes of a stage. The schedule lists them in an order that completes even when
every send blocks until its receive is posted (NCCL runs a pair's operations in order on
one stream). Gloo's sends never block, so on Gloo a stage posts an exchange's receives,
then starts its sends, then waits for the receives: a neighbour waiting for our message
no longer also waits for the one we receive first. And it posts the receives of the next
exchange before computing, so that their messages arrive during the computation. This
completes wherever the schedule completes with buffered sends (`simulate(...,
rendezvous=False)`, which `check_schedule` runs), since it only starts sends and posts
receives earlier than the schedule's order and waits for the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replicator.pipeline.actions import Action, Schedule

__all__ = ["Move", "walk", "walked"]


@dataclass(frozen=True)
class Move:
    """One action of a stage's walk: its position in the schedule, the receives to post before it, the sends proven."""

    index: int
    action: Action
    delivered: int  # this step's sends to the peer that the receive proves posted for (links.delivered_counts)
    post: tuple[Action, ...] = ()  # receives to post before running the action, in the order they are received


def walk(actions: Sequence[Action], delivered: Sequence[int], posts_ahead: bool) -> list[Move]:
    """A stage's actions in the order it runs them, with the receives to post ahead of each.

    Without `posts_ahead`: the schedule's order, each receive posted when it is run.
    """
    if not posts_ahead:
        return [Move(n, action, count) for n, (action, count) in enumerate(zip(actions, delivered, strict=True))]
    exchanges: list[list[int]] = []  # positions of each exchange's actions, in the schedule's order
    for n, action in enumerate(actions):
        if action.op.is_compute:
            continue
        if not exchanges or exchanges[-1][-1] != n - 1:
            exchanges.append([])
        exchanges[-1].append(n)
    receives = [[n for n in exchange if actions[n].op.is_recv] for exchange in exchanges]
    moves: list[Move] = []
    posted = 0  # exchanges whose receives are posted
    position = 0  # the next action of the schedule not yet placed

    def post_through(count: int) -> tuple[Action, ...]:
        nonlocal posted
        ahead = tuple(actions[n] for e in range(posted, min(count, len(exchanges))) for n in receives[e])
        posted = max(posted, min(count, len(exchanges)))
        return ahead

    for e, exchange in enumerate(exchanges):
        # The compute passes before this exchange: the first posts its receives, so that
        # they arrive while it computes.
        for n in range(position, exchange[0]):
            moves.append(Move(n, actions[n], delivered[n], post_through(e + 1)))
        ordered = [n for n in exchange if actions[n].op.is_send] + receives[e]
        for k, n in enumerate(ordered):
            moves.append(Move(n, actions[n], delivered[n], post_through(e + 2) if k == 0 else ()))
        position = exchange[-1] + 1
    moves += [Move(n, actions[n], delivered[n]) for n in range(position, len(actions))]
    return moves


def walked(schedule: Schedule) -> Schedule:
    """The schedule in the order Gloo's stages run it (sends first in each exchange), to simulate or time it.

    It completes with buffered sends (`simulate(walked(s), rendezvous=False)`), not
    necessarily with blocking ones: that order is for transports whose sends never block.
    """
    stages = tuple(tuple(move.action for move in walk(actions, [0] * len(actions), posts_ahead=True))
                   for actions in schedule.stages)
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, stages, schedule.virtual_stages)
