"""Checking and timing a schedule without running a model: message passing, deadlock, bubble and memory.

Messages between two stages travel in one ordered stream per direction (torch.distributed's
point-to-point operations between a pair of ranks, whatever they carry), so a receive must
meet exactly the message its stage expects next from that peer. With virtual stages a
stage's neighbours form a ring: the last stage sends its activations on to the first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from replicator.pipeline.actions import Action, DeadlockError, Op, Schedule, ScheduleError
from replicator.pipeline.bubble import idle_share

__all__ = [
    "endpoint",
    "simulate",
    "check_schedule",
    "TimedAction",
    "timed_simulation",
    "simulated_bubble",
    "max_in_flight",
]

_PARTNER = {
    Op.SEND_ACTIVATION: (1, Op.RECV_ACTIVATION),
    Op.RECV_ACTIVATION: (-1, Op.SEND_ACTIVATION),
    Op.SEND_GRADIENT: (-1, Op.RECV_GRADIENT),
    Op.RECV_GRADIENT: (1, Op.SEND_GRADIENT),
}


def endpoint(schedule: Schedule, stage: int, action: Action) -> tuple[int, Action]:
    """The stage a send or receive talks to, and the action there that matches it.

    Activations flow to the next piece of the model and gradients to the previous one.
    Raises ScheduleError when there is no such piece (a send past the last piece, say).
    """
    step, op = _PARTNER[action.op]
    target = schedule.piece(stage, action.chunk) + step
    if not 0 <= target < schedule.num_pieces:
        peer = stage + step
        raise ScheduleError(f"{schedule.name}: stage {stage} runs {action}, but it has no stage {peer} to talk to")
    peer, chunk = schedule.place(target)
    return peer, Action(op, action.microbatch, chunk)


def simulate(schedule: Schedule, rendezvous: bool = True) -> list[tuple[int, Action]]:
    """Run the schedule's message passing; return the order actions completed in.

    rendezvous=True: a send completes only together with its matching receive (the
    strictest transport: NCCL runs a pair's operations in order on one stream, so a send
    there holds up what follows it until received). rendezvous=False: sends are buffered
    and never wait, as Gloo's: a stage never waits for a send it has not seen received,
    so it may start an exchange's sends before waiting for its receives (walk.py, and
    `walk.walked(schedule)` to simulate that order). Messages
    from one stage to another match in order, so a receive meeting a different message
    than it expects is a ScheduleError; a state where no stage can move is a DeadlockError.
    """
    K = schedule.num_stages
    position = [0] * K
    mailbox: dict[tuple[int, int], deque[Action]] = {}
    completed: list[tuple[int, Action]] = []

    def head(stage: int) -> Action | None:
        actions = schedule.stages[stage]
        return actions[position[stage]] if position[stage] < len(actions) else None

    progress = True
    while progress:
        progress = False
        for stage in range(K):
            while (action := head(stage)) is not None:
                if action.op.is_send:
                    peer, expected = endpoint(schedule, stage, action)
                    if rendezvous:
                        other = head(peer)
                        if other is None or not other.op.is_recv or endpoint(schedule, peer, other)[0] != stage:
                            break
                        if other != expected:
                            raise ScheduleError(
                                f"{schedule.name}: stage {stage} sends {action} while stage {peer} expects {other}"
                            )
                        position[peer] += 1
                        completed.append((stage, action))
                        completed.append((peer, other))
                        position[stage] += 1
                        progress = True
                        continue
                    mailbox.setdefault((stage, peer), deque()).append(expected)
                elif action.op.is_recv:
                    peer, _ = endpoint(schedule, stage, action)
                    if rendezvous:
                        break  # completed by the sender
                    queue = mailbox.get((peer, stage))
                    if not queue:
                        break
                    sent = queue.popleft()
                    if sent != action:
                        raise ScheduleError(
                            f"{schedule.name}: stage {stage} expects {action} but stage {peer} sent {sent}"
                        )
                completed.append((stage, action))
                position[stage] += 1
                progress = True
    stuck = {s: head(s) for s in range(K) if head(s) is not None}
    if stuck:
        waiting = ", ".join(f"stage {s} at {a} (action {position[s]})" for s, a in stuck.items())
        raise DeadlockError(
            f"{schedule.name} ({K} stages, {schedule.num_microbatches} micro-batches) deadlocks: {waiting}"
        )
    leftovers = {key: list(q) for key, q in mailbox.items() if q}
    if leftovers:
        raise ScheduleError(f"{schedule.name}: messages sent but never received: {leftovers}")
    return completed


def check_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError unless every stage runs each pass once, in dependency order, without deadlock.

    Per piece of the model (a stage's chunk): each micro-batch is forwarded once (after its
    activation arrives, except on the first piece) and, in a training schedule, backwarded
    once (after its forward and after its gradient arrives, except on the last piece),
    either whole or split into an input-gradient pass and a later weight-gradient pass;
    activations are sent after their forward and gradients after their input gradient.
    Across stages: `simulate` under both transports.
    """
    K, M, V = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    if len(schedule.stages) != K:
        raise ScheduleError(f"{schedule.name}: {len(schedule.stages)} stage lists for {K} stages")
    training = schedule.training
    for stage, actions in enumerate(schedule.stages):
        split = {a.chunk for a in actions if a.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)}
        done: dict[tuple[Op, int], set[int]] = {(op, c): set() for op in Op for c in range(V)}
        for action in actions:
            c, i = action.chunk, action.microbatch
            if not 0 <= c < V:
                raise ScheduleError(f"{schedule.name}: stage {stage} runs {action} but it holds {V} chunk(s)")
            expected = _expected_ops(schedule.piece(stage, c), schedule.num_pieces, training, c in split)
            if action.op not in expected:
                raise ScheduleError(f"{schedule.name}: stage {stage} should not run {action.op.value}"
                                    + (f" on chunk {c}" if V > 1 else ""))
            if not 0 <= i < M:
                raise ScheduleError(f"{schedule.name}: stage {stage} runs {action} but there are {M} micro-batches")
            if i in done[(action.op, c)]:
                raise ScheduleError(f"{schedule.name}: stage {stage} runs {action} twice")
            for needed in expected[action.op]:
                if i not in done[(needed, c)]:
                    raise ScheduleError(f"{schedule.name}: stage {stage} runs {action} before {Action(needed, i, c)}")
            done[(action.op, c)].add(i)
        for c in range(V):
            for op in _expected_ops(schedule.piece(stage, c), schedule.num_pieces, training, c in split):
                if done[(op, c)] != set(range(M)):
                    missing = sorted(set(range(M)) - done[(op, c)])
                    where = f" of chunk {c}" if V > 1 else ""
                    raise ScheduleError(
                        f"{schedule.name}: stage {stage} never runs {op.value}{where} of micro-batches {missing}"
                    )
    simulate(schedule, rendezvous=True)
    simulate(schedule, rendezvous=False)


def _expected_ops(piece: int, num_pieces: int, training: bool, split: bool) -> dict[Op, list[Op]]:
    """The operations a piece runs, each with the operations that must come first (same micro-batch)."""
    first, last = piece == 0, piece == num_pieces - 1
    backward = [Op.FORWARD] + ([] if last else [Op.RECV_GRADIENT])
    expected: dict[Op, list[Op]] = {Op.FORWARD: [] if first else [Op.RECV_ACTIVATION]}
    if not first:
        expected[Op.RECV_ACTIVATION] = []
    if not last:
        expected[Op.SEND_ACTIVATION] = [Op.FORWARD]
    if not training:
        return expected
    if not last:
        expected[Op.RECV_GRADIENT] = []
    if split:
        expected[Op.BACKWARD_INPUT] = backward
        expected[Op.BACKWARD_WEIGHT] = [Op.BACKWARD_INPUT]
    else:
        expected[Op.BACKWARD] = backward
    if not first:
        expected[Op.SEND_GRADIENT] = [Op.BACKWARD_INPUT if split else Op.BACKWARD]
    return expected


# -- timing and memory -------------------------------------------------------------------


@dataclass(frozen=True)
class TimedAction:
    """An action placed in time by `timed_simulation`."""

    stage: int
    action: Action
    start: float
    end: float


def timed_simulation(
    schedule: Schedule,
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 2.0,
    message_time: float = 0.0,
    *,
    input_time: float | Sequence[float] | None = None,
    weight_time: float | Sequence[float] | None = None,
) -> list[TimedAction]:
    """Place every action in time, given per-stage compute costs and a per-message latency.

    The costs are those of one micro-batch through all of a stage's layers; a stage with V
    chunks spends 1/V of them on each chunk. A split backward costs `input_time` and
    `weight_time` (default: half of `backward_time` each). Sends never wait (buffered); a
    receive ends when both its stage is free and the message has arrived. Useful to draw a
    schedule and to compute its bubble without running it.
    """
    K, V = schedule.num_stages, schedule.virtual_stages

    def per_stage(value: float | Sequence[float]) -> list[float]:
        return [float(value) / V] * K if isinstance(value, (int, float)) else [float(v) / V for v in value]

    backward = per_stage(backward_time)
    cost = {
        Op.FORWARD: per_stage(forward_time),
        Op.BACKWARD: backward,
        Op.BACKWARD_INPUT: [b / 2 for b in backward] if input_time is None else per_stage(input_time),
        Op.BACKWARD_WEIGHT: [b / 2 for b in backward] if weight_time is None else per_stage(weight_time),
    }
    clock = [0.0] * K
    position = [0] * K
    arrivals: dict[tuple[int, int], deque[float]] = {}
    placed: list[TimedAction] = []
    progress = True
    while progress:
        progress = False
        for stage in range(K):
            actions = schedule.stages[stage]
            while position[stage] < len(actions):
                action = actions[position[stage]]
                start = clock[stage]
                if action.op.is_compute:
                    end = start + cost[action.op][stage]
                elif action.op.is_send:
                    peer, _ = endpoint(schedule, stage, action)
                    arrivals.setdefault((stage, peer), deque()).append(start + message_time)
                    end = start
                else:
                    peer, _ = endpoint(schedule, stage, action)
                    queue = arrivals.get((peer, stage))
                    if not queue:
                        break
                    end = max(start, queue.popleft())
                placed.append(TimedAction(stage, action, start, end))
                clock[stage] = end
                position[stage] += 1
                progress = True
    if any(position[s] < len(schedule.stages[s]) for s in range(K)):
        simulate(schedule, rendezvous=False)  # raises the precise DeadlockError
    return placed


def simulated_bubble(placed: Sequence[TimedAction]) -> float:
    """Idle share of the stages' time between the first start and the last end of a simulated schedule."""
    return idle_share((p.stage, p.start, p.end, p.action.op.is_compute) for p in placed)


def max_in_flight(schedule: Schedule, stage: int) -> int:
    """The most micro-batch passes (over all chunks) whose forward has run but whose activations are not freed yet."""
    alive = peak = 0
    for action in schedule.compute_order(stage):
        if action.op is Op.FORWARD:
            alive += 1
        elif action.op.frees_activations:
            alive -= 1
        peak = max(peak, alive)
    return peak
