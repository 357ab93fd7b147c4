"""A compressed reducer pays for converting gradients: casts around each bucket, fp16 sums; and the plan lists each
configuration a user can paste once."""

from __future__ import annotations

import math

import pytest

from replicator.plan import presets
from replicator.plan.calibrate import fit_fp16_sum_rate
from replicator.plan.conversion import Compression, cast_bandwidth_from_memory, compression_of
from replicator.plan.cost import all_reduce_time
from replicator.plan.planner import (
    FLAT_RHD,
    FLAT_RING,
    MB,
    Cluster,
    ReduceAlgorithm,
    gpu_counts,
    plan,
    predict,
    with_compression,
)
from replicator.plan.step import Accelerator, Workload
from replicator.sync.reducers import parse_reducer

# The simulated cluster's shape: 2 nodes of 2 processes, 1 Gbit/s between them; 3.2 M parameters.
CLUSTER = Cluster.two_level(2, 0.5e9, 1.5e-3, 119.6e6, 1.5e-3)
WORK = Workload(3.2e6, None, 64, step_s=0.077)
FLAT = ReduceAlgorithm("flat-ring", "ring")
HIERARCHICAL = ReduceAlgorithm("hierarchical", "hierarchical")
FP16 = ReduceAlgorithm("flat-ring+fp16", "ring", 2)
WHOLE = WORK.gradient_size  # one bucket: its conversion is easy to write down


def test_a_compressed_bucket_pays_its_casts_and_fp16_sums_on_the_reducers_stream() -> None:
    cpu = Accelerator(1.0, cast_bandwidth=2e9, fp16_sum_rate=1e8)
    free = predict(WORK, Accelerator(1.0), CLUSTER, 4, FP16, WHOLE, first_bucket=WHOLE)
    charged = predict(WORK, cpu, CLUSTER, 4, FP16, WHOLE, first_bucket=WHOLE)
    elements = WORK.params
    # fp16 over 4 replicas: scale and cast down before, cast up and unscale after; 3/4 of the elements summed.
    expected = 4 * elements * 4 / 2e9 + elements * 3 / 4 / 1e8
    assert charged.step.conversion == pytest.approx(expected)
    wire = all_reduce_time("ring", CLUSTER.levels(4), elements * 2)
    assert charged.step.communication == pytest.approx(wire + expected)
    assert free.step.conversion == 0 and free.step.communication == pytest.approx(wire)
    # One bucket, ready when backward ends: the whole of it shows.
    assert charged.step_time - free.step_time == pytest.approx(expected)
    assert charged.to_dict()["conversion_s"] == pytest.approx(expected)


@pytest.mark.parametrize("reducer, before, after, summed", [
    ("fp16", 2, 2, True), ("bf16", 1, 1, False), ("fp16+ef@hierarchical", 6, 2, True), ("bf16+ef", 4, 1, False),
])
def test_passes_follow_the_runtime_cast_reducer(reducer: str, before: int, after: int, summed: bool) -> None:
    compression = compression_of(reducer)
    assert compression is not None and compression.passes(replicas=4) == (before, after)
    spec = parse_reducer(reducer)
    assert (compression.wire, compression.error_feedback) == (spec.compressor, spec.error_feedback)
    accelerator = Accelerator(1.0, cast_bandwidth=4e9, fp16_sum_rate=1e6)
    assert compression.seconds(1e6, 4, accelerator) == pytest.approx((before + after) * 1e-3 + 0.75 * summed)
    # Alone there is nothing to scale and nothing to sum.
    assert compression.passes(replicas=1)[1] == 1
    assert compression_of("hierarchical") is None and compression_of("powersgd:4") is None


def test_gradients_already_in_fp16_convert_nothing() -> None:
    native = Workload(3.2e6, None, 64, gradient_bytes=2, step_s=0.077)
    slow = Accelerator(1.0, cast_bandwidth=1e6, fp16_sum_rate=1e3)
    assert predict(native, slow, CLUSTER, 4, FP16, WHOLE).step.conversion == 0


def test_slow_casts_put_fp16_behind_the_hierarchy_and_a_gpu_does_not_notice() -> None:
    def ranked(accelerator: Accelerator) -> list[str]:
        steps = {r.reducer: predict(WORK, accelerator, CLUSTER, 4, r, 4 * MB).step_time
                 for r in (FLAT, HIERARCHICAL, FP16)}
        return sorted(steps, key=steps.__getitem__)

    assert ranked(Accelerator(1.0)) == ["fp16", "hierarchical", "flat"]
    # Casts and fp16 sums of busy CPU cores: more than the halved bytes save.
    assert ranked(Accelerator(1.0, cast_bandwidth=1e9, fp16_sum_rate=1e8)) == ["hierarchical", "fp16", "flat"]
    # A P100 casts at memory speed and NCCL sums fp16 natively: tens of microseconds per bucket.
    gpu = Accelerator(1.0, cast_bandwidth=cast_bandwidth_from_memory(presets.P100_SXM2_MEMORY.value))
    step = predict(WORK, gpu, CLUSTER, 4, FP16, 4 * MB).step
    assert step.conversion < 1e-3 * step.total and ranked(gpu) == ranked(Accelerator(1.0))


def test_fp16_sum_rate_fit_recovers_what_fp16_costs_beyond_its_bytes() -> None:
    alpha, beta, rate = 50e-6, 2e9, 2e8
    samples = [(nbytes, 2 * alpha + nbytes / beta + nbytes / 2 / 2 / rate) for nbytes in (1 << 20, 4 << 20)]
    assert fit_fp16_sum_rate(samples, alpha, beta, 2) == pytest.approx(rate)
    as_cheap_as_its_bytes = [(nbytes, 2 * alpha + nbytes / beta) for nbytes in (1 << 20, 4 << 20)]
    assert fit_fp16_sum_rate(as_cheap_as_its_bytes, alpha, beta, 2) == math.inf


def test_conversion_inputs_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="cast_bandwidth must be > 0"):
        Accelerator(1.0, cast_bandwidth=0)
    with pytest.raises(ValueError, match="fp16_sum_rate must be > 0"):
        Accelerator(1.0, fp16_sum_rate=-1)
    with pytest.raises(ValueError, match="wire type"):
        Compression("int8")


# --- one configuration per thing a user pastes --------------------------------------------------


def test_a_plan_lists_each_runtime_configuration_once_with_the_model_it_assumed() -> None:
    cluster = Cluster.two_level(4, 40e9, 5e-6, 3.125e9, 10e-6)
    work = Workload(25.6e6, None, 32, step_s=0.1)
    # Both flat models (`replicator plan --all-reduce ring --all-reduce rhd`) run as one "flat".
    models = (FLAT_RING, FLAT_RHD, HIERARCHICAL)
    reducers = (*with_compression(models), *with_compression(models, "fp16", error_feedback=True)[len(models):])
    result = plan(work, Accelerator(1.0), cluster, gpu_counts(cluster, 64), reducers)
    chosen = result.configurations()
    assert len({(p.gpus, p.reducer, p.pipeline.stages, p.pipeline.micro_batches) for p in chosen.values()}) == len(
        chosen)
    assert {reducer for _, reducer, _, _ in chosen} == {
        "flat", "hierarchical", "fp16", "fp16@hierarchical", "fp16+ef", "fp16+ef@hierarchical"}
    for (gpus, reducer, _, _), prediction in chosen.items():
        alike = [p for p in result.predictions.values() if p.gpus == gpus and p.reducer == reducer]
        if prediction is not result.recommended[gpus]:
            assert prediction.step_time == min(p.step_time for p in alike)
        assert prediction.to_dict()["algorithm"] in {a.name for a in reducers}
    # Both flat models ran, and each GPU count kept one of them.
    assert {p.algorithm.name for p in result.predictions.values() if p.reducer == "flat"} == {"flat-ring", "flat-rhd"}
    assert sum(1 for gpus, reducer, _, _ in chosen if reducer == "flat") == len(result.gpu_counts)
