"""The order a stage runs its schedule in on Gloo: each send as soon as it is computed, receives posted ahead.

Internal to the pipeline. A schedule lists its sends and receives in an order that
completes even when every send blocks until its receive is posted (NCCL runs a pair's
operations in order on one stream), which can leave a send behind a receive, or behind
the next pass, while its neighbour waits for it. Gloo's sends never block, so on Gloo a
stage walks its schedule in another order: each send right after the pass that computes
its value (keeping the order of the sends to each neighbour), and within each *exchange*
(a run of sends and receives between two passes) the sends before the receives. It posts
the receives of the next exchange before computing, so that their messages arrive during
the computation. The passes keep their order and every receive waits for the same
message, only the sends start earlier: this completes wherever the schedule completes
with buffered sends (`simulate(walked(schedule), rendezvous=False)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from replicator.pipeline.actions import Action, Op, Schedule
from replicator.pipeline.links import delivered_counts
from replicator.pipeline.simulator import endpoint

__all__ = ["Move", "walk", "walked"]


@dataclass(frozen=True)
class Move:
    """One action of a stage's walk: its position in the schedule, the receives to post before it, the sends proven."""

    index: int
    action: Action
    delivered: int  # this step's sends to the peer that the receive proves received (links.delivered_counts)
    post: tuple[Action, ...] = ()  # receives to post before running the action, in the order they are received


def walk(schedule: Schedule, stage: int, posts_ahead: bool) -> list[Move]:
    """Stage `stage`'s actions in the order it runs them, with the receives to post ahead of each.

    Without `posts_ahead` (NCCL): the schedule's order, each receive posted when it is run.
    """
    actions = schedule.stages[stage]
    if not posts_ahead:
        proven = delivered_counts(schedule, stage)
        return [Move(n, action, count) for n, (action, count) in enumerate(zip(actions, proven, strict=True))]
    order = _order(schedule, stage)
    # What a receive proves delivered follows the order both ends run, not the schedule's.
    delivered = delivered_counts(walked(schedule), stage)
    exchanges: list[list[int]] = []  # walk positions of each exchange's actions
    for w, n in enumerate(order):
        if actions[n].op.is_compute:
            continue
        if not exchanges or exchanges[-1][-1] != w - 1:
            exchanges.append([])
        exchanges[-1].append(w)
    receives = [[w for w in exchange if actions[order[w]].op.is_recv] for exchange in exchanges]
    posts: dict[int, tuple[Action, ...]] = {}
    posted = 0  # exchanges whose receives are posted

    def post_through(w: int, count: int) -> None:
        nonlocal posted
        count = min(count, len(exchanges))
        if count > posted:
            posts[w] = tuple(actions[order[r]] for e in range(posted, count) for r in receives[e])
            posted = count

    first_of = {exchange[0]: e for e, exchange in enumerate(exchanges)}
    upcoming = 0  # the next exchange at or after the current position
    for w in range(len(order)):
        if w in first_of:
            upcoming = first_of[w]
            post_through(w, upcoming + 2)  # this exchange's receives, and the next one's during the coming passes
            upcoming += 1
        elif actions[order[w]].op.is_compute:
            post_through(w, upcoming + 1)
    return [Move(n, actions[n], delivered[w], posts.get(w, ())) for w, n in enumerate(order)]


def walked(schedule: Schedule) -> Schedule:
    """The schedule in the order Gloo's stages run it, to simulate or time it.

    It completes with buffered sends (`simulate(walked(s), rendezvous=False)`), not
    necessarily with blocking ones: that order is for transports whose sends never block.
    """
    stages = tuple(tuple(schedule.stages[s][n] for n in _order(schedule, s)) for s in range(schedule.num_stages))
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, stages, schedule.virtual_stages)


def _order(schedule: Schedule, stage: int) -> list[int]:
    """Positions of the schedule's actions in walk order: sends right after their pass, first in each exchange."""
    actions = schedule.stages[stage]
    made_at: dict[tuple[Op, int, int], int] = {}  # (send it feeds, chunk, micro-batch) -> position of the pass
    after: dict[int, list[int]] = {}  # position -> the sends to run right after it
    last_to_peer: dict[int, int] = {}  # peer -> where its latest send was placed, to keep their order
    for n, action in enumerate(actions):
        if action.op is Op.FORWARD:
            made_at[(Op.SEND_ACTIVATION, action.chunk, action.microbatch)] = n
        elif action.op.makes_input_gradient:
            made_at[(Op.SEND_GRADIENT, action.chunk, action.microbatch)] = n
        elif action.op.is_send:
            peer, _ = endpoint(schedule, stage, action)
            at = max(made_at[(action.op, action.chunk, action.microbatch)], last_to_peer.get(peer, -1))
            after.setdefault(at, []).append(n)
            last_to_peer[peer] = at
    order: list[int] = []
    pending: list[int] = []  # the receives of the exchange being built
    for n, action in enumerate(actions):
        if action.op.is_recv:
            pending.append(n)
        elif action.op.is_compute:
            order += pending
            pending = []
            order.append(n)
        order += after.get(n, [])  # a pass's sends, then the sends kept behind them
    return order + pending
