"""The PNGs of `replicator report` (matplotlib, Agg): loss, throughput, step-time breakdown, scaling efficiency."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from replicator.report.runs import Run
from replicator.report.scaling import ScalingSeries

__all__ = ["plot_loss", "plot_throughput", "plot_breakdown", "plot_scaling"]

SIZE = (8.0, 4.5)  # inches: 960 x 540 pixels at DPI
DPI = 120
COLORS = {"compute": "#4C72B0", "communication": "#DD8452", "input": "#55A868", "ideal": "#555555"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    _pyplot().close(figure)
    return path


def _smoothed(values: list[float]) -> list[float]:
    """An exponential moving average that follows about a twentieth of the curve (TensorBoard's smoothing)."""
    weight = 1 - 1 / max(2.0, len(values) / 20)
    smoothed, last = [], values[0]
    for value in values:
        last = weight * last + (1 - weight) * value
        smoothed.append(last)
    return smoothed


def plot_loss(run: Run, path: Path) -> Path | None:
    """Loss against step (the first scalar step_fn returned, when none is called loss); None without any."""
    names = run.scalar_names()
    if not names:
        return None
    name = names[0]
    steps, values = run.series(name)
    if not values:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=SIZE)
    axes.plot(steps, values, color=COLORS["compute"], alpha=0.35 if len(values) > 20 else 1.0, linewidth=1,
              marker="o" if len(values) <= 20 else None, markersize=3, label=f"{name} per step")
    if len(values) > 20:
        axes.plot(steps, _smoothed(values), color=COLORS["compute"], linewidth=2, label=f"{name}, smoothed")
    axes.set_xlabel("step")
    axes.set_ylabel(f"{name} (as replica 0's step_fn returned it)")
    axes.set_title(f"{name} - {run.name}")
    axes.grid(alpha=0.3)
    axes.legend()
    return _save(figure, path)


def plot_throughput(run: Run, path: Path) -> Path:
    """Samples per second of the whole job, per step and as a running median, against time since the start."""
    lines = [line for line in run.metrics if line.get("samples_per_second")]
    start = min(line["wall_time"] - line["time"] for line in run.metrics)  # one clock across resumed runs
    seconds = [line["wall_time"] - start for line in lines]
    rates = [float(line["samples_per_second"]) for line in lines]
    window = max(2, len(rates) // 20)
    running = [statistics.median(rates[max(0, i - window):i + window + 1]) for i in range(len(rates))]
    warmup = int(run.summary.get("warmup_steps") or 0)
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=SIZE)
    axes.plot(seconds, rates, ".", color=COLORS["compute"], alpha=0.4, markersize=4, label="per step")
    axes.plot(seconds, running, color=COLORS["compute"], linewidth=2, label=f"running median ({2 * window + 1} steps)")
    if warmup and len(seconds) > warmup:
        axes.axvspan(0, seconds[warmup - 1], color="#999999", alpha=0.15, label=f"{warmup} warm-up steps")
    if run.throughput:
        axes.axhline(run.throughput, color=COLORS["ideal"], linestyle="--", linewidth=1,
                     label=f"after warm-up: {run.throughput:,.0f} samples/s")
    axes.set_xlabel("time since the run started (s)")
    axes.set_ylabel("throughput (samples/s, whole job)")
    # A few steps that ran between two slow ones would flatten the curve: the axis ends above the 98th percentile.
    typical = sorted(rates)[int(0.98 * (len(rates) - 1))] if rates else 1.0
    axes.set_ylim(0, 1.15 * max(typical, max(running, default=0.0), run.throughput or 0.0))
    axes.set_title(f"Throughput - {run.name} ({run.replicas} replica{'s' * (run.replicas != 1)})")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, fontsize=9, frameon=False)
    return _save(figure, path)


def plot_breakdown(run: Run, path: Path) -> Path | None:
    """Stacked bars per replica: compute, exposed communication and input wait, in ms per steady step."""
    rows = [entry for entry in run.breakdown if entry["steps"]]
    if not rows:
        return None
    replicas = [str(entry["replica"]) for entry in rows]
    parts = {
        "compute": [1e3 * entry["compute_seconds"] / entry["steps"] for entry in rows],
        "exposed communication": [1e3 * entry["communication_seconds"] / entry["steps"] for entry in rows],
        "input wait": [1e3 * entry["input_seconds"] / entry["steps"] for entry in rows],
    }
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(max(7.0, min(12.0, 3.0 + 0.6 * len(rows))), SIZE[1]))
    bottom = [0.0] * len(rows)
    for (label, values), color in zip(parts.items(), (COLORS["compute"], COLORS["communication"], COLORS["input"])):
        axes.bar(replicas, values, bottom=bottom, color=color, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        axes.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize=9)
    warmup = int(run.summary.get("warmup_steps") or 0)
    axes.set_xlabel("replica")
    axes.set_ylabel("time per step (ms)")
    axes.set_ylim(top=max(bottom) * 1.12 if max(bottom) > 0 else 1.0)
    after = f"mean of the steps after {warmup} warm-up steps" if warmup else "mean of all steps"
    axes.set_title(f"Step time per replica - {run.name}\n({after})", fontsize=11)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=9, frameon=False)
    return _save(figure, path)


def plot_scaling(series: ScalingSeries, path: Path) -> Path:
    """Throughput and scaling efficiency against replicas: measured, ideal and the planner's prediction."""
    counts = sorted(series.runs)
    base = series.baseline.throughput or 0.0
    measured = [series.runs[count].throughput or 0.0 for count in counts]
    efficiency = [100 * (series.efficiency(count) or 0.0) for count in counts]
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.5))
    left.plot(counts, [count * base for count in counts], "--", color=COLORS["ideal"], label="ideal (linear)")
    left.plot(counts, measured, "o-", color=COLORS["compute"], linewidth=2, label="measured")
    right.axhline(100, linestyle="--", color=COLORS["ideal"], label="ideal (100%)")
    right.plot(counts, efficiency, "o-", color=COLORS["compute"], linewidth=2, label="measured")
    for (label, values), style in zip(series.predicted.items(), (":", "-.")):
        planned = sorted(values)
        left.plot(planned, [values[c] * c * base for c in planned], style, color=COLORS["communication"],
                  marker="s", label=label)
        right.plot(planned, [100 * values[c] for c in planned], style, color=COLORS["communication"], marker="s",
                   label=label)
    for axes in (left, right):
        axes.set_xlabel("replicas")
        axes.set_xticks(counts)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=9)
    left.set_ylabel("throughput (samples/s, whole job)")
    left.set_ylim(bottom=0)
    left.set_title("Throughput against replicas")
    right.set_ylabel("scaling efficiency (%)")
    right.set_ylim(0, max(110.0, *efficiency) * 1.05)
    right.set_title("Scaling efficiency (throughput / (N x 1 replica's))")
    figure.suptitle(f"Scaling - {series.baseline.name}'s configuration", fontsize=12)
    return _save(figure, path)
