"""`replicator demo`: time one replica, train on N, and report accuracy and weak scaling."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from replicator.launch import LaunchSpec, launch

__all__ = ["run_demo", "PER_REPLICA_BATCH", "TIMING_STEPS"]

# Weak scaling: every replica always processes this many images per step, so N replicas
# train on N times the global batch and should deliver N times the images per second.
PER_REPLICA_BATCH = 128
TIMING_STEPS = 20  # the first 5 are warm-up and excluded from images/s
ACCURACY_TARGET = 0.95
SCRIPT = "replicator.demo.digits"


def _train(replicas: int, args: list[str], result_path: str) -> tuple[int, dict[str, Any] | None]:
    """Launch the digits script on `replicas` local processes of one thread each; read replica 0's figures."""
    spec = LaunchSpec(
        target=SCRIPT, module=True, nproc_per_node=replicas, threads_per_process=1,
        args=[*args, "--result", result_path],
    )
    code = launch(spec)
    if code != 0 or not os.path.exists(result_path):
        return code or 1, None
    with open(result_path) as handle:
        return 0, json.load(handle)


def _report(single: dict[str, Any], many: dict[str, Any], replicas: int, seconds: float) -> Any:
    from rich.table import Table

    efficiency = many["images_per_second"] / replicas / single["images_per_second"]
    before, after = single["images_per_second_runs"]
    table = Table(title=f"ResNet on digits: {replicas} replicas vs 1, one thread each")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("test accuracy", f"{100 * many['test_accuracy']:.2f}% (target {100 * ACCURACY_TARGET:.0f}%)")
    table.add_row("images/s, 1 replica",
                  f"{single['images_per_second']:,.0f} (before {before:,.0f}, after {after:,.0f})")
    table.add_row(f"images/s, {replicas} replicas", f"{many['images_per_second']:,.0f}")
    table.add_row("weak-scaling efficiency", f"{100 * efficiency:.1f}%")
    table.add_row("step time, 1 / N replicas", f"{single['step_time_ms']:.1f} ms / {many['step_time_ms']:.1f} ms")
    table.add_row("communication share of step time", f"{100 * many['communication_share']:.1f}%")
    table.add_row("per-replica batch", str(many["per_replica_batch"]))
    table.add_row("training steps", f"{many['steps']} ({many['epochs']} epochs)")
    table.add_row("demo wall time", f"{seconds:.0f} s")
    return table


def run_demo(replicas: int = 2, epochs: int = 12) -> int:
    """Measure one replica, train with `replicas`, print the table; 0 when accuracy reaches the target."""
    from rich.console import Console

    console = Console()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="replicator-demo-") as scratch:
        def time_one_replica(when: str) -> tuple[int, dict[str, Any] | None]:
            console.print(f"[bold]{when}[/bold] timing 1 replica for {TIMING_STEPS} steps "
                          f"of {PER_REPLICA_BATCH} images")
            return _train(1, ["--steps", str(TIMING_STEPS), "--global-batch", str(PER_REPLICA_BATCH)],
                          os.path.join(scratch, f"one-{when[0]}.json"))

        # Timing 1 replica both before and after the N-replica training brackets it in
        # time, so load from other jobs that drifts during the demo weighs on both sides.
        code, before = time_one_replica("1/3")
        if before is None:
            console.print("[red]the 1-replica timing run failed[/red]")
            return code
        console.print(f"[bold]2/3[/bold] training on {replicas} replicas for {epochs} epochs")
        code, many = _train(
            replicas, ["--epochs", str(epochs), "--global-batch", str(PER_REPLICA_BATCH * replicas)],
            os.path.join(scratch, "many.json"),
        )
        if many is None:
            console.print(f"[red]the {replicas}-replica training run failed[/red]")
            return code
        code, after = time_one_replica("3/3")
        if after is None:
            console.print("[red]the 1-replica timing run failed[/red]")
            return code
    runs = [before["images_per_second"], after["images_per_second"]]
    single = {**before, "images_per_second": sum(runs) / 2, "images_per_second_runs": runs,
              "step_time_ms": (before["step_time_ms"] + after["step_time_ms"]) / 2}
    console.print(_report(single, many, replicas, time.perf_counter() - started))
    records = [run["run_dir"] for run in (before, many) if run.get("run_dir")]
    if len(records) == 2:
        console.print(f"The runs are recorded in {records[0]} and {records[1]}: "
                      f"`replicator report {' '.join(records)}` summarizes and plots them.")
    if many["test_accuracy"] < ACCURACY_TARGET:
        console.print(f"[red]test accuracy {100 * many['test_accuracy']:.2f}% "
                      f"is below {100 * ACCURACY_TARGET:.0f}%[/red]")
        return 1
    return 0
