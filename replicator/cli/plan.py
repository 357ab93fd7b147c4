"""`replicator plan`: predict step time, throughput and scaling efficiency, and recommend a configuration."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from replicator.cli._plan_memory import memory_record, print_memory
from replicator.plan import presets, published
from replicator.plan.conversion import cast_bandwidth_from_memory
from replicator.plan.memory import OPTIMIZER_STATES
from replicator.plan.planner import (
    BY_ALGORITHM,
    MB,
    REDUCERS,
    Cluster,
    Plan,
    Prediction,
    gpu_counts,
    plan,
    with_compression,
)
from replicator.plan.profile import FIRST_BUCKET_BYTES, GradientProfile, from_factory
from replicator.plan.step import Accelerator, Workload
from replicator.plan.transports import TRANSPORTS

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["add_parser", "add_arguments", "main"]

_SUFFIXES = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}
# Bytes per gradient element for --gradient-dtype.
_GRADIENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _quantity(text: str) -> float:
    """A positive number, optionally with a k/M/G (or B, billions)/T suffix: 25.6M, 7B, 8.2e9, 4.1G."""
    cleaned = text.strip()
    scale = _SUFFIXES.get(cleaned[-1:].lower(), 1.0)
    if scale != 1.0:
        cleaned = cleaned[:-1]
    try:
        value = float(cleaned) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 25.6M, 7B or 8.2e9, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive(text: str) -> float:
    """A number > 0 (argparse names the flag in its error)."""
    if not (value := _number(text)) > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    """A number >= 0 (argparse names the flag in its error)."""
    if not (value := _number(text)) >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes such as 3,224,224, got {text!r}") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes such as 3,224,224, got {text!r}")
    return dims


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` subcommand's options. Defaults describe the PowerAI DDL cluster (P100, NVLink, EDR)."""
    model = parser.add_argument_group("model (a preset, --model-from, or --params and --flops-per-sample)")
    model.add_argument("--model", choices=sorted(presets.MODELS), default=None,
                       help="a named network with its published size and its layers (default: resnet50)")
    model.add_argument("--model-from", default=None, metavar="PACKAGE.MODULE:FACTORY",
                       help="build this torch.nn.Module on the meta device and read its parameters per layer")
    model.add_argument("--input-shape", type=_shape, default=None, metavar="3,224,224",
                       help="one sample's input shape for --model-from; given, its FLOPs are counted")
    model.add_argument("--input-dtype", default="float32", help="dtype of that input: float32, or long for tokens")
    model.add_argument("--params", type=_quantity, default=None, help="gradient elements, e.g. 25.6M or 7B")
    model.add_argument("--flops-per-sample", type=_quantity, default=None,
                       help="forward FLOPs per sample (a multiply-add is 2), e.g. 8.2G")
    model.add_argument("--batch-per-gpu", type=_count, default=32, help="samples per GPU per step (default: 32)")
    model.add_argument("--gradient-dtype", choices=sorted(_GRADIENT_BYTES), default="float32",
                       help="the type the model's parameters and gradients are in, hence on the wire with no "
                            "conversion, and in the memory table "
                            "(float16 or bfloat16 for a model trained in 16 bits; --fp16 weighs compressing "
                            "float32 gradients instead) (default: float32)")
    model.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adam",
                       help="the optimizer, for the memory table: adam (Adam/AdamW, 2 states per parameter), "
                            "momentum (SGD with momentum, 1) or sgd (none) (default: adam)")
    model.add_argument("--memory-per-gpu", type=_positive, default=None, metavar="GB",
                       help="GB (1e9 bytes) of one GPU's memory for model state: name the least sharded "
                            "shard level that fits")
    measured = model.add_mutually_exclusive_group()
    measured.add_argument("--samples-per-s", type=_positive, default=None,
                          help="training throughput measured on one device at --batch-per-gpu; replaces the "
                               "FLOPs estimate")
    measured.add_argument("--step-ms", type=_positive, default=None,
                          help="one training step measured on one device at --batch-per-gpu, in ms")

    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus-per-node", type=_count, default=4, help="GPUs in one node (default: 4)")
    cluster.add_argument("--intra-bw", type=_positive, default=presets.NVLINK1_GPU_PAIR.value / 1e9,
                         help="GB/s one way between GPUs of a node, line rate (default: 40, two NVLink 1.0 links)")
    cluster.add_argument("--intra-transport", choices=sorted(TRANSPORTS), default="nvlink",
                         help="what links GPUs in a node; sets the achieved share of --intra-bw (default: nvlink)")
    cluster.add_argument("--intra-efficiency", type=_fraction, default=None,
                         help="achieved share of --intra-bw, overriding the transport's default")
    cluster.add_argument("--intra-latency", type=float, default=round(presets.INTRA_NODE_LATENCY * 1e6, 6),
                         help="µs per message step inside a node (default: 5)")
    cluster.add_argument("--inter-bw", type=_positive, default=presets.INFINIBAND_EDR.value / 1e9,
                         help="GB/s one way of a node's network port, line rate, shared by its GPUs "
                              "(default: 12.5, 100 Gbit/s)")
    cluster.add_argument("--inter-transport", choices=sorted(TRANSPORTS), default="infiniband",
                         help="what links nodes; sets the achieved share of --inter-bw (default: infiniband)")
    cluster.add_argument("--inter-efficiency", type=_fraction, default=None,
                         help="achieved share of --inter-bw, overriding the transport's default")
    cluster.add_argument("--inter-latency", type=float, default=round(presets.NETWORK_LATENCY * 1e6, 6),
                         help="µs per message step across the network (default: 10)")
    cluster.add_argument("--gpu-flops", type=_positive, default=presets.P100_SXM2_FP32.value / 1e12,
                         help="peak TFLOP/s of one GPU (default: 10.6, P100 fp32)")
    cluster.add_argument("--memory-bw", type=_positive, default=presets.P100_SXM2_MEMORY.value / 1e9,
                         help="GB/s of one GPU's memory: sets what casting gradients to fp16 and back costs "
                              "with --fp16 (default: 732, P100)")
    cluster.add_argument("--efficiency", type=_fraction, default=presets.COMPUTE_EFFICIENCY,
                         help="fraction of peak a real model achieves, when no throughput is measured (default: 0.5)")
    cluster.add_argument("--overlap", type=float, default=1.0 - presets.INTERFERENCE,
                         help="share of the ideal overlap of gradient all-reduce with backward that happens, "
                              "1 − the interference: towards 0 where communication competes with compute for "
                              f"the same cores (default: {1.0 - presets.INTERFERENCE:g}, the interference "
                              f"{presets.INTERFERENCE:g} fitted to the published results, as --reproduce uses)")
    cluster.add_argument("--max-gpus", type=_count, default=256, help="largest GPU count to plan for (default: 256)")

    choices = parser.add_argument_group("what to consider")
    choices.add_argument("--bucket-mb", type=_positive, default=None,
                         help="fix the gradient bucket, MiB (default: search 1-256 and the whole gradient)")
    choices.add_argument("--first-bucket-mb", type=_positive, default=FIRST_BUCKET_BYTES / MB,
                         help="the first bucket backward fills, MiB (default: 1, the runtime's; a system "
                              "without a small first message, as Horovod's fusion buffer: the bucket size)")
    choices.add_argument("--all-reduce", action="append", choices=sorted(BY_ALGORITHM), default=None,
                         help="the all-reduce algorithm to price, repeatable (default: ring and hierarchical, "
                              "what Replicator's 'flat' and 'hierarchical' reducers run; rhd: recursive "
                              "halving-doubling, for a backend that runs it)")
    choices.add_argument("--baseline-gpus", type=_count, default=1,
                         help="report scaling efficiency against this many GPUs, e.g. one node (default: 1)")
    choices.add_argument("--fp16", action="store_true", help="also consider fp16 gradient compression")
    choices.add_argument("--max-stages", type=_count, default=1,
                         help="also consider pipelines up to K stages (default: 1)")
    choices.add_argument("--recompute", action="store_true", help="pipelines re-materialize activations (GPipe)")
    choices.add_argument("--activation-mb", type=_non_negative, default=0.0,
                         help="MB per sample that crosses a pipeline stage boundary (default: 0)")
    choices.add_argument("--calibrate", action="store_true",
                         help="measure this machine (matmul FLOP/s, fp16 casts, loopback Gloo α/β and fp16 sums) "
                              "and plan for nodes like it")
    choices.add_argument("--json", action="store_true",
                         help="print every prediction as a JSON list (gpus, reducer, bucket_cap_mb, step_s, "
                              "efficiency, ...) instead of tables")
    choices.add_argument("--reproduce", action="store_true",
                         help="print the model's predictions for the published scaling results, then exit")


def _profile(options: argparse.Namespace) -> tuple[str, GradientProfile | None, float | None, float | None]:
    """(name, profile, params, forward FLOPs per sample) from --model, --model-from or --params."""
    sources = [flag for flag, value in (("--model", options.model), ("--model-from", options.model_from),
                                        ("--params", options.params)) if value is not None]
    if len(sources) > 1:
        raise ValueError(f"give one of --model, --model-from and --params, not {' and '.join(sources)}")
    if options.input_shape is not None and options.model_from is None:
        raise ValueError("--input-shape describes the input of --model-from; give --model-from too")
    if options.model_from is not None:
        profile = from_factory(load_factory(options.model_from), options.model_from, options.input_shape,
                               options.input_dtype)
        return options.model_from, profile, float(profile.params), profile.forward_flops
    if options.params is not None:
        return "custom", None, options.params, None
    preset = presets.MODELS[options.model or "resnet50"]
    return preset.name, preset.profile(), float(preset.params), preset.forward_flops


def _workload(options: argparse.Namespace) -> tuple[str, Workload]:
    name, profile, params, flops = _profile(options)
    if options.flops_per_sample is not None:
        flops = options.flops_per_sample
    step_s = options.step_ms / 1e3 if options.step_ms is not None else None
    if options.samples_per_s is not None:
        step_s = options.batch_per_gpu / options.samples_per_s
    if flops is None and step_s is None:
        what = "--model-from without --input-shape" if options.model_from else "--params"
        raise ValueError(f"{what} says nothing about compute: add --flops-per-sample, --samples-per-s or --step-ms")
    assert params is not None
    return name, Workload(params, flops, options.batch_per_gpu, _GRADIENT_BYTES[options.gradient_dtype],
                          activation_bytes_per_sample=options.activation_mb * MB, step_s=step_s, profile=profile)


def _console() -> Console:
    # rich is imported here, not at the top: `replicator --help` should not pay for it.
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _cell(prediction: Prediction, efficiency: float) -> str:
    bucket = "" if prediction.gpus == 1 else f" {prediction.bucket / MB:.3g}MB"
    return f"{efficiency:.1%} {prediction.step_time * 1e3:.1f}ms{bucket}"


def _efficiency(result: Plan, prediction: Prediction, baseline_gpus: int) -> float:
    """Scaling efficiency against `baseline_gpus` (the recommended configuration there), per GPU at the same batch;
    against one GPU that is `Prediction.efficiency`."""
    if baseline_gpus == 1:
        return prediction.efficiency
    return result.recommended[baseline_gpus].step_time / prediction.step_time


def _rate(samples_per_second: float) -> str:
    return f"{samples_per_second:,.0f}" if samples_per_second >= 100 else f"{samples_per_second:.3g}"


def _arguments(prediction: Prediction) -> str:
    """The recommended configuration as `rp.Replicator(...)` arguments, ready to paste."""
    if prediction.gpus == 1:
        return "one GPU, no communication"
    pipe = prediction.pipeline
    shape = f"reducer={prediction.reducer!r}, bucket_cap_mb={prediction.bucket_cap_mb:g}"
    return shape if pipe.stages == 1 else f"{shape}, stages={pipe.stages}, chunks={pipe.micro_batches}"


def _print_plan(result: Plan, reducers: list[str], title: str, baseline_gpus: int) -> None:
    from rich.table import Table

    configurations = result.configurations()
    # A runtime reducer more than one cost model stands for says which of them its cell shows.
    shared = {r for r in reducers if len({p.algorithm.algorithm for p in result.predictions.values()
                                          if p.reducer == r}) > 1}
    table = Table(title=title)
    against = "" if baseline_gpus == 1 else f" vs {baseline_gpus}"
    table.add_column("GPUs", justify="right")
    for reducer in reducers:
        # What Replicator(reducer=...) takes, then what each cell holds.
        table.add_column(f"{reducer}\neff.{against} step bucket" + (" (model)" if reducer in shared else ""),
                         justify="right")
    table.add_column("recommended", justify="left")
    table.add_column("samples/s", justify="right")
    for gpus in result.gpu_counts:
        best = result.recommended[gpus]
        row = [str(gpus)]
        for reducer in reducers:
            prediction = configurations[(gpus, reducer, 1, 1)]
            algorithm = f" {prediction.algorithm.algorithm}" if reducer in shared and gpus > 1 else ""
            row.append(_cell(prediction, _efficiency(result, prediction, baseline_gpus)) + algorithm)
        table.add_row(*row, _arguments(best), _rate(best.throughput))
    console = _console()
    console.print(table)
    top = result.recommended[result.gpu_counts[-1]]
    step = top.step
    console.print(
        f"Recommendation at {top.gpus} GPUs: rp.Replicator({_arguments(top)}) — step {top.step_time * 1e3:.1f} ms "
        f"(compute {step.compute * 1e3:.1f}, bubble {step.bubble * 1e3:.1f}, exposed communication "
        f"{step.exposed * 1e3:.1f} of {step.communication * 1e3:.1f} ms, of which the last bucket's tail "
        f"{step.tail * 1e3:.1f}), {_rate(top.throughput)} samples/s, "
        f"{_efficiency(result, top, baseline_gpus):.1%} scaling efficiency vs {baseline_gpus} "
        f"GPU{'s' if baseline_gpus > 1 else ''}."
    )


def _print_reproduction() -> None:
    from rich.table import Table

    fitted = published.MODEL
    table = Table(title=f"Published scaling results against this model (interference {fitted.interference:g}; "
                        "inputs: replicator/plan/published.py; † outside the model)")
    for column in ("case", "GPUs", "reducer", "step", "exposed", "tail", "predicted", "published", "error"):
        table.add_column(column, justify="left" if column in ("case", "reducer") else "right")
    for case in published.PUBLISHED_CASES:
        p = case.prediction(fitted)
        efficiency = case.predict(fitted)
        table.add_row(case.key + (" †" if case.outside else ""), str(case.gpus), case.algorithm.reducer,
                      f"{p.step_time * 1e3:.1f} ms", f"{p.step.exposed * 1e3:.1f} ms", f"{p.step.tail * 1e3:.1f} ms",
                      f"{efficiency:.1%}", f"{case.published_efficiency:.1%}",
                      f"{(efficiency - case.published_efficiency) * 100:+.1f} pt")
    _console().print(table)


def _cluster(options: argparse.Namespace, gpu_flops: float, intra_bw: float, intra_latency: float,
             intra_efficiency: float | None, conversion: tuple[float, float]) -> tuple[Accelerator, Cluster]:
    if options.max_gpus > options.gpus_per_node and options.max_gpus % options.gpus_per_node:
        raise ValueError(f"--max-gpus {options.max_gpus} does not fill whole nodes of --gpus-per-node "
                         f"{options.gpus_per_node}; use a multiple of {options.gpus_per_node}")
    if options.intra_latency < 0 or options.inter_latency < 0:
        raise ValueError("--intra-latency and --inter-latency must be >= 0 µs")
    if intra_efficiency is None:
        intra_efficiency = options.intra_efficiency or TRANSPORTS[options.intra_transport].efficiency
    inter_efficiency = options.inter_efficiency or TRANSPORTS[options.inter_transport].efficiency
    try:
        accelerator = Accelerator(gpu_flops, options.efficiency, options.overlap, *conversion)
    except ValueError as error:
        raise ValueError(f"--overlap: {error}") from None
    # µs to s by division: 5 / 1e6 is the float 5e-6 the published rows use, 5 * 1e-6 is one ulp off it.
    cluster = Cluster.two_level(options.gpus_per_node, intra_bw, intra_latency, options.inter_bw * 1e9,
                                options.inter_latency / 1e6, intra_efficiency, inter_efficiency)
    return accelerator, cluster


def main(options: argparse.Namespace) -> int:
    """Run `replicator plan`; 0 on success, 2 on bad input, 1 if calibration fails (the reason goes to stderr)."""
    try:
        if options.reproduce:
            _print_reproduction()
            return 0
        name, workload = _workload(options)
        gpu_flops, intra_bw = options.gpu_flops * 1e12, options.intra_bw * 1e9
        intra_latency = options.intra_latency / 1e6
        intra_efficiency = None
        # A GPU casts at memory speed and NCCL sums fp16 natively; --calibrate measures both here.
        conversion = (cast_bandwidth_from_memory(options.memory_bw * 1e9), math.inf)
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
            # What was measured is what is achieved: no further share of a line rate applies.
            gpu_flops, intra_bw, intra_latency, intra_efficiency = (measured.matmul_flops, measured.beta,
                                                                    measured.alpha, 1.0)
            conversion = (measured.cast_bandwidth, measured.fp16_sum_rate)
            (sys.stderr if options.json else sys.stdout).write(
                f"Calibrated: matmul {measured.matmul_flops / 1e9:.1f} GFLOP/s; loopback Gloo all-reduce over "
                f"{measured.world_size} processes: α = {measured.alpha * 1e6:.1f} µs, "
                f"β = {measured.beta / 1e9:.2f} GB/s achieved (used for the intra-node tier); casts to fp16 "
                f"{measured.cast_bandwidth / 1e9:.1f} GB/s of fp32, fp16 sums "
                f"{measured.fp16_sum_rate / 1e6:.0f} M elements/s beyond their bytes.\n")
        accelerator, cluster = _cluster(options, gpu_flops, intra_bw, intra_latency, intra_efficiency, conversion)
        counts = _counts(cluster, options.max_gpus, options.baseline_gpus)
        chosen = REDUCERS if options.all_reduce is None else tuple(
            BY_ALGORITHM[name] for name in dict.fromkeys(options.all_reduce))
        reducers = with_compression(chosen) if options.fp16 else chosen
        buckets = None if options.bucket_mb is None else [options.bucket_mb * MB]
        result = plan(workload, accelerator, cluster, counts, reducers, buckets, options.max_stages, options.recompute,
                      first_bucket=options.first_bucket_mb * MB)
        if workload.step_s is None:
            _warn_flops(workload, accelerator)
        if options.json:
            records = _records(result, options.baseline_gpus)
            for record in records:
                record["memory"] = memory_record(workload, options, _GRADIENT_BYTES[options.gradient_dtype],
                                                 int(record["gpus"]),  # type: ignore[call-overload]
                                                 int(record["stages"]))  # type: ignore[call-overload]
            print(json.dumps(records, indent=1))
            return 0
        compute = (f"{workload.batch_per_gpu / workload.step_s:,.1f} samples/s measured" if workload.step_s
                   else f"{(workload.flops_per_sample or 0) / 1e9:.2f} GFLOP/sample (estimated)")
        title = (f"{name}: {workload.params / 1e6:,.1f} M params, {compute}, batch {workload.batch_per_gpu}/GPU, "
                 f"{options.gpus_per_node} GPUs/node, interference {1 - accelerator.overlap:.4g}")
        _print_plan(result, list(dict.fromkeys(r.reducer for r in reducers)), title, options.baseline_gpus)
        print_memory(workload, options, _GRADIENT_BYTES[options.gradient_dtype], result.gpu_counts, _console())
        return 0
    except ValueError as error:
        print(f"replicator plan: {error}", file=sys.stderr)
        return 2


def _counts(cluster: Cluster, max_gpus: int, baseline_gpus: int) -> list[int]:
    """The GPU counts to plan for, the baseline among them."""
    counts = gpu_counts(cluster, max_gpus)
    if baseline_gpus not in counts:
        if baseline_gpus > max_gpus:
            raise ValueError(f"--baseline-gpus {baseline_gpus} is above --max-gpus {max_gpus}")
        try:
            cluster.levels(baseline_gpus)
        except ValueError as error:  # a count that does not fill whole nodes: the message names the unit
            raise ValueError(f"--baseline-gpus {baseline_gpus}: {error}") from None
        counts = sorted({*counts, baseline_gpus})
    return counts


def _warn_flops(workload: Workload, accelerator: Accelerator) -> None:
    """Say on stderr that compute is an estimate: the figures published rows validate come from measured steps."""
    print(f"replicator plan: warning: compute is estimated from FLOPs ({(workload.flops_per_sample or 0) / 1e9:.3g} "
          f"GFLOP per sample at {accelerator.achieved_flops / 1e12:.3g} TFLOP/s achieved), not measured. Real "
          "layers run far from it (VGG-16 on a P100: 57 images/s estimated at 50% of peak, 132 measured), and "
          "slower compute hides more communication, so scaling comes out too good; the published results were "
          "reproduced from measured steps. Time a few steps on one device and give --samples-per-s or --step-ms.",
          file=sys.stderr)


def _records(result: Plan, baseline_gpus: int = 1) -> list[dict[str, object]]:
    """One record per configuration a user can paste (GPU count × runtime reducer, and recommended pipelines),
    marked as recommended or not; `algorithm` names the cost model that predicted it. `efficiency` is against
    one GPU, `baseline_efficiency` against `baseline_gpus`."""
    recommended = {id(p) for p in result.recommended.values()}
    records = [{**prediction.to_dict(), "recommended": id(prediction) in recommended,
                "baseline_gpus": baseline_gpus, "baseline_efficiency": _efficiency(result, prediction, baseline_gpus)}
               for _, prediction in sorted(result.configurations().items(), key=lambda item: item[0])]
    return records


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `replicator plan` with its options; the parsed options run `main`."""
    parser = commands.add_parser(
        "plan", help="predict scaling (alpha-beta model); recommend a reducer, bucket, pipeline"
    )
    add_arguments(parser)
    parser.set_defaults(run=main)


def load_factory(spec: str) -> Callable[[], object]:
    """The callable `package.module:factory` names: the one import of user code by name in replicator, asked for
    on the command line as `python -m` is."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"--model-from expects package.module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module raises while importing
        raise ValueError(f"--model-from {spec}: cannot import {module_name!r} ({type(error).__name__}: {error}); "
                         "is it on PYTHONPATH?") from error
    factory = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"--model-from {spec}: {module_name!r} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"--model-from {spec}: {attribute!r} is not callable")
    return factory
