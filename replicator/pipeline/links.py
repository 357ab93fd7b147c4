"""A stage's point-to-point links to its neighbours, and which of its sends the schedule proves delivered."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from replicator.comm import p2p
from replicator.pipeline.schedule import Schedule, endpoint

__all__ = ["StageLinks", "delivered_counts"]


@dataclass
class StageLinks:
    """One link per neighbouring stage and direction (none with one stage).

    `to_stage[s]` sends to stage s and `from_stage[s]` receives from it. Activations and
    status messages share the downstream link, which keeps them in the order both ends
    expect. With virtual stages the neighbours form a ring: the last stage also passes
    activations on to the first (and the first gradients back to the last).
    """

    to_stage: dict[int, p2p.Link] = field(default_factory=dict)
    from_stage: dict[int, p2p.Link] = field(default_factory=dict)
    to_next: p2p.Link | None = None  # the status message at a step's end runs down the stages, never round
    from_previous: p2p.Link | None = None

    @classmethod
    def connect(cls, stage_id: int, num_stages: int, stage_ranks: Sequence[int], group: dist.ProcessGroup | None,
                device: torch.device, ring: bool = False) -> StageLinks:
        """The links of stage `stage_id` of a pipeline whose stages are the global ranks `stage_ranks`."""
        links = cls()
        if num_stages == 1:
            return links
        assert group is not None
        peers = {stage_id + 1, stage_id - 1} if not ring else {(stage_id + 1) % num_stages, (stage_id - 1) % num_stages}
        for peer in sorted(p for p in peers if 0 <= p < num_stages):
            links.to_stage[peer] = p2p.Link(stage_ranks[peer], group, device)
            links.from_stage[peer] = p2p.Link(stage_ranks[peer], group, device)
        links.to_next = links.to_stage.get(stage_id + 1)
        links.from_previous = links.from_stage.get(stage_id - 1)
        return links

    @property
    def outgoing(self) -> list[p2p.Link]:
        return list(self.to_stage.values())

    @property
    def message_count(self) -> int:
        """Point-to-point messages posted on these links so far, sends and receives."""
        return sum(link.messages for link in [*self.to_stage.values(), *self.from_stage.values()])

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
    """For each action of `stage`: if it receives, how many of the step's sends to that peer it proves delivered.

    The peer sent the message after receiving that many of ours (the schedule says how
    many), so those sends have completed. Each pair of stages has one ordered stream per
    direction, whatever it carries (activations and gradients, with virtual stages).
    Other actions get 0.
    """
    def talks_to(s: int) -> list[tuple[int, int, bool]]:  # (position, peer, is a receive) of each message
        return [(n, endpoint(schedule, s, a)[0], a.op.is_recv) for n, a in enumerate(schedule.stages[s])
                if a.op.is_send or a.op.is_recv]

    mine = talks_to(stage)
    counts = [0] * len(schedule.stages[stage])
    for peer in sorted({p for _, p, _ in mine}):
        proven = []  # per message the peer sends us: our messages it had received by then
        received = 0
        for _, there, is_recv in talks_to(peer):
            if there != stage:
                continue
            if is_recv:
                received += 1
            else:
                proven.append(received)
        positions = [n for n, p, is_recv in mine if p == peer and is_recv]
        for position, count in zip(positions, proven, strict=True):
            counts[position] = count
    return counts
