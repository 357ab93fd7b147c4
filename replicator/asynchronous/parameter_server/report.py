"""Internal: the end of an asynchronous run as every worker keeps it in repl.last_run and the main worker prints it.

Groups never meet in a collective, so each worker leaves its figures (its group's staleness
record, its step times) in the job's store before its group says it is done; once every group
is done or gone, each worker reads them all.
"""

from __future__ import annotations

from typing import Any

from replicator.comm.store import RankRecords
from replicator.telemetry import breakdown_table

__all__ = ["Reports", "group_lines"]

_KEY = "replicator/async/report"


class Reports:
    """Every worker's figures of one run, through the job's store (tagged JSON, never unpickled)."""

    def __init__(self, run: int) -> None:
        self.records = RankRecords(f"{_KEY}{run}/rank")

    def put(self, rank: int, figures: dict[str, Any]) -> None:
        self.records.put(rank, figures)

    def gather(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """The figures of every rank that left them (a group that died or hung left none)."""
        return self.records.present(ranks)


def group_lines(groups: dict[int, dict[str, Any]], partition: list[list[int]], departed: dict[int, str],
                servers: int, bound: int | None) -> list[str]:
    """What the main worker prints: one line per sync group (its updates, staleness, waits), or how it left."""
    lines = [f"replicator: asynchronous run: {len(partition)} sync group(s) of {len(partition[0])} on {servers} "
             f"parameter server(s), staleness bound {'none' if bound is None else bound}"]
    for group, ranks in enumerate(partition):
        figures = groups.get(group)
        if figures is None:
            lines.append(f"  group {group} (ranks {ranks}): {departed.get(group, 'left')} before the end; see the "
                         "servers' report")
            continue
        staleness = figures["staleness"]
        spread = (f"staleness min {staleness['min']}, median {staleness['median']:g}, p95 {staleness['p95']:.1f}, "
                  f"max {staleness['max']}" if staleness["count"] else "no staleness measured")
        lines.append(f"  group {group} (ranks {ranks}): {figures['updates']} updates | {spread} | exceeded: "
                     f"{staleness['exceeded']} of {staleness['count']} (bound "
                     f"{'none' if bound is None else bound}) | waiting on servers {figures['wait_seconds']:.2f} s")
    return lines


def print_report(lines: list[str], per_worker: list[list[float]]) -> None:
    print("\n".join(lines), flush=True)
    if per_worker:
        from rich.console import Console

        Console().print(breakdown_table(per_worker))
