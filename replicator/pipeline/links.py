"""A stage's point-to-point links to its neighbours, and which of its sends the schedule proves delivered."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replicator.comm import p2p
from replicator.pipeline.schedule import Op, Schedule

__all__ = ["StageLinks", "delivered_counts"]


@dataclass
class StageLinks:
    """One link per neighbour and direction (None at the pipeline's ends, or with one stage).

    Activations and status messages share the downstream link, which keeps them in the
    order both ends expect.
    """

    to_next: p2p.Link | None = None
    from_next: p2p.Link | None = None
    to_previous: p2p.Link | None = None
    from_previous: p2p.Link | None = None

    @classmethod
    def connect(cls, stage_id: int, num_stages: int, stage_ranks: Sequence[int], group: dist.ProcessGroup | None,
                device: torch.device) -> StageLinks:
        """The links of stage `stage_id` of a pipeline whose stages are the global ranks `stage_ranks`."""
        links = cls()
        if num_stages == 1:
            return links
        assert group is not None
        if stage_id < num_stages - 1:
            links.to_next = p2p.Link(stage_ranks[stage_id + 1], group, device)
            links.from_next = p2p.Link(stage_ranks[stage_id + 1], group, device)
        if stage_id > 0:
            links.to_previous = p2p.Link(stage_ranks[stage_id - 1], group, device)
            links.from_previous = p2p.Link(stage_ranks[stage_id - 1], group, device)
        return links

    @property
    def outgoing(self) -> list[p2p.Link]:
        return [link for link in (self.to_next, self.to_previous) if link is not None]

    @property
    def message_count(self) -> int:
        """Point-to-point messages posted on these links so far, sends and receives."""
        links = (self.to_next, self.from_next, self.to_previous, self.from_previous)
        return sum(link.messages for link in links if link is not None)

    def sent_so_far(self) -> dict[int, int]:
        """Transfers sent to each neighbour (by global rank) until now."""
        return {link.peer: link.sent for link in self.outgoing}

    def settle_sends(self) -> None:
        """Wait for every send still in flight."""
        for link in self.outgoing:
            link.settle_all()


def settle_delivered(link: p2p.Link | None, sent_before: dict[int, int], delivered: int) -> None:
    """Let go of the packed copies of the sends to `link`'s peer that it has surely received.

    `delivered` counts this step's sends the peer had received before sending the message
    that just arrived (from the schedule, see delivered_counts), `sent_before` the sends of
    earlier steps: without this, the first stage would hold a copy of every activation it
    sent through its backwards, where its memory peaks.
    """
    if link is not None and delivered:
        link.settle(sent_before[link.peer] + delivered)


def delivered_counts(schedule: Schedule, stage: int) -> list[int]:
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
