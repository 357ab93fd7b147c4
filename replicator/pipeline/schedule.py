"""Pipeline schedules as plain data, by name: for each stage, the ordered actions it performs.

The pieces live in their own modules: the data (`actions`), the families (`linear`: GPipe,
1F1B and forward-only with one model chunk per stage; `interleaved`: interleaved 1F1B and
zero bubble over virtual stages) and the checks (`simulator`: message passing, deadlock,
timing, bubble). This module names the training schedules and re-exports the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from replicator.pipeline.actions import Action, DeadlockError, Op, Schedule, ScheduleError
from replicator.pipeline.interleaved import forward_only_ring, interleaved_1f1b, zero_bubble
from replicator.pipeline.linear import forward_only, from_compute_orders, gpipe, one_f_one_b
from replicator.pipeline.simulator import (
    TimedAction,
    check_schedule,
    endpoint,
    max_in_flight,
    simulate,
    simulated_bubble,
    timed_simulation,
)

__all__ = [
    "Op",
    "Action",
    "Schedule",
    "ScheduleError",
    "DeadlockError",
    "SCHEDULES",
    "VIRTUAL_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zero_bubble",
    "forward_only",
    "forward_only_ring",
    "make_schedule",
    "schedule_key",
    "from_compute_orders",
    "endpoint",
    "simulate",
    "check_schedule",
    "TimedAction",
    "timed_simulation",
    "simulated_bubble",
    "max_in_flight",
]

# One chunk per stage: (K, M) -> Schedule.
SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
# Any number of chunks per stage: (K, M, V) -> Schedule.
VIRTUAL_SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "interleaved": interleaved_1f1b,
    "zerobubble": zero_bubble,
}
SPLIT_BACKWARD_SCHEDULES = frozenset({"zerobubble"})  # backward split into input and weight gradients
_ALIASES = {"interleaved1f1b": "interleaved", "zb": "zerobubble", "zbh1": "zerobubble"}
_NAMES = ["gpipe", "1f1b", "interleaved", "zero_bubble"]


def schedule_key(name: str) -> str:
    """The registry key of a schedule name: case, '-' and '_' do not matter ("Zero-Bubble" is "zerobubble")."""
    key = name.lower().replace("-", "").replace("_", "")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES and key not in VIRTUAL_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {_NAMES}")
    return key


def make_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The training schedule called `name` for K stages, M micro-batches and V model chunks per stage.

    "gpipe" and "1f1b" hold one chunk per stage; "interleaved" (interleaved 1F1B) needs
    V >= 2; "zero_bubble" (ZB-H1, split backward) takes any V.
    """
    key = schedule_key(name)
    if key in SCHEDULES:
        if virtual_stages != 1:
            raise ValueError(f"the {name!r} schedule holds one model chunk per stage, but virtual_stages="
                             f"{virtual_stages}; use schedule=\"interleaved\" or \"zero_bubble\" for virtual stages")
        return SCHEDULES[key](num_stages, num_microbatches)
    return VIRTUAL_SCHEDULES[key](num_stages, num_microbatches, virtual_stages)
