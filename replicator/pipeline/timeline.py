"""What each stage did when: recorded actions, exported as a Chrome trace (Perfetto) or a Gantt chart.

Times are the job timeline's clock (replicator.timeline: wall-clock seconds), so stages in
different processes, and on machines whose clocks are synchronised, line up on one axis. While
run(timeline=...) records, every action is also a span of the run's timeline.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from replicator.pipeline.bubble import idle_share
from replicator.pipeline.schedule import Op, Schedule, TimedAction, timed_simulation
from replicator.timeline import recorder
from replicator.timeline.trace import complete_event, process_metadata, thread_metadata

__all__ = ["Event", "Timeline", "gather_events", "events_from_simulation", "chrome_trace", "write_chrome_trace",
           "plot_gantt", "measured_bubble"]

_LABEL = {
    Op.FORWARD.value: "F",
    Op.BACKWARD.value: "B",
    Op.BACKWARD_INPUT.value: "I",
    Op.BACKWARD_WEIGHT.value: "W",
    Op.SEND_ACTIVATION.value: "send act",
    Op.RECV_ACTIVATION.value: "recv act",
    Op.SEND_GRADIENT.value: "send grad",
    Op.RECV_GRADIENT.value: "recv grad",
}
_COLOR = {
    Op.FORWARD.value: "#4C72B0",
    Op.BACKWARD.value: "#55A868",
    Op.BACKWARD_INPUT.value: "#8C6BB1",
    Op.BACKWARD_WEIGHT.value: "#DD8452",
    Op.SEND_ACTIVATION.value: "#C7C7C7",
    Op.RECV_ACTIVATION.value: "#E5AE38",
    Op.SEND_GRADIENT.value: "#C7C7C7",
    Op.RECV_GRADIENT.value: "#E5AE38",
}


_COMPUTE = frozenset(op.value for op in Op if op.is_compute)


@dataclass(frozen=True)
class Event:
    """One action of one stage: its operation (an `Op` value), micro-batch, start/end seconds and model chunk."""

    stage: int
    op: str
    microbatch: int
    start: float
    end: float
    replica: int = 0
    chunk: int = 0  # which of the stage's virtual stages (interleaved schedules)

    @property
    def is_compute(self) -> bool:
        return self.op in _COMPUTE


def action_label(op: str, microbatch: int, chunk: int = 0) -> str:
    """How an action reads on a timeline: "F 3", "send act 2", "B 1 v1" (chunk 1 of a stage's virtual stages)."""
    return f"{_LABEL.get(op, op)} {microbatch}" + (f" v{chunk}" if chunk else "")


class Timeline:
    """The events one stage recorded in its last step; `record()` times one action (and hands it to the run's
    timeline while one records)."""

    def __init__(self, stage: int, replica: int = 0, enabled: bool = True) -> None:
        self.stage = stage
        self.replica = replica
        self.enabled = enabled
        self.events: list[Event] = []

    @contextlib.contextmanager
    def record(self, op: str, microbatch: int, chunk: int = 0) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = recorder.clock()
        try:
            yield
        finally:
            end = recorder.clock()
            self.events.append(Event(self.stage, op, microbatch, start, end, self.replica, chunk))
            if (run := recorder.active()) is not None:
                run.add(action_label(op, microbatch, chunk), op, start, end,
                        args={"stage": self.stage, "microbatch": microbatch, "chunk": chunk})

    def clear(self) -> None:
        self.events.clear()


def gather_events(events: Sequence[Event], group: dist.ProcessGroup | None, num_stages: int,
                  device: torch.device) -> list[Event]:
    """Every stage's `events`, on every stage (a collective over the stage group of `num_stages` processes)."""
    if group is None or num_stages == 1:
        return list(events)
    # Numbers in a tensor, not all_gather_object: that would unpickle whatever the peers send.
    ops = [op.value for op in Op]
    rows = [[e.stage, ops.index(e.op), e.microbatch, e.start, e.end, e.replica, e.chunk] for e in events]
    mine = torch.tensor(rows, dtype=torch.float64).reshape(-1, 7).to(device)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(num_stages)]
    dist.all_gather(counts, torch.tensor([len(rows)], device=device), group=group)
    sizes = [int(c.item()) for c in counts]
    if not max(sizes):
        return []
    padded = torch.zeros(max(sizes), 7, dtype=torch.float64, device=device)
    padded[: len(rows)] = mine
    gathered = [torch.empty_like(padded) for _ in range(num_stages)]
    dist.all_gather(gathered, padded, group=group)
    return [Event(int(r[0]), ops[int(r[1])], int(r[2]), float(r[3]), float(r[4]), int(r[5]), int(r[6]))
            for tensor, size in zip(gathered, sizes) for r in tensor[:size].cpu().tolist()]


def events_from_simulation(placed: Sequence[TimedAction] | Schedule, forward_time: float = 1.0,
                           backward_time: float = 2.0) -> list[Event]:
    """Events of a simulated run (see schedule.timed_simulation), to draw a schedule before running it."""
    if isinstance(placed, Schedule):
        placed = timed_simulation(placed, forward_time, backward_time)
    return [Event(p.stage, p.action.op.value, p.action.microbatch, p.start, p.end, chunk=p.action.chunk)
            for p in placed]


def measured_bubble(events: Sequence[Event]) -> float:
    """Share of the stages' time, from the first start to the last end of recorded events, not spent computing."""
    return idle_share(((e.replica, e.stage), e.start, e.end, e.is_compute) for e in events)


def chrome_trace(events: Sequence[Event]) -> dict[str, Any]:
    """The events as a Chrome trace (open in ui.perfetto.dev or chrome://tracing): a process per replica (pid
    replica + 1: Perfetto takes pid 0 for the kernel's idle task), a thread per stage (tid = stage)."""
    origin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for replica in sorted({e.replica for e in events}):
        trace += process_metadata(replica + 1, f"replica {replica}")
    for replica, stage in sorted({(e.replica, e.stage) for e in events}):
        trace += thread_metadata(replica + 1, stage, f"stage {stage}")
    trace += [complete_event(action_label(e.op, e.microbatch, e.chunk), e.op, e.start, e.end, e.replica + 1,
                             e.stage, origin, asdict(e)) for e in events]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Sequence[Event], path: str | os.PathLike[str]) -> None:
    """Write `chrome_trace(events)` as JSON to `path`."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(chrome_trace(events), file)


def plot_gantt(events: Sequence[Event], path: str | os.PathLike[str], *, title: str | None = None,
               show_communication: bool = True, time_unit: str | None = None) -> None:
    """Draw the events as a Gantt chart PNG: a row per stage, forwards blue, backwards green.

    A split backward (zero bubble) shows its input gradients purple and its weight
    gradients orange; with virtual stages, a stage's later chunks are paler.

    Needs matplotlib. Receives (waiting for a neighbour) are drawn as thin amber bars; sends
    as thin grey bars, since they only start a transfer. Times are shown in ms or s, or
    unscaled with the label `time_unit` (e.g. "time units" for a simulated schedule).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not events:
        raise ValueError("no events to draw; run a step with recording enabled first")
    origin = min(e.start for e in events)
    span = max(e.end for e in events) - origin
    if time_unit is None:
        scale, unit = (1e3, "ms") if span < 10 else (1.0, "s")
    else:
        scale, unit = 1.0, time_unit
    lanes = sorted({(e.replica, e.stage) for e in events})
    row = {lane: k for k, lane in enumerate(lanes)}
    width_inches = max(8.0, min(24.0, 0.25 * len(events) / max(1, len(lanes))))
    figure, axes = plt.subplots(figsize=(width_inches, 0.6 * len(lanes) + 1.5))
    for e in events:
        y = row[(e.replica, e.stage)]
        start, width = (e.start - origin) * scale, (e.end - e.start) * scale
        if e.is_compute:
            # A stage's later chunks (virtual stages) are drawn paler, labelled "micro-batch.chunk".
            axes.broken_barh([(start, width)], (y - 0.4, 0.8), facecolors=_COLOR[e.op], edgecolor="white",
                             linewidth=0.5, alpha=1.0 / (1 + 0.6 * e.chunk))
            if width > span * scale / 80:
                label = f"{e.microbatch}.{e.chunk}" if any(x.chunk for x in events) else str(e.microbatch)
                axes.text(start + width / 2, y, label, ha="center", va="center", color="white", fontsize=7)
        elif show_communication:
            axes.broken_barh([(start, max(width, 0.0))], (y + 0.25, 0.15), facecolors=_COLOR.get(e.op, "#999999"))
    axes.set_yticks(range(len(lanes)))
    axes.set_yticklabels([f"stage {s}" if len({r for r, _ in lanes}) == 1 else f"r{r} stage {s}" for r, s in lanes])
    axes.invert_yaxis()
    axes.set_xlabel(unit)
    bubble = measured_bubble(events)
    axes.set_title(f"{title + ' — ' if title else ''}bubble {bubble:.0%}")
    handles = [Patch(color=_COLOR[Op.FORWARD.value], label="forward"),
               Patch(color=_COLOR[Op.BACKWARD.value], label="backward")]
    for op, label in ((Op.BACKWARD_INPUT, "input gradient"), (Op.BACKWARD_WEIGHT, "weight gradient")):
        if any(e.op == op.value for e in events):
            handles.append(Patch(color=_COLOR[op.value], label=label))
    if show_communication:
        handles += [Patch(color=_COLOR[Op.RECV_ACTIVATION.value], label="receive (waiting)"),
                    Patch(color=_COLOR[Op.SEND_ACTIVATION.value], label="send")]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
