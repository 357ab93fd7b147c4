"""Scaling efficiency across runs of one configuration at several replica counts, measured and as the planner
predicts it for this machine."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replicator.report.runs import Run

__all__ = ["Link", "ScalingSeries", "scaling_series", "configuration_key", "predicted_efficiency", "cached_link",
           "fairness_warnings"]

# The stored calibration of this machine's link, beside the scaling plot: calibrating takes seconds.
CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class Link:
    """This machine's all-reduce link in the alpha-beta model: latency per message step (s), bandwidth (bytes/s)."""

    alpha: float
    beta: float
    source: str = "measured"


@dataclass
class ScalingSeries:
    """Runs of one configuration: the best 1-replica run as the baseline, then each replica count's best run."""

    key: tuple[Any, ...]
    baseline: Run
    runs: dict[int, Run]
    predicted: dict[str, dict[int, float]] = field(default_factory=dict)  # label -> replicas -> efficiency

    def efficiency(self, replicas: int) -> float | None:
        """Throughput at `replicas` over `replicas` times the baseline's."""
        rate, base = self.runs[replicas].throughput, self.baseline.throughput
        return None if rate is None or not base else rate / (replicas * base)


def fairness_warnings(series: ScalingSeries, replicas: int) -> list[str]:
    """What makes `replicas`' efficiency against the baseline doubtful: above 100 %, or unlike threads per process.

    Each replica of a launched job gets cores / replicas threads; a baseline run under plain `python` (torch's
    default: every core) or launched alone gets them all, and one with more threads than the compared run's
    replicas, or fewer (then efficiency can pass 100 %), does other work per replica than they do.
    """
    run, base = series.runs[replicas], series.baseline
    efficiency = series.efficiency(replicas)
    fair = (f"for a fair baseline, run the 1-replica job with this run's threads per replica: "
            f"`replicator launch -n 1 --threads {run.threads or 'T'} {base.script}`")
    warnings = []
    if run.threads is not None and base.threads is not None and run.threads != base.threads:
        warnings.append(f"the 1-replica baseline ran {base.threads} torch thread(s) per process, this run "
                        f"{run.threads}: each side did other work per replica, so the efficiency misleads; {fair}")
    elif efficiency is not None and efficiency > 1.0:
        why = ("its threads per process are not recorded (a record from an older replicator)"
               if run.threads is None or base.threads is None else
               "the baseline was slower per replica than this run's replicas (another load on the machine while "
               "it ran, or a different input pipeline)")
        warnings.append(f"an efficiency above 100 % means {why}; {fair}")
    return warnings


def configuration_key(run: Run) -> tuple[Any, ...]:
    """What runs must share to be compared across replica counts: the model, stages and mode."""
    model = run.config.get("model", {})
    return (model.get("parameters"), model.get("parameter_bytes"), run.topology.get("stages", 1), run.mode)


def _fastest(runs: Sequence[Run]) -> Run:
    return max(runs, key=lambda run: run.throughput or 0.0)


def scaling_series(runs: Sequence[Run]) -> list[ScalingSeries]:
    """Synchronous runs grouped by configuration_key; a group with a 1-replica run becomes a series."""
    groups: dict[tuple[Any, ...], list[Run]] = {}
    for run in runs:
        if run.mode == "sync" and run.throughput:
            groups.setdefault(configuration_key(run), []).append(run)
    series = []
    for key, members in groups.items():
        singles = [run for run in members if run.replicas == 1]
        if not singles:
            continue
        counts = sorted({run.replicas for run in members})
        best = {count: _fastest([run for run in members if run.replicas == count]) for count in counts}
        series.append(ScalingSeries(key, _fastest(singles), best))
    return series


def cached_link(directory: Path, measure: Callable[[], Link] | None, recalibrate: bool = False) -> Link | None:
    """The link stored in `directory` (or measured now with `measure` and stored there); None without either."""
    stored = directory / CALIBRATION_FILE
    if stored.is_file() and not recalibrate:
        try:
            values = json.loads(stored.read_text(encoding="utf-8"))
            return Link(float(values["alpha"]), float(values["beta"]), f"recorded in {stored}")
        except (OSError, ValueError, KeyError, TypeError):
            pass  # measured again below
    if measure is None:
        return None
    link = measure()
    try:
        stored.write_text(json.dumps({"alpha": link.alpha, "beta": link.beta}) + "\n", encoding="utf-8")
    except OSError:
        pass  # measured again next time
    return link


def predicted_efficiency(series: ScalingSeries, link: Link) -> dict[str, dict[int, float]]:
    """The planner's (replicator.plan) scaling efficiency for each replica count of `series` on `link`.

    The measured 1-replica step is the compute (the planner's FLOP rate is chosen to reproduce it, at each
    run's own per-replica batch); gradients are the model's parameter bytes, bucketed as the run was, summed
    by a flat ring over `link`. On CPU, all-reduce competes with the backward pass for cores, so both ends of
    the planner's overlap range are given; on GPUs, full overlap.
    """
    from replicator.plan import REDUCERS, Accelerator, Cluster, Workload, predict
    from replicator.plan.planner import MB
    from replicator.plan.step import BACKWARD_PER_FORWARD

    base = series.baseline
    steps = sum(entry["steps"] for entry in base.breakdown)
    seconds = sum(entry["step_seconds"] for entry in base.breakdown)
    batch = base.samples_per_replica
    parameters = base.config.get("model", {}).get("parameters")
    parameter_bytes = base.config.get("model", {}).get("parameter_bytes")
    if not steps or not seconds or not batch or not parameters or not parameter_bytes:
        return {}
    peak = 1e12  # any rate: flops_per_sample is scaled to it
    flops_per_sample = seconds / steps * peak / ((1 + BACKWARD_PER_FORWARD) * batch)
    overlaps = {"planner, full overlap": 1.0}
    if base.topology.get("device", "cpu") == "cpu":
        overlaps["planner, no overlap"] = 0.0
    predicted: dict[str, dict[int, float]] = {label: {} for label in overlaps}
    for replicas, run in series.runs.items():
        per_replica = run.samples_per_replica
        if per_replica is None:
            continue
        workload = Workload(float(parameters), flops_per_sample, max(1, round(per_replica)),
                            gradient_bytes=max(1, round(parameter_bytes / parameters)))
        per_node = min(replicas, int(run.topology.get("processes_per_node", replicas)) or replicas)
        cluster = Cluster.two_level(per_node, link.beta, link.alpha, link.beta, link.alpha)
        bucket = float(run.config.get("bucket_cap_mb") or 25.0) * MB
        for label, overlap in overlaps.items():
            try:
                prediction = predict(workload, Accelerator(peak, 1.0, overlap), cluster, replicas, REDUCERS[0], bucket)
            except ValueError:
                continue  # a replica count the planner cannot place on whole nodes
            predicted[label][replicas] = prediction.efficiency
    return predicted
