"""`replicator plan`: predict step time, throughput and scaling efficiency, and recommend a configuration."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from replicator.plan import presets
from replicator.plan.planner import (
    MB,
    REDUCERS,
    Cluster,
    Plan,
    Prediction,
    ReduceAlgorithm,
    gpu_counts,
    plan,
    with_compression,
)
from replicator.plan.step import Accelerator, Workload

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["add_parser", "add_arguments", "main"]

_SUFFIXES = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def _quantity(text: str) -> float:
    """A positive number, optionally with a k/M/G/T suffix: 25.6M, 8.2e9, 4.1G."""
    cleaned = text.strip()
    scale = _SUFFIXES.get(cleaned[-1:].lower(), 1.0)
    if scale != 1.0:
        cleaned = cleaned[:-1]
    try:
        value = float(cleaned) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 25.6M or 8.2e9, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` subcommand's options. Defaults describe the PowerAI DDL cluster (P100, NVLink, EDR)."""
    model = parser.add_argument_group("model (a preset, or --params and --flops-per-sample)")
    model.add_argument("--model", choices=sorted(presets.MODELS), default=None,
                       help="a named network with its published parameter count and FLOPs (default: resnet50)")
    model.add_argument("--params", type=_quantity, default=None, help="gradient elements, e.g. 25.6M")
    model.add_argument("--flops-per-sample", type=_quantity, default=None,
                       help="forward FLOPs per sample (a multiply-add is 2), e.g. 8.2G")
    model.add_argument("--batch-per-gpu", type=int, default=32, help="samples per GPU per step (default: 32)")

    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus-per-node", type=int, default=4, help="GPUs in one node (default: 4)")
    cluster.add_argument("--intra-bw", type=float, default=presets.NVLINK1_GPU_PAIR.value / 1e9,
                         help="GB/s one way between GPUs of a node (default: 40, two NVLink 1.0 links)")
    cluster.add_argument("--intra-latency", type=float, default=presets.INTRA_NODE_LATENCY * 1e6,
                         help="µs per message step inside a node (default: 5)")
    cluster.add_argument("--inter-bw", type=float, default=presets.INFINIBAND_EDR.value / 1e9,
                         help="GB/s one way of a node's network port, shared by its GPUs (default: 12.5, 100 Gbit/s)")
    cluster.add_argument("--inter-latency", type=float, default=presets.NETWORK_LATENCY * 1e6,
                         help="µs per message step across the network (default: 10)")
    cluster.add_argument("--gpu-flops", type=float, default=presets.P100_SXM2_FP32.value / 1e12,
                         help="peak TFLOP/s of one GPU (default: 10.6, P100 fp32)")
    cluster.add_argument("--efficiency", type=float, default=presets.COMPUTE_EFFICIENCY,
                         help="fraction of peak a real model achieves (default: 0.5)")
    cluster.add_argument("--overlap", type=float, default=1.0,
                         help="share of the ideal overlap of gradient all-reduce with backward that happens: "
                              "1 when it has resources of its own (GPUs), towards 0 where it competes "
                              "with compute for the same cores (default: 1)")
    cluster.add_argument("--max-gpus", type=int, default=256, help="largest GPU count to plan for (default: 256)")

    choices = parser.add_argument_group("what to consider")
    choices.add_argument("--bucket-mb", type=float, default=None, help="fix the gradient bucket (default: search)")
    choices.add_argument("--fp16", action="store_true", help="also consider fp16 gradient compression")
    choices.add_argument("--max-stages", type=int, default=1,
                         help="also consider pipelines up to K stages (default: 1)")
    choices.add_argument("--recompute", action="store_true", help="pipelines re-materialize activations (GPipe)")
    choices.add_argument("--activation-mb", type=float, default=0.0,
                         help="MB per sample that crosses a pipeline stage boundary (default: 0)")
    choices.add_argument("--calibrate", action="store_true",
                         help="measure this machine (matmul FLOP/s, loopback Gloo α/β) and plan for nodes like it")
    choices.add_argument("--reproduce", action="store_true",
                         help="print the model's predictions for the published DDL and Horovod results, then exit")


def _workload(options: argparse.Namespace) -> Workload:
    if (options.params is None) != (options.flops_per_sample is None):
        raise ValueError("give both --params and --flops-per-sample, or a --model preset")
    if options.params is not None and options.model is not None:
        raise ValueError("give either --model or --params/--flops-per-sample, not both")
    if options.params is not None:
        params, flops = options.params, options.flops_per_sample
    else:
        preset = presets.MODELS[options.model or "resnet50"]
        params, flops = preset.params, preset.forward_flops
    return Workload(params, flops, options.batch_per_gpu, activation_bytes_per_sample=options.activation_mb * MB)


def _console() -> Console:
    # rich is imported here, not at the top: `replicator --help` should not pay for it.
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _cell(prediction: Prediction) -> str:
    bucket = "" if prediction.gpus == 1 else f" {prediction.bucket / MB:.3g}MB"
    return f"{prediction.efficiency:.1%} {prediction.step_time * 1e3:.1f}ms{bucket}"


def _rate(samples_per_second: float) -> str:
    return f"{samples_per_second:,.0f}" if samples_per_second >= 100 else f"{samples_per_second:.3g}"


def _shape(prediction: Prediction) -> str:
    """The recommended configuration as `rp.Replicator(...)` arguments, ready to paste."""
    if prediction.gpus == 1:
        return "one GPU, no communication"
    pipe = prediction.pipeline
    shape = f"reducer={prediction.reducer!r}, bucket_cap_mb={prediction.bucket / MB:.3g}"
    return shape if pipe.stages == 1 else f"{shape}, stages={pipe.stages}, chunks={pipe.micro_batches}"


def _print_plan(result: Plan, algorithms: list[ReduceAlgorithm], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("GPUs", justify="right")
    for algorithm in algorithms:
        # The model's name, then the runtime reducer that runs it (what Replicator(reducer=...) takes).
        table.add_column(f"{algorithm.name}\n{algorithm.reducer}\neff. step bucket", justify="right")
    table.add_column("recommended", justify="left")
    table.add_column("samples/s", justify="right")
    for gpus in result.gpu_counts:
        best = result.recommended[gpus]
        row = [str(gpus)] + [_cell(result.predictions[(gpus, algorithm.name)]) for algorithm in algorithms]
        table.add_row(*row, _shape(best), _rate(best.throughput))
    console = _console()
    console.print(table)
    top = result.recommended[result.gpu_counts[-1]]
    step = top.step
    console.print(
        f"Recommendation at {top.gpus} GPUs: {_shape(top)} — step {top.step_time * 1e3:.1f} ms "
        f"(compute {step.compute * 1e3:.1f}, bubble {step.bubble * 1e3:.1f}, exposed communication "
        f"{step.exposed * 1e3:.1f} of {step.communication * 1e3:.1f} ms), {_rate(top.throughput)} samples/s, "
        f"{top.efficiency:.1%} scaling efficiency vs 1 GPU."
    )


def _print_reproduction() -> None:
    from rich.table import Table

    table = Table(title="Published scaling results against this model (inputs: replicator/plan/presets.py)")
    for column in ("case", "GPUs", "algorithm", "bucket", "step", "exposed comm.", "predicted", "published", "diff."):
        table.add_column(column, justify="left" if column in ("case", "algorithm") else "right")
    for case in presets.PUBLISHED_CASES:
        p = case.predict()
        table.add_row(case.key, str(case.gpus), case.algorithm.name, f"{case.bucket / MB:g} MB",
                      f"{p.step_time * 1e3:.1f} ms", f"{p.step.exposed * 1e3:.1f} ms", f"{p.efficiency:.1%}",
                      f"{case.published_efficiency:.0%}", f"{(p.efficiency - case.published_efficiency) * 100:+.1f} pt")
    _console().print(table)


def main(options: argparse.Namespace) -> int:
    """Run `replicator plan`; 0 on success, 2 on bad input, 1 if calibration fails (the reason goes to stderr)."""
    try:
        if options.reproduce:
            _print_reproduction()
            return 0
        workload = _workload(options)
        gpu_flops, intra_bw = options.gpu_flops * 1e12, options.intra_bw * 1e9
        intra_latency = options.intra_latency * 1e-6
        if options.calibrate:
            from replicator.plan.calibrate import calibrate
            from replicator.testing import run_replicas

            try:
                measured = calibrate(run_replicas)
            except (AssertionError, TimeoutError, RuntimeError, OSError) as error:
                # ReplicaFailure is an AssertionError: a worker died or raised; say so in one line.
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                print(f"replicator plan: calibration failed ({type(error).__name__}: {first}); "
                      "plan without --calibrate or check that 2 local processes can use Gloo on 127.0.0.1",
                      file=sys.stderr)
                return 1
            gpu_flops, intra_bw, intra_latency = measured.matmul_flops, measured.beta, measured.alpha
            _console().print(
                f"Calibrated: matmul {measured.matmul_flops / 1e9:.1f} GFLOP/s; loopback Gloo all-reduce over "
                f"{measured.world_size} processes: α = {measured.alpha * 1e6:.1f} µs, "
                f"β = {measured.beta / 1e9:.2f} GB/s (used for the intra-node tier)."
            )
        if options.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {options.gpus_per_node}")
        accelerator = Accelerator(gpu_flops, options.efficiency, options.overlap)
        cluster = Cluster.two_level(options.gpus_per_node, intra_bw, intra_latency,
                                    options.inter_bw * 1e9, options.inter_latency * 1e-6)
        counts = gpu_counts(cluster, options.max_gpus)
        if not counts:
            raise ValueError(f"no GPU count up to {options.max_gpus} fills whole nodes of {options.gpus_per_node}")
        reducers = with_compression(REDUCERS) if options.fp16 else REDUCERS
        buckets = None if options.bucket_mb is None else [options.bucket_mb * MB]
        result = plan(workload, accelerator, cluster, counts, reducers, buckets, options.max_stages, options.recompute)
        name = options.model or ("custom" if options.params is not None else "resnet50")
        title = (f"{name}: {workload.params / 1e6:.1f} M params, {workload.flops_per_sample / 1e9:.2f} GFLOP/sample, "
                 f"batch {workload.batch_per_gpu}/GPU, {options.gpus_per_node} GPUs/node, "
                 f"overlap {accelerator.overlap:g}")
        _print_plan(result, list(reducers), title)
        return 0
    except ValueError as error:
        print(f"replicator plan: {error}", file=sys.stderr)
        return 2


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `replicator plan` with its options; the parsed options run `main`."""
    parser = commands.add_parser(
        "plan", help="predict scaling (alpha-beta model); recommend a reducer, bucket, pipeline"
    )
    add_arguments(parser)
    parser.set_defaults(run=main)
