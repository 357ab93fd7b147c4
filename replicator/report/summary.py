"""The text `replicator report` prints per run: throughput, efficiency, where time went, stragglers, staleness."""

from __future__ import annotations

from typing import Any

from replicator.report.runs import Run
from replicator.report.scaling import ScalingSeries, fairness_warnings

__all__ = ["describe_run", "describe_scaling"]


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _shape(run: Run) -> str:
    topology = run.topology
    parts = [f"{run.replicas} replica{'s' * (run.replicas != 1)}"]
    if topology.get("stages", 1) > 1:
        parts.append(f"{topology['stages']} stages")
    if topology.get("servers"):
        parts.append(f"{topology['servers']} {topology.get('serving_role', 'server')}(s)")
    parts += [run.mode, f"reducer {run.config.get('reducer', '?')}", f"{topology.get('device', '?')}"]
    return ", ".join(parts)


def _time_went(breakdown: list[dict[str, Any]]) -> list[str]:
    """Where the steady steps' time went, over all replicas, and the slowest replica against the fastest."""
    steps = sum(entry["steps"] for entry in breakdown)
    if not steps:
        return ["  where time went: every step was a warm-up step (run more steps than warmup_steps)"]
    compute = sum(entry["compute_seconds"] for entry in breakdown)
    communication = sum(entry["communication_seconds"] for entry in breakdown)
    waiting = sum(entry["input_seconds"] for entry in breakdown)
    total = compute + communication + waiting
    share = (lambda part: f"{100 * part / total:.0f}%") if total > 0 else (lambda part: "-")
    lines = [f"  where time went, per step: {1e3 * total / steps:.2f} ms = compute {1e3 * compute / steps:.2f} "
             f"({share(compute)}) + exposed communication {1e3 * communication / steps:.2f} ({share(communication)}) "
             f"+ input wait {1e3 * waiting / steps:.2f} ({share(waiting)})"]
    per_step = {entry["replica"]: (entry["step_seconds"] + entry["input_seconds"]) / entry["steps"]
                for entry in breakdown if entry["steps"]}
    if len(per_step) > 1:
        slowest, fastest = max(per_step, key=per_step.__getitem__), min(per_step, key=per_step.__getitem__)
        over = per_step[slowest] / per_step[fastest] - 1 if per_step[fastest] > 0 else 0.0
        lines.append(f"  slowest replica: {slowest}, {1e3 * per_step[slowest]:.2f} ms per step, {100 * over:.1f}% "
                     f"over the fastest (replica {fastest}, {1e3 * per_step[fastest]:.2f} ms)")
    return lines


def _peak_memory(summary: dict[str, Any]) -> list[str]:
    """Each replica's peak resident memory (and peak CUDA allocation on CUDA), as summary.json's `peak_memory`."""
    peaks = summary.get("peak_memory") or []
    if not peaks:
        return []  # a record written before peak memory was recorded

    def mib(nbytes: float) -> str:
        return f"{nbytes / 2**20:,.1f} MiB"

    parts = [f"replica {entry['replica']} {mib(entry['max_rss_bytes'])}"
             + ("" if entry.get("cuda_max_allocated_bytes") is None
                else f" (CUDA {mib(entry['cuda_max_allocated_bytes'])})") for entry in peaks]
    on_cuda = any(entry.get("cuda_max_allocated_bytes") is not None for entry in peaks)
    what = "resident set, CUDA allocated" if on_cuda else "resident set"
    return [f"  peak memory per replica ({what}): {'; '.join(parts)}"]


def _staleness(summary: dict[str, Any]) -> list[str]:
    groups = summary.get("asynchronous", {}).get("groups") or {}
    lines = []
    for group, figures in sorted(groups.items(), key=lambda item: int(item[0])):
        staleness = figures.get("staleness", {})
        if not staleness.get("count"):
            lines.append(f"  group {group}: {figures.get('updates', 0)} updates, no staleness measured")
            continue
        lines.append(f"  group {group}: {figures.get('updates', 0)} updates, staleness median {staleness['median']:g}, "
                     f"p95 {staleness['p95']:.1f}, max {staleness['max']} (bound {staleness.get('bound')}; "
                     f"{staleness.get('exceeded', 0)} of {staleness['count']} over it)")
    return (["  staleness of the asynchronous updates:"] + lines) if lines else []


def _actor_learner(summary: dict[str, Any]) -> list[str]:
    figures = summary.get("actor_learner")
    if not figures or figures.get("role") != "learner":
        return []
    ratio = figures.get("samples_per_insert")
    return [f"  actors: {figures.get('env_steps', 0)} env steps ({_rate(figures.get('env_steps_per_second') or 0)}/s); "
            f"learners: {figures.get('learner_steps', 0)} steps ({_rate(figures.get('learner_steps_per_second') or 0)}"
            f"/s); samples per insert {'-' if ratio is None else f'{ratio:.2f}'} (target "
            f"{figures.get('target_samples_per_insert')})"]


def describe_run(run: Run, series: ScalingSeries | None) -> list[str]:
    """The lines that summarize one run; `series` gives its scaling efficiency when it holds a 1-replica run."""
    lines = [f"{run.path}  ({_shape(run)}; {run.status})"]
    if run.status != "finished":
        lines.append(f"  ended early: {run.summary.get('error') or run.summary.get('reason', '')}")
    first, last = run.metrics[0]["step"], run.metrics[-1]["step"]
    warmup = run.summary.get("warmup_steps")
    rate = run.throughput
    text = f"  steps {first}-{last} ({len(run.metrics)} recorded)"
    if rate is not None:
        text += f"; {_rate(rate)} samples/s" + (f" after {warmup} warm-up steps" if warmup else "")
    steps, losses = run.series("loss")
    if losses:
        text += f"; loss {losses[0]:.4g} at step {steps[0]} -> {losses[-1]:.4g} at step {steps[-1]}"
    lines.append(text)
    if series is not None and run.replicas in series.runs and series.runs[run.replicas] is run and run.replicas > 1:
        efficiency = series.efficiency(run.replicas)
        if efficiency is not None:
            lines.append(f"  scaling efficiency: {100 * efficiency:.1f}% of {run.replicas} x the 1-replica run's "
                         f"{_rate(series.baseline.throughput or 0)} samples/s ({series.baseline.path})")
            lines += [f"  warning: {warning}" for warning in fairness_warnings(series, run.replicas)]
    lines += _time_went(run.breakdown) if run.breakdown else []
    return lines + _peak_memory(run.summary) + _staleness(run.summary) + _actor_learner(run.summary)


def describe_scaling(series: ScalingSeries) -> list[str]:
    """One line per replica count: throughput, measured efficiency and the planner's."""
    lines = [f"scaling of {series.baseline.name}'s configuration (1-replica baseline {series.baseline.path}):"]
    for replicas, run in sorted(series.runs.items()):
        efficiency = series.efficiency(replicas)
        planned = "; ".join(f"{label} {100 * values[replicas]:.1f}%" for label, values in series.predicted.items()
                            if replicas in values)
        measured = "-" if efficiency is None else f"{100 * efficiency:.1f}%"
        measured += " (doubtful: see the warning above)" if fairness_warnings(series, replicas) else ""
        noun = "replica" if replicas == 1 else "replicas"
        lines.append(f"  {replicas:>3} {noun}: {_rate(run.throughput or 0)} samples/s, efficiency {measured}"
                     + (f" ({planned})" if planned else ""))
    return lines
