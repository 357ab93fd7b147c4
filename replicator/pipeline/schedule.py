"""Pipeline schedules as plain data: for each stage, the ordered actions it performs.

A schedule is built in two steps. First each stage gets a *compute order*, the order of
its forward and backward passes over the micro-batches: GPipe runs every forward and then
every backward (last micro-batch first), 1F1B runs a few forwards to fill the pipeline and
then alternates one forward with one backward, so a stage never holds the activations of
more than K micro-batches. Then the send and receive actions are woven in, from the last
stage to the first, so that each stage sends to and receives from its downstream
neighbour in exactly the order the neighbour receives and sends. With that rule the
schedules here complete even if every send blocks until its receive is posted
(rendezvous), which `simulate` checks by matching sends to receives.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replicator.pipeline.bubble import idle_share

__all__ = [
    "Op",
    "Action",
    "Schedule",
    "ScheduleError",
    "DeadlockError",
    "SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "forward_only",
    "make_schedule",
    "from_compute_orders",
    "simulate",
    "check_schedule",
    "TimedAction",
    "timed_simulation",
    "simulated_bubble",
    "max_in_flight",
]


class Op(str, enum.Enum):
    """What one action does."""

    FORWARD = "forward"
    BACKWARD = "backward"
    SEND_ACTIVATION = "send_activation"
    RECV_ACTIVATION = "recv_activation"
    SEND_GRADIENT = "send_gradient"
    RECV_GRADIENT = "recv_gradient"

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACTIVATION, Op.SEND_GRADIENT)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACTIVATION, Op.RECV_GRADIENT)


_SHORT = {
    Op.FORWARD: "F",
    Op.BACKWARD: "B",
    Op.SEND_ACTIVATION: "SA",
    Op.RECV_ACTIVATION: "RA",
    Op.SEND_GRADIENT: "SG",
    Op.RECV_GRADIENT: "RG",
}


@dataclass(frozen=True)
class Action:
    """One step of a stage: an operation on one micro-batch."""

    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{_SHORT[self.op]}{self.microbatch}"

    __repr__ = __str__


def F(i: int) -> Action:
    return Action(Op.FORWARD, i)


def B(i: int) -> Action:
    return Action(Op.BACKWARD, i)


class ScheduleError(ValueError):
    """A schedule is malformed: a pass missing or repeated, or out of dependency order."""


class DeadlockError(ScheduleError):
    """Simulating the schedule got stuck: every unfinished stage waits on a message never sent."""


@dataclass(frozen=True)
class Schedule:
    """The actions of every stage, in order. `stages[s]` is what stage s runs."""

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]

    def __getitem__(self, stage: int) -> tuple[Action, ...]:
        return self.stages[stage]

    @property
    def training(self) -> bool:
        """True when the schedule runs backward passes (a forward-only schedule is for evaluation)."""
        return any(a.op is Op.BACKWARD for a in self.stages[0])

    def compute_order(self, stage: int) -> list[Action]:
        """The forward and backward actions of one stage, without the communication."""
        return [a for a in self.stages[stage] if a.op.is_compute]

    def __str__(self) -> str:
        lines = [f"{self.name} schedule, {self.num_stages} stages x {self.num_microbatches} micro-batches"]
        lines += [f"  stage {s}: " + " ".join(map(str, actions)) for s, actions in enumerate(self.stages)]
        return "\n".join(lines)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"a pipeline needs at least 1 micro-batch (chunks >= 1), got {num_microbatches}")


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
    _check_sizes(num_stages, num_microbatches)
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
    if any(not a.op.is_compute for a in order):
        raise ScheduleError(f"{name}: a compute order holds only forward and backward actions (stage {stage})")
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
    _check_sizes(num_stages, num_microbatches)
    orders = [_gpipe_order(s, num_stages, num_microbatches) for s in range(num_stages)]
    return from_compute_orders("gpipe", orders, num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: GPipe's bubble, but stage s holds at most K - s micro-batches' activations at once."""
    _check_sizes(num_stages, num_microbatches)
    orders = [_one_f_one_b_order(s, num_stages, num_microbatches) for s in range(num_stages)]
    return from_compute_orders("1f1b", orders, num_microbatches)


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Evaluation: forwards only, micro-batches in order."""
    _check_sizes(num_stages, num_microbatches)
    orders = [_forward_order(s, num_stages, num_microbatches) for s in range(num_stages)]
    return from_compute_orders("forward", orders, num_microbatches)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The training schedule called `name` ("gpipe" or "1f1b") for K stages and M micro-batches."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[key](num_stages, num_microbatches)


# -- checking ----------------------------------------------------------------------------


def _peer(stage: int, action: Action) -> tuple[int, str]:
    """The neighbour an action talks to and the channel's direction ('act' flows down, 'grad' up)."""
    if action.op is Op.SEND_ACTIVATION:
        return stage + 1, "act"
    if action.op is Op.RECV_ACTIVATION:
        return stage - 1, "act"
    if action.op is Op.SEND_GRADIENT:
        return stage - 1, "grad"
    return stage + 1, "grad"


def simulate(schedule: Schedule, rendezvous: bool = True) -> list[tuple[int, Action]]:
    """Run the schedule's message passing; return the order actions completed in.

    rendezvous=True: a send completes only together with its matching receive (the
    strictest transport). rendezvous=False: sends are buffered and never wait. Messages
    between two stages match in order, so a receive meeting a different micro-batch than
    it expects is a ScheduleError; a state where no stage can move is a DeadlockError.
    """
    K = schedule.num_stages
    position = [0] * K
    mailbox: dict[tuple[int, int, str], deque[int]] = {}
    completed: list[tuple[int, Action]] = []

    def head(stage: int) -> Action | None:
        actions = schedule.stages[stage]
        return actions[position[stage]] if position[stage] < len(actions) else None

    def check_peer(stage: int, action: Action) -> int:
        peer, _ = _peer(stage, action)
        if not 0 <= peer < K:
            raise ScheduleError(f"{schedule.name}: stage {stage} runs {action}, but it has no stage {peer} to talk to")
        return peer

    progress = True
    while progress:
        progress = False
        for stage in range(K):
            while (action := head(stage)) is not None:
                if action.op.is_compute:
                    pass
                elif action.op.is_send:
                    peer = check_peer(stage, action)
                    if rendezvous:
                        other = head(peer)
                        if other is None or not other.op.is_recv or _peer(peer, other)[0] != stage:
                            break
                        if other.microbatch != action.microbatch or _peer(peer, other)[1] != _peer(stage, action)[1]:
                            raise ScheduleError(
                                f"{schedule.name}: stage {stage} sends {action} while stage {peer} expects {other}"
                            )
                        position[peer] += 1
                        completed.append((stage, action))
                        completed.append((peer, other))
                        position[stage] += 1
                        progress = True
                        continue
                    mailbox.setdefault((stage, peer, _peer(stage, action)[1]), deque()).append(action.microbatch)
                else:
                    peer = check_peer(stage, action)
                    if rendezvous:
                        break  # completed by the sender
                    queue = mailbox.get((peer, stage, _peer(stage, action)[1]))
                    if not queue:
                        break
                    sent = queue.popleft()
                    if sent != action.microbatch:
                        raise ScheduleError(
                            f"{schedule.name}: stage {stage} expects {action} but stage {peer} sent micro-batch {sent}"
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

    Per stage: each micro-batch is forwarded once (after its activation arrives, except on
    the first stage) and, in a training schedule, backwarded once (after its forward and
    after its gradient arrives, except on the last stage); activations are sent after
    their forward and gradients after their backward. Across stages: `simulate` under
    both transports.
    """
    K, M = schedule.num_stages, schedule.num_microbatches
    if len(schedule.stages) != K:
        raise ScheduleError(f"{schedule.name}: {len(schedule.stages)} stage lists for {K} stages")
    training = schedule.training
    for stage, actions in enumerate(schedule.stages):
        first, last = stage == 0, stage == K - 1
        expected: dict[Op, bool] = {
            Op.FORWARD: True,
            Op.RECV_ACTIVATION: not first,
            Op.SEND_ACTIVATION: not last,
            Op.BACKWARD: training,
            Op.RECV_GRADIENT: training and not last,
            Op.SEND_GRADIENT: training and not first,
        }
        done: dict[Op, set[int]] = {op: set() for op in Op}
        before = {
            Op.FORWARD: [] if first else [Op.RECV_ACTIVATION],
            Op.SEND_ACTIVATION: [Op.FORWARD],
            Op.BACKWARD: [Op.FORWARD] + ([] if last else [Op.RECV_GRADIENT]),
            Op.SEND_GRADIENT: [Op.BACKWARD],
            Op.RECV_ACTIVATION: [],
            Op.RECV_GRADIENT: [],
        }
        for action in actions:
            if not expected[action.op]:
                raise ScheduleError(f"{schedule.name}: stage {stage} should not run {action.op.value}")
            if not 0 <= action.microbatch < M:
                raise ScheduleError(f"{schedule.name}: stage {stage} runs {action} but there are {M} micro-batches")
            if action.microbatch in done[action.op]:
                raise ScheduleError(f"{schedule.name}: stage {stage} runs {action} twice")
            for needed in before[action.op]:
                if action.microbatch not in done[needed]:
                    raise ScheduleError(
                        f"{schedule.name}: stage {stage} runs {action} before {Action(needed, action.microbatch)}"
                    )
            done[action.op].add(action.microbatch)
        for op, wanted in expected.items():
            if wanted and done[op] != set(range(M)):
                missing = sorted(set(range(M)) - done[op])
                raise ScheduleError(f"{schedule.name}: stage {stage} never runs {op.value} of micro-batches {missing}")
    simulate(schedule, rendezvous=True)
    simulate(schedule, rendezvous=False)


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
) -> list[TimedAction]:
    """Place every action in time, given per-stage compute costs and a per-message latency.

    Sends never wait (buffered); a receive ends when both its stage is free and the message
    has arrived. Useful to draw a schedule and to compute its bubble without running it.
    """
    K = schedule.num_stages
    fwd = [forward_time] * K if isinstance(forward_time, (int, float)) else list(forward_time)
    bwd = [backward_time] * K if isinstance(backward_time, (int, float)) else list(backward_time)
    clock = [0.0] * K
    position = [0] * K
    arrivals: dict[tuple[int, int, str], deque[float]] = {}
    placed: list[TimedAction] = []
    progress = True
    while progress:
        progress = False
        for stage in range(K):
            actions = schedule.stages[stage]
            while position[stage] < len(actions):
                action = actions[position[stage]]
                start = clock[stage]
                if action.op is Op.FORWARD:
                    end = start + fwd[stage]
                elif action.op is Op.BACKWARD:
                    end = start + bwd[stage]
                elif action.op.is_send:
                    peer, kind = _peer(stage, action)
                    arrivals.setdefault((stage, peer, kind), deque()).append(start + message_time)
                    end = start
                else:
                    peer, kind = _peer(stage, action)
                    queue = arrivals.get((peer, stage, kind))
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
    """The most micro-batches whose forward has run but whose backward has not, on one stage."""
    alive = peak = 0
    for action in schedule.compute_order(stage):
        alive += 1 if action.op is Op.FORWARD else -1
        peak = max(peak, alive)
    return peak
