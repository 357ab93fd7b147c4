"""Does `replicator plan` predict the simulated cluster? Predicted against measured steps, flat and hierarchical.

Command (from the repository root, as root; about a minute on 2 cores; figures go to
benchmarks/results/plan_vs_cluster.json):

    .venv/bin/python benchmarks/plan_vs_cluster.py

On a SimulatedCluster of 2 nodes x 2 processes with `--link-mbit` links this measures, in one
job:
  - the intra-node tier: a Gloo all-reduce inside each node (both nodes at once, as in a
    hierarchical all-reduce), 4 KiB - 8 MiB, fitted to T = 2α + S/β (calibrate.fit_alpha_beta);
  - the inter-node latency: the same fit across nodes (one process of each node per pair, both
    pairs at once); its bandwidth is NOT taken from the fit but from the link's description:
    the tbf line rate times the share of it TCP payload can use (95.6% at MTU 1500), the
    figure a user gets from iperf or a NIC's goodput specification;
  - compute: the same training step with no communication, all 4 processes at once, which
    sets the achieved FLOP/s the planner's Accelerator is given (so forward + backward of the
    model reproduce it; the optimizer's update is folded into backward);
  - conversion, for the compressed reducer: a 4 MiB cast to fp16 in all 4 processes at once
    (calibrate.measure_cast, the slowest process's fastest of ten), and the same intra-node
    all-reduce in fp16 at 2 and 8 MiB, whose time beyond what the fp32 fit gives its bytes is
    Gloo's fp16 summing (calibrate.fit_fp16_sum_rate);
  - the step time with each reducer (benchmarks/allreduce.py's measure_steps, interleaved, medians).
Then the planner (replicator.plan.predict) describes the cluster with Cluster.two_level and
predicts each step; the relative error is (predicted - measured) / measured, target |error| <= 15%.
The ordering case: the reducers ranked by predicted step must be ranked the same by measured step
(`--fp16`, on by default, adds the compressed flat reducer so that three configurations are ranked;
reducers whose measured medians lie within 3% of each other count as tied and may come in either
order; the order is also judged on paired repetitions, the median of per-repetition ratios).
For reference it also prints three variants: no overlap of communication with backward
(Accelerator.overlap = 0: what other load on the cores pushes the cluster towards, since Gloo's
copies and the kernel's network stack then take cycles from the backward pass), the inter-node
bandwidth set to the raw line rate (headers then count as payload), and compute from a
512x512 matmul's FLOP/s (what `replicator plan --calibrate` measures; fastest of ten, in all
4 processes at once) instead of from the model's own step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from _harness import add_json_argument, load_average, machine, machine_line, slowest_rank, write_json
from allreduce import NO_COMMUNICATION, Config, forward_flops_per_sample, gradient_bytes, measure_steps

from replicator.plan import Accelerator, Cluster, ReduceAlgorithm, Workload, predict
from replicator.plan.calibrate import fit_alpha_beta, fit_fp16_sum_rate, measure_cast, measure_matmul_flops
from replicator.testing.cluster import SimulatedCluster, cluster_available
from replicator.topology import build_process_groups, discover

KiB, MiB = 1 << 10, 1 << 20
INTRA_SIZES = (4 * KiB, 64 * KiB, 512 * KiB, 2 * MiB, 8 * MiB)
INTER_SIZES = (4 * KiB, 64 * KiB, 512 * KiB, 2 * MiB)
FP16_SIZES = (2 * MiB, 8 * MiB)  # fp32 bytes of the elements summed in fp16
# replicator's reducer -> the planner's: a Gloo all-reduce over the world is a ring in rank order.
PLANNED = {"flat": ReduceAlgorithm("flat-ring", "ring"),
           "hierarchical": ReduceAlgorithm("hierarchical", "hierarchical"),
           "fp16": ReduceAlgorithm("flat-ring+fp16", "ring", gradient_bytes=2)}
TARGET = 0.15
# Measured medians closer than this are a tie: the ordering check does not ask the model to split them.
TIE = 0.03


def ordering(rows: list[dict[str, Any]], times: dict[str, list[float]] | None = None
             ) -> tuple[list[str], list[str], bool, bool]:
    """(reducers by predicted step, by measured step, whether the model's order matches the measured medians',
    whether it matches the paired repetitions').

    Two reducers whose measured medians lie within TIE of each other may come in either order.
    Paired: the phases run interleaved, so repetition i of two reducers saw the same load; their
    order holds if the median of the per-repetition ratios is within TIE of it (load that drifts
    between repetitions moves both sides of a ratio, not the median of one list against another's).
    """
    predicted = [row["reducer"] for row in sorted(rows, key=lambda row: row["predicted_s"])]
    measured = [row["reducer"] for row in sorted(rows, key=lambda row: row["measured_s"])]
    by_name = {row["reducer"]: row["measured_s"] for row in rows}
    pairs = [(first, second) for i, first in enumerate(predicted) for second in predicted[i + 1:]]
    by_medians = all(by_name[first] <= by_name[second] * (1 + TIE) for first, second in pairs)
    by_pairs = by_medians
    if times is not None:
        by_pairs = all(statistics.median(a / b for a, b in zip(times[first], times[second])) <= 1 + TIE
                       for first, second in pairs)
    return predicted, measured, by_medians, by_pairs


def payload_share(mtu: int) -> float:
    """TCP payload per byte on the wire at layer 2 (what tbf counts): MSS (MTU - 20 IP - 32 TCP with
    timestamps) over the frame (MTU + 14 Ethernet header). 1448/1514 = 95.6% at MTU 1500."""
    return (mtu - 52) / (mtu + 14)


def _group_times(group: Any, sizes: tuple[int, ...], repeats: int,
                 dtype: torch.dtype = torch.float32) -> list[tuple[int, float]]:
    """(bytes, median seconds) of an all-reduce on `group`, every rank's group at once, slowest rank per repeat.

    `sizes` are fp32 bytes; the buffer holds as many elements in `dtype`, whose bytes are reported."""
    samples = []
    for nbytes in sizes:
        buffer = torch.zeros(nbytes // 4, dtype=dtype)
        dist.all_reduce(buffer, group=group)
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            seconds.append(slowest_rank(time.perf_counter() - started))
        samples.append((buffer.numel() * buffer.element_size(), statistics.median(seconds)))
    return samples


def calibration_job(config: Config, repeats: int, reducers: tuple[str, ...]) -> dict[str, Any]:
    torch.set_num_threads(1)
    groups = build_process_groups(discover())
    intra = _group_times(groups.intra_node, INTRA_SIZES, repeats)
    inter = _group_times(groups.inter_node, INTER_SIZES, repeats)
    fp16 = _group_times(groups.intra_node, FP16_SIZES, repeats, torch.float16) if "fp16" in reducers else []
    dist.barrier()
    # Every process at once: the share of the cores each one gets; the slowest process's.
    measured = torch.tensor([measure_matmul_flops(), measure_cast()])
    dist.all_reduce(measured, op=dist.ReduceOp.MIN)
    steps = measure_steps(config, reducers)
    return {"intra": intra, "inter": inter, "fp16_intra": fp16, "matmul_flops": float(measured[0]),
            "cast_bandwidth": float(measured[1]), "steps": steps}


def predictions(config: Config, calibration: dict[str, Any], reducers: tuple[str, ...]) -> list[dict[str, Any]]:
    intra_alpha, intra_beta = fit_alpha_beta(calibration["intra"], 2)
    inter_alpha, inter_beta_fit = fit_alpha_beta(calibration["inter"], 2)
    fp16_sum_rate = fit_fp16_sum_rate(calibration["fp16_intra"], intra_alpha, intra_beta, 2)
    conversion = {"cast_bandwidth": calibration["cast_bandwidth"], "fp16_sum_rate": fp16_sum_rate}
    line_rate = config.link_mbit * 1e6 / 8
    goodput = line_rate * payload_share(config.mtu)
    cluster = Cluster.two_level(config.procs_per_node, intra_beta, intra_alpha, goodput, inter_alpha)
    # The same, told the raw line rate: how much of the error headers would make.
    raw = Cluster.two_level(config.procs_per_node, intra_beta, intra_alpha, line_rate, inter_alpha)
    times = calibration["steps"]["times"]
    compute = statistics.median(times[NO_COMMUNICATION])
    flops = forward_flops_per_sample(config)
    workload = Workload(params=gradient_bytes(config) / 4, flops_per_sample=flops, batch_per_gpu=config.batch)
    # Forward + backward = 3 forwards of FLOPs; the achieved rate that makes them last the measured step.
    fitted = Accelerator(peak_flops=3 * flops * config.batch / compute, efficiency=1.0, **conversion)
    serial = Accelerator(peak_flops=fitted.peak_flops, efficiency=1.0, overlap=0.0, **conversion)
    matmul = Accelerator(peak_flops=calibration["matmul_flops"], efficiency=1.0, **conversion)
    # What the model said before it charged for conversion (fp16 ranked by its bytes alone).
    free = Accelerator(peak_flops=fitted.peak_flops, efficiency=1.0)
    gpus = config.nodes * config.procs_per_node
    bucket = config.bucket_mb * MiB
    rows = []
    for name in reducers:
        measured = statistics.median(times[name])
        row: dict[str, Any] = {"reducer": name, "measured_s": measured,
                               "fit": {"intra_alpha_s": intra_alpha, "intra_beta": intra_beta,
                                       "inter_alpha_s": inter_alpha,
                                       "inter_beta_fitted": inter_beta_fit, "inter_beta_used": goodput,
                                       "inter_line_rate": line_rate, **conversion}}
        variants = (("predicted", fitted, cluster), ("predicted_no_overlap", serial, cluster),
                    ("predicted_line_rate", fitted, raw), ("predicted_matmul", matmul, cluster),
                    ("predicted_free_casts", free, cluster))
        for label, accelerator, described in variants:
            prediction = predict(workload, accelerator, described, gpus, PLANNED[name], bucket)
            row[label + "_s"] = prediction.step_time
            row[label + "_error"] = (prediction.step_time - measured) / measured
            if label == "predicted":
                row["planner_compute_s"] = prediction.step.compute
                row["planner_exposed_s"] = prediction.step.exposed
                row["planner_communication_s"] = prediction.step.communication
                row["planner_conversion_s"] = prediction.step.conversion
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mbit", type=float, default=1000.0, help="each node's link, Mbit/s per direction")
    parser.add_argument("--batch", type=int, default=Config.batch, help="samples per replica per step")
    parser.add_argument("--bucket-mb", type=float, default=Config.bucket_mb, help="gradient bucket size (MiB)")
    parser.add_argument("--repeats", type=int, default=15,
                        help="repeats per calibration size (small messages' latency is noisy on shared cores)")
    parser.add_argument("--step-repeats", type=int, default=5, help="interleaved repetitions per reducer")
    parser.add_argument("--steps", type=int, default=Config.steps, help="timed steps per phase")
    parser.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True,
                        help="also compare fp16 compression (flat ring, 2-byte gradients; in the ordering case)")
    add_json_argument(parser, "plan_vs_cluster")
    options = parser.parse_args(argv)
    available, why = cluster_available()
    if not available:
        print(f"cannot build the simulated cluster: {why}", file=sys.stderr)
        return 2
    config = Config(link_mbit=options.link_mbit, batch=options.batch, bucket_mb=options.bucket_mb,
                    step_repeats=options.step_repeats, steps=options.steps)
    reducers = ("flat", "hierarchical", "fp16") if options.fp16 else ("flat", "hierarchical")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d cannot reverse-resolve peers inside a namespace
    header = machine()
    print(machine_line(header), flush=True)
    load_before = header["load_average"][0]
    with SimulatedCluster(config.nodes, config.procs_per_node, config.link_mbit, mtu=config.mtu) as cluster:
        results = cluster.run(calibration_job, config, options.repeats, reducers, timeout_s=1800.0)
    calibration = results[0]
    rows = predictions(config, calibration, reducers)
    fit = rows[0]["fit"]
    compute = statistics.median(calibration["steps"]["times"][NO_COMMUNICATION])
    lines = [
        f"Simulated cluster: {config.nodes} nodes x {config.procs_per_node} processes, "
        f"{config.link_mbit:g} Mbit/s links; "
        f"MLP {config.layers} x {config.width}x{config.width} + head, "
        f"{gradient_bytes(config) / MiB:.1f} MiB gradients, "
        f"batch {config.batch} per replica, {config.bucket_mb:g} MiB buckets",
        f"intra-node fit: α = {fit['intra_alpha_s'] * 1e6:.0f} µs, β = {fit['intra_beta'] / 1e9:.2f} GB/s; "
        f"inter-node fit (both pairs at once, sharing the link): α = {fit['inter_alpha_s'] * 1e6:.0f} µs, "
        f"β = {fit['inter_beta_fitted'] / 1e6:.1f} MB/s per pair "
        f"(the planner is given the TCP payload rate of the link, "
        f"{fit['inter_beta_used'] / 1e6:.1f} MB/s per node = {payload_share(config.mtu):.1%} of its line rate "
        f"{fit['inter_line_rate'] / 1e6:.1f} MB/s)",
        f"compute: step without communication {compute * 1e3:.1f} ms "
        f"(= {3 * forward_flops_per_sample(config) * config.batch / compute / 1e9:.1f} GFLOP/s per process); "
        f"512x512 matmul in 4 processes at once: {calibration['matmul_flops'] / 1e9:.1f} GFLOP/s per process",
        f"conversion: cast to fp16 {fit['cast_bandwidth'] / 1e9:.2f} GB/s of fp32 per process; Gloo's fp16 sums "
        f"{fit['fp16_sum_rate'] / 1e6:.1f} M elements/s beyond their bytes",
        "",
        "| reducer | measured step (ms) | predicted (ms) | error | of which compute / exposed comm. / conversion (ms) "
        "| with no overlap (ms) | error | at raw line rate (ms) | error | with matmul FLOP/s (ms) | error "
        "| with free casts (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['reducer']} | {row['measured_s'] * 1e3:.1f} | {row['predicted_s'] * 1e3:.1f} "
            f"| {row['predicted_error']:+.1%} "
            f"| {row['planner_compute_s'] * 1e3:.1f} / {row['planner_exposed_s'] * 1e3:.1f} "
            f"/ {row['planner_conversion_s'] * 1e3:.1f} "
            f"| {row['predicted_no_overlap_s'] * 1e3:.1f} | {row['predicted_no_overlap_error']:+.1%} "
            f"| {row['predicted_line_rate_s'] * 1e3:.1f} | {row['predicted_line_rate_error']:+.1%} "
            f"| {row['predicted_matmul_s'] * 1e3:.1f} | {row['predicted_matmul_error']:+.1%} "
            f"| {row['predicted_free_casts_s'] * 1e3:.1f} |")
    checked = [r for r in rows if r["reducer"] in ("flat", "hierarchical")]
    worst = max(abs(r["predicted_error"]) for r in checked)
    lines.append(f"\nTarget |error| <= {TARGET:.0%} for flat and hierarchical: worst {worst:.1%} -> "
                 f"{'met' if worst <= TARGET else 'NOT met'}")
    times = calibration["steps"]["times"]
    by_prediction, by_measurement, same_order, same_paired = ordering(rows, times)

    def verdict(same: bool) -> str:
        return "same" if same else "DIFFERENT"

    lines.append(f"Ordering of reducers (fastest first): predicted {' < '.join(by_prediction)}, measured "
                 f"{' < '.join(by_measurement)} -> by medians {verdict(same_order)}, by paired repetitions "
                 f"{verdict(same_paired)} (within {TIE:.0%} counts as a tie)")
    free_order = ordering([{**row, "predicted_s": row["predicted_free_casts_s"]} for row in rows], times)
    lines.append(f"  with conversion free (the model before it charged for casts): {' < '.join(free_order[0])} -> "
                 f"by medians {verdict(free_order[2])}, by paired repetitions {verdict(free_order[3])}")
    for name, value in calibration["steps"]["checks"].items():
        lines.append(f"  check: {name} = {value:.3g}")
    load_after = load_average()[0]
    lines.append(f"1-minute load average {load_before:.2f} before, {load_after:.2f} after, on {os.cpu_count()} cores")
    print("\n".join(lines), flush=True)
    report = {"config": asdict(config), "rows": rows,
              "calibration": {k: v for k, v in calibration.items() if k != "steps"},
              "step_times": calibration["steps"]["times"], "worst_error": worst, "met": worst <= TARGET,
              "ordering": {"predicted": by_prediction, "measured": by_measurement, "same": same_order,
                           "same_paired": same_paired, "predicted_free_casts": free_order[0],
                           "same_free_casts": free_order[2], "same_paired_free_casts": free_order[3]},
              "load_average_1min": {"before": load_before, "after": load_after}}
    write_json(options.json, report, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
