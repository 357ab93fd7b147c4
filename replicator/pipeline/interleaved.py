"""Schedules over virtual stages and split backwards: interleaved 1F1B and zero bubble, built by list scheduling.

Interleaved 1F1B (Narayanan et al., arXiv 2104.04473) gives each of the K stages V model
chunks, so a micro-batch visits every stage V times and the fill-and-drain bubble shrinks
to (K - 1) / (V M + K - 1). Zero bubble (Qi et al., arXiv 2401.10241, ZB-H1 for V = 1)
splits each backward into the input gradient, which the previous stage waits for, and the
weight gradient, which nobody waits for and so fills the idle slots.

Both are built the same way: a small discrete-event simulation of the K stages with unit
costs (a chunk's forward 1, its backward 2, or 1 + 1 when split), where each free stage
takes the most urgent pass it can run: a backward (or input gradient) if one is ready,
else a forward if it holds fewer than its limit of micro-batches in flight, else a
pending weight gradient. Forwards take micro-batches in groups of K, depth first over the
chunks (Megatron-LM's order). A message is exchanged the first moment both of its stages
are free, and written into both action lists at once, so every schedule here is the trace
of an execution in which each send meets its receive: it completes even when sends block
until received (`simulator.check_schedule` proves it again).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from replicator.pipeline.actions import Action, Op, Schedule, ScheduleError, check_sizes

__all__ = ["interleaved_1f1b", "zero_bubble", "forward_only_ring"]

_COST = {Op.FORWARD: 1.0, Op.BACKWARD: 2.0, Op.BACKWARD_INPUT: 1.0, Op.BACKWARD_WEIGHT: 1.0}


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B: V chunks per stage, each stage following Megatron-LM's order (see `_interleaved_order`)."""
    check_sizes(num_stages, num_microbatches, virtual_stages)
    if virtual_stages < 2:
        raise ValueError(f"interleaved 1F1B needs virtual_stages >= 2 (model chunks per stage), got {virtual_stages}; "
                         'with one chunk per stage use schedule="1f1b"')
    K, M, V = num_stages, num_microbatches, virtual_stages
    rounds = max(1, M // K)
    if M % rounds:
        raise ValueError(
            f"interleaved 1F1B takes the micro-batches in rounds of equal size, at least {K} (the stages) each; "
            f"{M} micro-batches do not split into {rounds} rounds. Use a multiple of {K}, or fewer than {2 * K}"
        )
    orders = [_interleaved_order(s, K, M, V, M // rounds) for s in range(K)]
    return _ListScheduler("interleaved", K, M, V, split=False, limits=[M * V] * K, orders=orders).run()


def _interleaved_order(stage: int, num_stages: int, num_microbatches: int, virtual_stages: int,
                       group: int) -> list[Action]:
    """Stage `stage`'s forwards and backwards: a warm-up of forwards, then one forward and one backward in turn.

    Forwards take the micro-batches in rounds of `group` (K when it divides M), each round
    through chunk 0, then chunk 1, and so on (depth first); backwards take the same rounds
    from the last chunk down. The warm-up, (V - 1) group + 2 (K - 1 - s) forwards, is what it
    takes for the first backward's gradient to come back to stage s: the stages then
    alternate in step.
    """
    K, M, V = num_stages, num_microbatches, virtual_stages
    groups = [list(range(start, start + group)) for start in range(0, M, group)]
    forwards = [Action(Op.FORWARD, i, c) for group in groups for c in range(V) for i in group]
    backwards = [Action(Op.BACKWARD, i, c) for group in groups for c in reversed(range(V)) for i in group]
    warmup = min(len(forwards), (V - 1) * group + 2 * (K - 1 - stage))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup:]


def zero_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Zero bubble: backward split into input (I) and weight (W) gradients, W filling the idle slots.

    With V = 1 this is ZB-H1: stage s holds at most K - s micro-batches in flight, as in
    1F1B, and its bubble is about a third of 1F1B's. With V >= 2 it is interleaved as well.
    """
    check_sizes(num_stages, num_microbatches, virtual_stages)
    if virtual_stages > 1 and num_stages < 2:
        raise ValueError("virtual stages need at least 2 stages: with 1 stage, use virtual_stages=1")
    K, V = num_stages, virtual_stages
    limits = [(V - 1) * K + (K - s) for s in range(K)]
    weight_limits = [K - s for s in range(K)]
    return _ListScheduler("zero_bubble", K, num_microbatches, V, split=True, limits=limits,
                          weight_limits=weight_limits).run()


def forward_only_ring(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Evaluation over V chunks per stage: forwards only, micro-batches in order."""
    check_sizes(num_stages, num_microbatches, virtual_stages)
    limits = [num_microbatches * virtual_stages] * num_stages
    return _ListScheduler("forward", num_stages, num_microbatches, virtual_stages, split=False, limits=limits,
                          training=False).run()


@dataclass
class _Stage:
    """One stage while the schedule is being built."""

    actions: list[Action] = field(default_factory=list)
    running: Action | None = None
    busy_until: float = 0.0
    forwarded: list[int] = field(default_factory=list)  # per chunk: micro-batches forwarded so far
    backwarded: list[int] = field(default_factory=list)  # per chunk: input gradients (or backwards) done
    weights: deque[Action] = field(default_factory=deque)  # weight gradients still to run
    arrived: set[tuple[Op, int, int]] = field(default_factory=set)  # (RECV_*, chunk, micro-batch) received
    outbox: deque[tuple[int, Action, Action]] = field(default_factory=deque)  # (peer, send here, receive there)
    in_flight: int = 0
    done: int = 0


class _ListScheduler:
    """The discrete-event simulation that writes a schedule (see the module docstring)."""

    def __init__(self, name: str, num_stages: int, num_microbatches: int, virtual_stages: int, *, split: bool,
                 limits: list[int], weight_limits: list[int] | None = None, training: bool = True,
                 orders: list[list[Action]] | None = None) -> None:
        self.name, self.K, self.M, self.V = name, num_stages, num_microbatches, virtual_stages
        self.split, self.training = split, training
        self.limits = [min(limit, num_microbatches * virtual_stages) for limit in limits]
        self.weight_limits = weight_limits if weight_limits is not None else [0] * num_stages
        self.orders = [deque(order) for order in orders] if orders is not None else None
        self.shape = Schedule(name, num_stages, num_microbatches, (), virtual_stages)  # for piece arithmetic
        passes = (3 if split else 2) if training else 1
        self.total = num_microbatches * virtual_stages * passes
        self.stages = [_Stage(forwarded=[0] * virtual_stages, backwarded=[0] * virtual_stages)
                       for _ in range(num_stages)]

    def run(self) -> Schedule:
        now, relaxed = 0.0, False
        while True:
            for s, stage in enumerate(self.stages):
                if stage.running is not None and stage.busy_until <= now:
                    self._finish(s, stage.running)
            self._exchange(now)
            for s, stage in enumerate(self.stages):
                if stage.running is None and (action := self._choose(s, relaxed)) is not None:
                    stage.actions.append(action)
                    stage.running, stage.busy_until = action, now + _COST[action.op]
                    self._start(s, action)
            busy = [stage.busy_until for stage in self.stages if stage.running is not None]
            if busy:
                now, relaxed = min(busy), False
            elif not relaxed and any(stage.done < self.total for stage in self.stages):
                # Every stage idles at its limit: one forward more somewhere is the way out.
                relaxed = True
            else:
                break
        unfinished = [s for s, stage in enumerate(self.stages) if stage.done < self.total or stage.outbox]
        if unfinished:
            raise ScheduleError(f"{self.name} ({self.K} stages x {self.V} chunks, {self.M} micro-batches) gets stuck "
                                f"on stages {unfinished}: their compute orders do not fit together")
        return Schedule(self.name, self.K, self.M, tuple(tuple(s.actions) for s in self.stages), self.V)

    # -- what a free stage does next -----------------------------------------------------
    def _choose(self, s: int, relaxed: bool = False) -> Action | None:
        stage = self.stages[s]
        if self.orders is not None:  # a fixed order: its next pass, once ready
            order = self.orders[s]
            if order and self._ready(s, order[0]):
                return order.popleft()
            return None
        backward = self._ready_backward(s)
        if backward is not None:
            return backward
        if len(stage.weights) > self.weight_limits[s]:
            return stage.weights.popleft()
        if (stage.in_flight < self.limits[s] or relaxed) and (forward := self._ready_forward(s)) is not None:
            return forward
        if stage.weights:
            return stage.weights.popleft()
        return None

    def _ready(self, s: int, action: Action) -> bool:
        stage, c, i = self.stages[s], action.chunk, action.microbatch
        piece = self.shape.piece(s, c)
        if action.op is Op.FORWARD:
            return i == stage.forwarded[c] and (piece == 0 or (Op.RECV_ACTIVATION, c, i) in stage.arrived)
        last = piece == self.shape.num_pieces - 1
        return i == stage.backwarded[c] < stage.forwarded[c] and (last or (Op.RECV_GRADIENT, c, i) in stage.arrived)

    def _ready_forward(self, s: int) -> Action | None:
        stage, ready = self.stages[s], []
        for c in range(self.V):
            i = stage.forwarded[c]
            if i < self.M and (self.shape.piece(s, c) == 0 or (Op.RECV_ACTIVATION, c, i) in stage.arrived):
                ready.append((i // self.K, c, i))  # groups of K micro-batches, depth first over the chunks
        return Action(Op.FORWARD, ready and min(ready)[2] or 0, min(ready)[1]) if ready else None

    def _ready_backward(self, s: int) -> Action | None:
        if not self.training:
            return None
        stage, ready = self.stages[s], []
        for c in range(self.V):
            i = stage.backwarded[c]
            last = self.shape.piece(s, c) == self.shape.num_pieces - 1
            if i < stage.forwarded[c] and (last or (Op.RECV_GRADIENT, c, i) in stage.arrived):
                ready.append((i // self.K, -c, i))  # the last chunk first: its gradient unblocks the others
        if not ready:
            return None
        _, minus_chunk, i = min(ready)
        return Action(Op.BACKWARD_INPUT if self.split else Op.BACKWARD, i, -minus_chunk)

    # -- effects ---------------------------------------------------------------------------
    def _start(self, s: int, action: Action) -> None:
        stage = self.stages[s]
        if action.op is Op.FORWARD:
            stage.forwarded[action.chunk] += 1
            stage.in_flight += 1
        elif action.op.makes_input_gradient:
            stage.backwarded[action.chunk] += 1

    def _finish(self, s: int, action: Action) -> None:
        stage = self.stages[s]
        stage.running = None
        stage.done += 1
        piece = self.shape.piece(s, action.chunk)
        if action.op is Op.FORWARD and piece < self.shape.num_pieces - 1:
            self._post(s, piece + 1, Op.SEND_ACTIVATION, Op.RECV_ACTIVATION, action.microbatch, action.chunk)
        elif action.op.makes_input_gradient and piece > 0:
            self._post(s, piece - 1, Op.SEND_GRADIENT, Op.RECV_GRADIENT, action.microbatch, action.chunk)
        if action.op is Op.BACKWARD_INPUT:
            stage.weights.append(Action(Op.BACKWARD_WEIGHT, action.microbatch, action.chunk))
        if action.op.makes_input_gradient:
            stage.in_flight -= 1

    def _post(self, s: int, target: int, send: Op, recv: Op, i: int, chunk: int) -> None:
        peer, peer_chunk = self.shape.place(target)
        if peer == s:
            raise ScheduleError(f"{self.name}: a stage cannot pass micro-batches to itself; use at least 2 stages")
        self.stages[s].outbox.append((peer, Action(send, i, chunk), Action(recv, i, peer_chunk)))

    def _exchange(self, now: float) -> None:
        """Every message whose two stages are both free now changes hands, in the order it was made."""
        free = [stage.running is None for stage in self.stages]
        for s, stage in enumerate(self.stages):
            if not free[s]:
                continue
            kept: deque[tuple[int, Action, Action]] = deque()
            blocked: set[int] = set()
            for peer, send, recv in stage.outbox:
                if free[peer] and peer not in blocked:
                    stage.actions.append(send)
                    self.stages[peer].actions.append(recv)
                    self.stages[peer].arrived.add((recv.op, recv.chunk, recv.microbatch))
                else:
                    blocked.add(peer)  # later messages to that peer wait behind this one
                    kept.append((peer, send, recv))
            stage.outbox = kept
