"""The benchmarks' shared method: contenders in turns, paired ratios, medians, a machine header and JSON results.

Every benchmark here compares contenders (replicator and its peer: torch DDP, ScheduleGPipe, a
plain loop, torch's own collectives) inside the same processes, on the same data, in short
phases that take turns. On a shared machine the load drifts within seconds, so only phases
close in time make fair pairs: a *paired ratio* is the median over repetitions of
(contender / peer) within one repetition, which cancels load that drifts more slowly than a
repetition. Figures are medians with their min and max. Each run writes its figures, with the
machine header and the command, to `benchmarks/results/<name>.json` unless told otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import replicator

RESULTS_DIR = Path(__file__).resolve().parent / "results"

T = TypeVar("T")


# -- turns -------------------------------------------------------------------------------------


def in_turns(contenders: Sequence[T], repeats: int, *, rotate: bool = True) -> Iterator[tuple[int, T]]:
    """(repetition, contender) for every phase, in the order the phases run.

    Each repetition runs every contender once; with `rotate` the order shifts by one every
    repetition, so no contender always follows the same neighbour (or always runs first,
    right after a barrier or a warm-up).
    """
    order = list(contenders)
    for repetition in range(repeats):
        shift = repetition % len(order) if rotate else 0
        for contender in order[shift:] + order[:shift]:
            yield repetition, contender


def slowest_rank(seconds: float) -> float:
    """The largest `seconds` over the job's processes: a collective or a step ends when its slowest rank does.

    A process that is not part of a process group is its own slowest rank.
    """
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


# -- medians and ratios ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """The min, median and max of a series of repetitions."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values))


def paired_ratio(values: Sequence[float], peer: Sequence[float]) -> float:
    """Median over repetitions of value / peer, each pair taken within one repetition."""
    return statistics.median(v / p for v, p in zip(values, peer, strict=True))


def ratio_of_medians(values: Sequence[float], peer: Sequence[float]) -> float:
    return statistics.median(values) / statistics.median(peer)


@dataclass(frozen=True)
class Comparison:
    """One contender against the named peer; the ratios are None for the peer itself."""

    spread: Spread
    ratio_of_medians: float | None
    paired: float | None


def compare(series: Mapping[str, Sequence[float]], peer: str) -> dict[str, Comparison]:
    """Every contender's spread and its ratios to `peer` (higher is better for the values given)."""
    return {
        name: Comparison(
            Spread.of(values),
            None if name == peer else ratio_of_medians(values, series[peer]),
            None if name == peer else paired_ratio(values, series[peer]),
        )
        for name, values in series.items()
    }


def ratio_text(value: float | None) -> str:
    return "(peer)" if value is None else f"{value:.3f}"


# -- the machine -------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), or what `platform` knows elsewhere."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages: how much other work shared the cores."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def machine() -> dict[str, Any]:
    """What a result needs to be read: CPU model, cores, Python, torch, load average and the date (UTC)."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "replicator": replicator.__version__,
        "load_average": load_average(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(info: Mapping[str, Any]) -> str:
    one, five, fifteen = info["load_average"]
    return (
        f"{info['cpu']}, {info['cores']} CPU cores, Python {info['python']}, torch {info['torch']}, "
        f"replicator {info['replicator']}, load average {one:.2f} / {five:.2f} / {fifteen:.2f}, {info['date']}"
    )


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot, from /proc/stat (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:9]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def gloo_thread_seconds() -> float:
    """CPU seconds this process's Gloo I/O threads have used (Linux /proc; 0 elsewhere)."""
    total = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as handle:
                if not handle.read().startswith("gloo"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


# -- results -----------------------------------------------------------------------------------


def add_json_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """`--json PATH`, by default benchmarks/results/<name>.json; `--json ''` writes no file."""
    parser.add_argument("--json", metavar="PATH", default=str(RESULTS_DIR / f"{name}.json"),
                        help="where to write every figure as JSON (default: %(default)s; '' for none)")


def write_json(path: str | None, report: Mapping[str, Any], header: Mapping[str, Any]) -> None:
    """Write `report` with the machine header and the command that produced it; nothing when `path` is empty."""
    if not path:
        return
    # The interpreter as the README names it, not this machine's absolute path to it.
    python = os.path.join(".venv", "bin", "python") if ".venv" in sys.executable else "python"
    document = {"machine": dict(header), "command": " ".join([python, *sys.argv]), **report}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2, default=str)
    print(f"figures written to {path}")
