"""The alpha–beta planner: hand-computed costs, the published DDL/Horovod results, and sanity of the model."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from replicator.cli.plan import add_arguments, main
from replicator.plan import presets, published
from replicator.plan.calibrate import calibrate, fit_alpha_beta
from replicator.plan.cost import (
    Level,
    all_reduce_time,
    flat_rhd_all_reduce,
    flat_ring_all_reduce,
    hierarchical_all_reduce,
    rhd_all_reduce,
    rhd_reduce_scatter,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from replicator.plan.planner import (
    MB,
    REDUCERS,
    Cluster,
    ReduceAlgorithm,
    best_bucket,
    gpu_counts,
    plan,
    predict,
)
from replicator.plan.step import (
    Accelerator,
    Pipeline,
    Workload,
    bucket_sizes,
    gpipe_bubble_fraction,
    overlap,
    step_time,
)
from replicator.testing import run_replicas

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALPHA, BETA, SIZE = 1e-5, 1e9, 1e6


# --- (a) cost formulas against hand-computed values -------------------------------------------


def test_ring_all_reduce_is_2_n_minus_1_alpha_plus_2_n_minus_1_over_n_bytes_over_beta() -> None:
    # 2·7·10 µs + 2·7/8 · 1 MB / 1 GB/s = 0.14 ms + 1.75 ms
    assert ring_all_reduce(8, SIZE, ALPHA, BETA) == pytest.approx(1.89e-3)
    assert ring_reduce_scatter(8, SIZE, ALPHA, BETA) == pytest.approx(0.945e-3)
    assert ring_all_gather(8, SIZE, ALPHA, BETA) == pytest.approx(0.945e-3)
    assert ring_all_reduce(1, SIZE, ALPHA, BETA) == 0.0


def test_recursive_halving_doubling_pays_log2_n_latencies() -> None:
    # 2·3·10 µs + 2·7/8 · 1 ms
    assert rhd_all_reduce(8, SIZE, ALPHA, BETA) == pytest.approx(6e-5 + 1.75e-3)
    assert rhd_reduce_scatter(8, SIZE, ALPHA, BETA) == pytest.approx(3e-5 + 0.875e-3)
    # 6 ranks: 2 extras fold into a group of 4 and get the result back, 2(α + S/β) more.
    assert rhd_all_reduce(6, SIZE, ALPHA, BETA) == pytest.approx(2 * 2 * ALPHA + 2 * 3 / 4 * 1e-3 + 2 * (ALPHA + 1e-3))
    with pytest.raises(ValueError, match="power-of-two"):
        rhd_reduce_scatter(6, SIZE, ALPHA, BETA)


DDL_LEVELS = [
    Level(4, 40e9, 5e-6, 1, "nvlink"),
    Level(64, 12.5e9, 10e-6, 4, "edr"),
]


def test_flat_ring_runs_at_the_slowest_link_and_latency() -> None:
    expected = 2 * 255 * 10e-6 + 2 * 255 / 256 * 100e6 / 12.5e9
    assert flat_ring_all_reduce(DDL_LEVELS, 100e6) == pytest.approx(expected)


def test_hierarchical_is_reduce_scatter_inside_all_reduce_across_all_gather_inside() -> None:
    s = 100e6
    inside = 3 * 5e-6 + 3 / 4 * s / 40e9  # one reduce-scatter (or all-gather) over NVLink
    # Each of the 4 GPUs all-reduces its quarter across 64 nodes; the 4 share the node's port.
    across = 2 * 63 * 10e-6 + 2 * 63 / 64 * (s / 4) / (12.5e9 / 4)
    assert hierarchical_all_reduce(DDL_LEVELS, s) == pytest.approx(2 * inside + across)


def test_three_level_x_y_z_shrinks_the_shard_at_every_level() -> None:
    levels = [Level(4, 40e9, 5e-6), Level(16, 12.5e9, 10e-6, 4), Level(4, 6.25e9, 20e-6, 4)]
    s = 64e6
    node = 3 * 5e-6 + 3 / 4 * s / 40e9
    rack = 15 * 10e-6 + 15 / 16 * (s / 4) / (12.5e9 / 4)
    spine = 2 * 3 * 20e-6 + 2 * 3 / 4 * (s / 64) / (6.25e9 / 4)
    assert hierarchical_all_reduce(levels, s) == pytest.approx(2 * node + 2 * rack + spine)


def test_flat_rhd_on_power_of_two_tiers_is_halving_tier_by_tier() -> None:
    s = 100e6
    inside = 2 * 5e-6 + 3 / 4 * s / 40e9
    across = 2 * 6 * 10e-6 + 2 * 63 / 64 * (s / 4) / (12.5e9 / 4)
    assert flat_rhd_all_reduce(DDL_LEVELS, s) == pytest.approx(2 * inside + across)
    assert all_reduce_time("rhd", DDL_LEVELS, s) == pytest.approx(2 * inside + across)


def test_cost_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        Level(4, 0.0, 1e-6)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
        all_reduce_time("butterfly", DDL_LEVELS, 1.0)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        ring_all_reduce(4, -1.0, ALPHA, BETA)
    assert all_reduce_time("hierarchical", [Level(1, 1e9, 1e-6)], 1e6) == 0.0


# --- the step model ---------------------------------------------------------------------------


def test_compute_time_is_flops_times_batch_over_achieved_flops_and_backward_is_twice_forward() -> None:
    work = Workload(params=1e6, flops_per_sample=2e9, batch_per_gpu=32)
    gpu = Accelerator(peak_flops=10e12, efficiency=0.5)
    step = step_time(work, gpu, None, bucket=1e6)
    assert step.forward == pytest.approx(2e9 * 32 / 5e12)
    assert step.backward == pytest.approx(2 * step.forward)
    assert step.total == pytest.approx(3 * step.forward)


def test_overlap_exposes_only_what_outlives_the_backward_pass() -> None:
    # 4 buckets of 25 bytes ready at 2.5, 5, 7.5 and 10 s; 2.5 s each on the wire: only the last one shows.
    exposed, busy = overlap(100.0, 25.0, 10.0, lambda nbytes: nbytes / 10)
    assert (exposed, busy) == pytest.approx((2.5, 10.0))
    # 5 s each: the stream falls behind, and everything after the first ready time queues up.
    exposed, busy = overlap(100.0, 25.0, 10.0, lambda nbytes: nbytes / 5)
    assert (exposed, busy) == pytest.approx((12.5, 20.0))
    # One bucket for the whole model: it is ready when backward ends, nothing overlaps.
    exposed, busy = overlap(100.0, 100.0, 10.0, lambda nbytes: nbytes / 10)
    assert exposed == pytest.approx(10.0)


def test_bucket_sizes_cover_the_gradient_exactly() -> None:
    assert bucket_sizes(100.0, 30.0) == [30.0, 30.0, 30.0, 10.0]
    assert bucket_sizes(90.0, 30.0) == [30.0, 30.0, 30.0]
    assert bucket_sizes(0.0, 30.0) == []
    assert bucket_sizes(100.0, 1e15) == [100.0]


def test_pipeline_bubble_is_k_minus_1_over_m_plus_k_minus_1() -> None:
    assert gpipe_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    work = Workload(params=1e6, flops_per_sample=1e9, batch_per_gpu=16)
    gpu = Accelerator(1e12)
    step = step_time(work, gpu, None, bucket=1e6, pipeline=Pipeline(stages=4, micro_batches=8))
    assert step.bubble / step.total == pytest.approx(3 / 11)
    # Same work per GPU as without a pipeline, just spread over M + K - 1 slots.
    assert step.compute == pytest.approx(step_time(work, gpu, None, bucket=1e6).compute)
    with_recompute = step_time(work, gpu, None, 1e6, Pipeline(4, 8, recompute=True))
    assert with_recompute.backward == pytest.approx(1.5 * step.backward)

def test_overlap_moves_exposed_communication_between_ideal_and_serial() -> None:
    work = Workload(params=25e6, flops_per_sample=4e9, batch_per_gpu=32)
    ring = lambda size: 1e-4 + size / 1e9  # noqa: E731  a 1 GB/s link with 100 µs per message
    ideal = step_time(work, Accelerator(1e13), ring, bucket=25e6)
    serial = step_time(work, Accelerator(1e13, overlap=0.0), ring, bucket=25e6)
    halfway = step_time(work, Accelerator(1e13, overlap=0.5), ring, bucket=25e6)
    assert 0 < ideal.exposed < ideal.communication  # some all-reduce hides under backward
    assert serial.exposed == pytest.approx(serial.communication)  # none does
    assert halfway.exposed == pytest.approx((ideal.exposed + serial.exposed) / 2)
    with pytest.raises(ValueError, match="overlap"):
        Accelerator(1e13, overlap=1.5)



# --- (c) monotonicity and sanity --------------------------------------------------------------

WORK = Workload(params=25.6e6, flops_per_sample=8.2e9, batch_per_gpu=32)
GPU = Accelerator(10.6e12, 0.5)


def _cluster(intra_bw: float = 40e9, inter_bw: float = 12.5e9, intra_lat: float = 5e-6, inter_lat: float = 10e-6,
             per_node: int = 4) -> Cluster:
    return Cluster.two_level(per_node, intra_bw, intra_lat, inter_bw, inter_lat)


@pytest.mark.parametrize("reducer", REDUCERS, ids=lambda r: r.name)
@pytest.mark.parametrize("gpus", [2, 8, 64, 256])
def test_more_bandwidth_or_less_latency_never_hurts(reducer: ReduceAlgorithm, gpus: int) -> None:
    def time(cluster: Cluster, bucket: float | None = 16 * MB) -> float:
        if bucket is None:
            return best_bucket(WORK, GPU, cluster, gpus, reducer, tolerance=0.0).step_time
        return predict(WORK, GPU, cluster, gpus, reducer, bucket).step_time

    for bucket in (16 * MB, None):
        inter = [time(_cluster(inter_bw=bw), bucket) for bw in (1e9, 3e9, 12.5e9, 50e9)]
        intra = [time(_cluster(intra_bw=bw), bucket) for bw in (10e9, 40e9, 150e9)]
        latency = [time(_cluster(inter_lat=lat, intra_lat=lat / 2), bucket) for lat in (100e-6, 10e-6, 1e-6)]
        for series in (inter, intra, latency):
            assert all(later <= earlier + 1e-12 for earlier, later in zip(series, series[1:])), series


def test_hierarchical_beats_flat_when_the_network_is_the_bottleneck() -> None:
    slow_network = _cluster(intra_bw=150e9, inter_bw=1.25e9, inter_lat=50e-6, per_node=8)
    levels = slow_network.levels(256)
    assert hierarchical_all_reduce(levels, 100e6) < flat_ring_all_reduce(levels, 100e6)
    flat = predict(WORK, GPU, slow_network, 256, ReduceAlgorithm("flat-ring", "ring"), 25 * MB)
    hierarchical = predict(WORK, GPU, slow_network, 256, ReduceAlgorithm("hierarchical", "hierarchical"), 25 * MB)
    assert hierarchical.efficiency > flat.efficiency


def test_efficiency_is_one_on_one_gpu_and_never_above_one() -> None:
    result = plan(WORK, GPU, _cluster(), gpu_counts(_cluster(), 256))
    assert result.gpu_counts == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert result.recommended[1].efficiency == pytest.approx(1.0)
    for prediction in result.predictions.values():
        assert 0 < prediction.efficiency <= 1 + 1e-12
        assert prediction.throughput == pytest.approx(prediction.gpus * 32 / prediction.step_time)


def test_flat_ring_efficiency_falls_as_gpus_grow() -> None:
    ring = ReduceAlgorithm("flat-ring", "ring")
    efficiencies = [predict(WORK, GPU, _cluster(), n, ring, 25 * MB).efficiency for n in (2, 4, 8, 32, 128, 512)]
    assert all(later <= earlier for earlier, later in zip(efficiencies, efficiencies[1:])), efficiencies


def test_fp16_gradients_halve_the_bytes_on_the_wire() -> None:
    fp32 = predict(WORK, GPU, _cluster(), 64, ReduceAlgorithm("flat-ring", "ring"), 1e12, first_bucket=1e12)
    fp16 = predict(WORK, GPU, _cluster(), 64, ReduceAlgorithm("flat-ring+fp16", "ring", gradient_bytes=2), 1e12,
                   first_bucket=1e12)
    ring = _cluster().levels(64)
    assert fp32.step.communication == pytest.approx(flat_ring_all_reduce(ring, WORK.params * 4))
    assert fp16.step.communication == pytest.approx(flat_ring_all_reduce(ring, WORK.params * 2))


def test_cluster_places_gpus_innermost_first() -> None:
    cluster = _cluster()
    assert [level.size for level in cluster.levels(2)] == [2]
    assert [level.size for level in cluster.levels(256)] == [4, 64]
    assert cluster.levels(256)[1].shared_by == 4
    with pytest.raises(ValueError, match="multiple of 4"):
        cluster.levels(6)
    assert gpu_counts(cluster, 24) == [1, 2, 4, 8, 16, 24]


def test_pipelines_cut_gradient_traffic_per_gpu_and_add_a_bubble() -> None:
    ring = ReduceAlgorithm("flat-ring", "ring")
    plain = predict(WORK, GPU, _cluster(), 64, ring, 1e12)
    piped = predict(WORK, GPU, _cluster(), 64, ring, 1e12, Pipeline(stages=4, micro_batches=16))
    assert piped.step.communication < plain.step.communication
    assert piped.step.bubble > 0 == plain.step.bubble
    with pytest.raises(ValueError, match="whole replicas"):
        predict(WORK, GPU, _cluster(), 6, ring, 1e12, Pipeline(stages=4, micro_batches=4))


def test_plan_recommends_pipelines_only_when_asked() -> None:
    result = plan(WORK, GPU, _cluster(), [64], max_stages=4)
    assert result.recommended[64].pipeline.stages in (1, 2, 4)
    assert all(p.pipeline.stages == 1 for p in plan(WORK, GPU, _cluster(), [64]).recommended.values())


# --- calibration ------------------------------------------------------------------------------


def test_alpha_beta_fit_recovers_the_ring_parameters() -> None:
    alpha, beta = 50e-6, 2e9
    samples = [(s, ring_all_reduce(2, s, alpha, beta)) for s in (4 << 10, 1 << 20, 8 << 20)]
    assert fit_alpha_beta(samples, 2) == pytest.approx((alpha, beta))
    samples4 = [(s, ring_all_reduce(4, s, alpha, beta)) for s in (4 << 10, 1 << 20, 8 << 20)]
    assert fit_alpha_beta(samples4, 4) == pytest.approx((alpha, beta))
    with pytest.raises(ValueError, match="at least 2"):
        fit_alpha_beta(samples[:1])


@pytest.mark.timeout(60)
def test_calibrate_measures_this_machine_quickly() -> None:
    # Two real processes over Gloo on loopback; sizes kept small so this takes a few seconds.
    measured = calibrate(run_replicas, sizes=(4 << 10, 1 << 20, 8 << 20), repeats=3, matmul_size=256,
                         timeout_s=45)
    assert measured.matmul_flops > 0 and measured.beta > 0 and measured.alpha >= 0
    assert [size for size, _ in measured.samples] == [4 << 10, 1 << 20, 8 << 20]
    # A 4 MiB cast to fp16, and fp16 all-reduces of the two largest sizes (in fp16 bytes).
    assert measured.cast_bandwidth > 0 and measured.fp16_sum_rate > 0
    assert [size for size, _ in measured.fp16_samples] == [512 << 10, 4 << 20]


def test_calibrate_measures_again_when_noise_hides_the_growth_with_size() -> None:
    # Each call plays both ranks of one measurement: the first is swamped by other work (the 1 MiB all-reduce
    # no slower than the 4 KiB one), the second is clean. The fit keeps each size's fastest time.
    noisy = [(4096, [3e-3]), (1 << 20, [2e-3])]
    clean = [(4096, [1e-4]), (1 << 20, [1e-3])]
    measurements = iter([noisy, clean])
    calls = []

    def runner(fn: object, world_size: int, *args: object, timeout_s: float) -> list[object]:
        calls.append(world_size)
        per_size = next(measurements)
        return [(per_size, per_size)] * world_size

    measured = calibrate(runner, sizes=(4096, 1 << 20), repeats=1, matmul_size=64, fp16_sizes=(4096, 1 << 20))
    assert calls == [2, 2]
    assert list(measured.samples) == [(4096, 1e-4), (1 << 20, 1e-3)]
    assert measured.beta == pytest.approx(1 / ((1e-3 - 1e-4) / ((1 << 20) - 4096)))

    always_noisy = iter([noisy] * 3)
    with pytest.raises(ValueError, match="did not grow with message size"):
        calibrate(lambda fn, n, *a, timeout_s: [(next(always_noisy),) * 2] * n, sizes=(4096, 1 << 20),
                  repeats=1, matmul_size=64, fp16_sizes=(4096, 1 << 20))


# --- the command line -------------------------------------------------------------------------


def _options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="replicator plan")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_prints_a_table_and_a_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_options("--model", "resnet101", "--max-gpus", "64", "--fp16")) == 0
    out = capsys.readouterr().out
    # Columns are what Replicator(reducer=...) takes, each once: both flat models share "flat".
    assert "Recommendation at 64 GPUs" in out and "fp16@hierarchical" in out and "flat-rhd" not in out


def test_cli_reproduces_the_published_cases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_options("--reproduce")) == 0
    out = capsys.readouterr().out
    for case in published.PUBLISHED_CASES:
        assert case.key in out


def test_cli_accepts_a_custom_model_and_rejects_half_a_description(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_options("--params", "25.6M", "--flops-per-sample", "8.2G", "--max-gpus", "8")) == 0
    assert main(_options("--params", "25.6M")) == 2
    assert "--flops-per-sample" in capsys.readouterr().err
    assert main(_options("--gpus-per-node", "3", "--max-gpus", "2", "--model", "vgg16")) == 0


def test_core_never_imports_the_planner() -> None:
    package = ROOT / "replicator"
    offenders = [
        str(path.relative_to(ROOT)) for path in package.rglob("*.py")
        # The planner serves the command line and the report (which plots its prediction), never training.
        if path.relative_to(package).parts[0] not in ("plan", "cli", "report")
        and "replicator.plan" in path.read_text()
    ]
    assert offenders == []


@pytest.mark.parametrize("model", presets.MODELS.values(), ids=lambda m: m.name)
def test_model_presets_are_their_published_networks_layer_by_layer(model: presets.ModelPreset) -> None:
    # Our torch definition, built on the meta device, has the published parameter count exactly and the
    # published forward FLOPs within 0.1% (torchvision rounds its GMACs to 3 digits).
    profile = model.profile()
    assert profile.params == model.params
    assert profile.forward_flops == pytest.approx(model.forward_flops, rel=1e-3)
    assert len(profile.layers) > 10 and all(layer.params >= 0 for layer in profile.layers)
