"""The planner: predicted step time, throughput and scaling efficiency over GPU counts and reducers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from replicator.plan._checks import raise_if
from replicator.plan.conversion import Compression, compression_of
from replicator.plan.cost import Level, all_reduce_time
from replicator.plan.profile import FIRST_BUCKET_BYTES
from replicator.plan.step import NO_PIPELINE, Accelerator, Pipeline, StepBreakdown, Workload, step_time

__all__ = [
    "Tier",
    "Cluster",
    "ReduceAlgorithm",
    "FLAT_RING",
    "FLAT_RHD",
    "HIERARCHICAL",
    "BY_ALGORITHM",
    "REDUCERS",
    "runtime_reducer",
    "with_compression",
    "Prediction",
    "Plan",
    "MB",
    "BUCKET_CANDIDATES",
    "TOLERANCE",
    "predict",
    "best_bucket",
    "gpu_counts",
    "plan",
]

MB = 1024 * 1024
# Bucket sizes the planner tries; 25 MB is torch DDP's default, 64 MB Horovod's fusion buffer.
BUCKET_CANDIDATES: tuple[float, ...] = tuple(size * MB for size in (1, 2, 4, 8, 16, 25, 32, 64, 128, 256))
# Predictions closer than this are a tie, and the simpler choice wins: the model is not that exact.
TOLERANCE = 0.005


@dataclass(frozen=True)
class Tier:
    """One kind of link in a cluster. `size`: members per unit (None for the outermost tier, which grows).

    `bandwidth` is the line rate (bytes/s, one direction); `efficiency` the fraction of it
    an all-reduce achieves over this transport (transports.TRANSPORTS has defaults per kind).
    """

    name: str
    size: int | None
    bandwidth: float
    latency: float
    shared_by: int = 1
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        raise_if(not self.bandwidth > 0, f"tier {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        raise_if(not self.latency >= 0, f"tier {self.name!r}: latency must be >= 0 s, got {self.latency}")
        raise_if(not 0 < self.efficiency <= 1,
                 f"tier {self.name!r}: efficiency (achieved share of line rate) must be in (0, 1], "
                 f"got {self.efficiency}")

    @property
    def achieved_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Cluster:
    """Tiers from the inside out, e.g. GPUs in a node over NVLink, then nodes over InfiniBand."""

    tiers: tuple[Tier, ...]

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("a cluster needs at least one tier")
        for tier in self.tiers[:-1]:
            if tier.size is None or tier.size < 1:
                raise ValueError(f"tier {tier.name!r}: only the outermost tier may have an open size; give a size >= 1")

    @classmethod
    def two_level(cls, gpus_per_node: int, intra_bandwidth: float, intra_latency: float,
                  inter_bandwidth: float, inter_latency: float, intra_efficiency: float = 1.0,
                  inter_efficiency: float = 1.0) -> Cluster:
        """Nodes of `gpus_per_node` GPUs; `inter_bandwidth` is one node's network port, shared by its GPUs.

        Bandwidths are line rates; the efficiencies are the shares of them an all-reduce achieves.
        """
        raise_if(gpus_per_node < 1, f"gpus_per_node must be >= 1, got {gpus_per_node}")
        return cls((
            Tier("intra-node", gpus_per_node, intra_bandwidth, intra_latency, efficiency=intra_efficiency),
            Tier("inter-node", None, inter_bandwidth, inter_latency, shared_by=gpus_per_node,
                 efficiency=inter_efficiency),
        ))

    @property
    def gpus_per_node(self) -> int:
        return self.tiers[0].size or 1

    def levels(self, gpus: int) -> list[Level]:
        """The tiers `gpus` GPUs occupy when placed innermost first (whole nodes once past one node)."""
        if gpus < 1:
            raise ValueError(f"need at least 1 GPU, got {gpus}")
        levels: list[Level] = []
        remaining = gpus
        for position, tier in enumerate(self.tiers):
            if tier.size is None or remaining <= tier.size:
                levels.append(Level(remaining, tier.achieved_bandwidth, tier.latency, tier.shared_by, tier.name))
                remaining = 1
                break
            if remaining % tier.size:
                unit = math.prod(t.size or 1 for t in self.tiers[: position + 1])
                raise ValueError(f"{gpus} GPUs do not fill whole units of {tier.size} at tier {tier.name!r}; "
                                 f"use a multiple of {unit}")
            levels.append(Level(tier.size, tier.achieved_bandwidth, tier.latency, tier.shared_by, tier.name))
            remaining //= tier.size
        if remaining != 1:
            raise ValueError(f"{gpus} GPUs do not fit this cluster (its outermost tier has a fixed size)")
        return levels


# The runtime reducer that runs each cost model's algorithm. A flat all-reduce is one call whose
# algorithm the backend picks (Gloo and NCCL choose ring or halving-doubling by size and topology):
# both flat models are priced separately but run as 'flat'.
_RUNTIME_REDUCERS = {"ring": "flat", "rhd": "flat", "hierarchical": "hierarchical"}
# Wire types a compressed runtime reducer can send, by their bytes per element.
_WIRE_TYPES = {2: "fp16"}


@dataclass(frozen=True)
class ReduceAlgorithm:
    """How the planner prices summing gradients, and the runtime reducer that does it.

    `name` labels it in tables; `algorithm` picks the cost formula (a key of
    `cost.ALGORITHMS`); `gradient_bytes` is the bytes per element on the wire (None: the
    workload's). `reducer` is the string to pass to `Replicator(reducer=...)`; left empty,
    it is derived from the algorithm and the wire type.
    """

    name: str
    algorithm: str
    gradient_bytes: int | None = None
    reducer: str = ""

    def __post_init__(self) -> None:
        if not self.reducer:
            object.__setattr__(self, "reducer", runtime_reducer(self.algorithm, self.gradient_bytes))

    @property
    def compression(self) -> Compression | None:
        """The 16-bit wire type (and error feedback) the runtime reducer converts gradients to; None if lossless."""
        return compression_of(self.reducer)


def runtime_reducer(algorithm: str, gradient_bytes: int | None = None) -> str:
    """The `Replicator(reducer=...)` string that runs `algorithm` with `gradient_bytes` per element on the wire."""
    if algorithm not in _RUNTIME_REDUCERS:
        raise ValueError(f"no runtime reducer runs the all-reduce algorithm {algorithm!r}; "
                         f"known: {', '.join(_RUNTIME_REDUCERS)}")
    topology = _RUNTIME_REDUCERS[algorithm]
    if gradient_bytes is None or gradient_bytes == 4:
        return topology
    if gradient_bytes not in _WIRE_TYPES:
        raise ValueError(f"no runtime reducer sends {gradient_bytes}-byte gradients; "
                         f"give ReduceAlgorithm(reducer=...) or use {sorted(_WIRE_TYPES)} bytes")
    wire = _WIRE_TYPES[gradient_bytes]
    return wire if topology == "flat" else f"{wire}@{topology}"


FLAT_RING = ReduceAlgorithm("flat-ring", "ring", reducer="flat")
FLAT_RHD = ReduceAlgorithm("flat-rhd", "rhd", reducer="flat")
HIERARCHICAL = ReduceAlgorithm("hierarchical", "hierarchical", reducer="hierarchical")
# Each cost model by the `algorithm` name `replicator plan --all-reduce` takes.
BY_ALGORITHM: dict[str, ReduceAlgorithm] = {a.algorithm: a for a in (FLAT_RING, FLAT_RHD, HIERARCHICAL)}
# The runtime's reducers as the validated model prices them (docs/concepts/scaling.md): "flat" is one
# backend all-reduce, a ring as NCCL runs it in the published rows; "hierarchical" is ring per tier. Recursive
# halving-doubling (FLAT_RHD) is what a system runs only when it says so (Caffe2's Gloo in Goyal et al.):
# pricing "flat" as the faster of the two credited the runtime with an algorithm it does not run.
REDUCERS: tuple[ReduceAlgorithm, ...] = (FLAT_RING, HIERARCHICAL)


def with_compression(algorithms: Sequence[ReduceAlgorithm], wire: str = "fp16",
                     error_feedback: bool = False) -> tuple[ReduceAlgorithm, ...]:
    """The algorithms plus a variant of each that sends gradients in a 2-byte type (changes numerics: opt-in).

    `wire` is the runtime's 16-bit type, "fp16" or "bf16", optionally with error feedback
    ("+ef"). The bytes on the wire are the same for all; what converting costs differs
    (`conversion.Compression`).
    """
    if wire not in ("fp16", "bf16"):
        raise ValueError(f"wire must be 'fp16' or 'bf16', got {wire!r}")
    compressor = wire + ("+ef" if error_feedback else "")
    return tuple(algorithms) + tuple(
        ReduceAlgorithm(f"{a.name}+{compressor}", a.algorithm, 2,
                        compressor if a.reducer == "flat" else f"{compressor}@{a.reducer}")
        for a in algorithms
    )


@dataclass(frozen=True)
class Prediction:
    """One configuration's predicted step and its scaling against one GPU with the same per-GPU batch."""

    gpus: int
    algorithm: ReduceAlgorithm
    bucket: float
    pipeline: Pipeline
    step: StepBreakdown
    single_gpu_step: float
    samples_per_step: int

    @property
    def reducer(self) -> str:
        """What to pass to `Replicator(reducer=...)` for this prediction."""
        return self.algorithm.reducer

    @property
    def step_time(self) -> float:
        return self.step.total

    @property
    def throughput(self) -> float:
        """Samples per second, all GPUs together."""
        return self.samples_per_step / self.step.total

    @property
    def efficiency(self) -> float:
        """Throughput over gpus × single-GPU throughput."""
        return self.single_gpu_step / self.step.total

    @property
    def bucket_cap_mb(self) -> float:
        """The bucket as `Replicator(bucket_cap_mb=...)` takes it: MiB, rounded up to 3 significant digits so a
        bucket meant to hold the whole gradient still does."""
        mib = self.bucket / MB
        scale = 10 ** (math.floor(math.log10(mib)) - 2) if mib > 0 else 1
        return round(math.ceil(mib / scale - 1e-9) * scale, 6)

    def to_dict(self) -> dict[str, object]:
        """Plain data for `replicator plan --json` and the run report: what to paste and what to expect."""
        return {
            "gpus": self.gpus, "reducer": self.reducer, "bucket_cap_mb": self.bucket_cap_mb,
            "stages": self.pipeline.stages, "chunks": self.pipeline.micro_batches,
            "step_s": self.step_time, "efficiency": self.efficiency, "samples_per_s": self.throughput,
            "compute_s": self.step.compute, "communication_s": self.step.communication,
            "exposed_s": self.step.exposed, "tail_s": self.step.tail, "bubble_s": self.step.bubble,
            "conversion_s": self.step.conversion, "algorithm": self.algorithm.name,
        }


@dataclass(frozen=True)
class Plan:
    """Best-bucket predictions per (GPU count, reducer) and the recommended configuration per GPU count."""

    predictions: dict[tuple[int, str], Prediction] = field(default_factory=dict)
    recommended: dict[int, Prediction] = field(default_factory=dict)

    @property
    def gpu_counts(self) -> list[int]:
        return sorted(self.recommended)

    def configurations(self) -> dict[tuple[int, str, int, int], Prediction]:
        """One prediction per configuration a user can paste: (GPUs, runtime reducer, stages, micro-batches).

        Cost models the runtime runs alike collapse into one (a flat ring and flat
        halving-doubling are both one 'flat' all-reduce whose algorithm the backend picks):
        the fastest stands for them, and `Prediction.algorithm` says which the model assumed.
        The recommended configuration stands for its own, being within the tie tolerance of it.
        """
        chosen: dict[tuple[int, str, int, int], Prediction] = {}
        for prediction in self.predictions.values():
            key = _configuration(prediction)
            if key not in chosen or prediction.step_time < chosen[key].step_time:
                chosen[key] = prediction
        for prediction in self.recommended.values():
            chosen[_configuration(prediction)] = prediction
        return chosen


def _configuration(prediction: Prediction) -> tuple[int, str, int, int]:
    return prediction.gpus, prediction.reducer, prediction.pipeline.stages, prediction.pipeline.micro_batches


def _replica_levels(levels: list[Level], stages: int) -> list[Level]:
    """The levels one stage's data-parallel group spans when K stages share the machine.

    Stages are packed innermost first, so a group has 1/K as many members; the K
    groups run at once, so a network port carries K rings (divide its bandwidth) while
    its per-GPU share stays the same.
    """
    if stages == 1:
        return levels
    remaining = stages
    result: list[Level] = []
    concurrent = min(stages, levels[0].size) if levels else 1
    for level in levels:
        divisor = math.gcd(level.size, remaining)
        remaining //= divisor
        if level.shared_by > 1:
            sharing = min(concurrent, level.shared_by)
            result.append(replace(level, size=level.size // divisor, bandwidth=level.bandwidth / sharing,
                                  shared_by=max(1, level.shared_by // sharing)))
        else:
            result.append(replace(level, size=level.size // divisor))
    if remaining != 1:
        raise ValueError(f"{stages} stages do not divide the GPUs evenly")
    return result


def predict(workload: Workload, accelerator: Accelerator, cluster: Cluster, gpus: int, reducer: ReduceAlgorithm,
            bucket: float, pipeline: Pipeline = NO_PIPELINE, first_bucket: float = FIRST_BUCKET_BYTES) -> Prediction:
    """Predicted step on `gpus` GPUs with one reducer, bucket size and pipeline shape.

    `first_bucket` is the size of the first bucket backward fills (the runtime's 1 MiB, as
    torch DDP's; a system without one passes `bucket`). A reducer that compresses gradients
    the workload holds in fp32 also pays for converting them (`conversion.Compression`).
    """
    if gpus % pipeline.stages:
        raise ValueError(f"{gpus} GPUs cannot hold whole replicas of {pipeline.stages} stages")
    if workload.batch_per_gpu * pipeline.stages < pipeline.micro_batches:
        raise ValueError(f"{pipeline.micro_batches} micro-batches need at least that many samples per replica, "
                         f"have {workload.batch_per_gpu * pipeline.stages}")
    wire = workload if reducer.gradient_bytes is None else replace(workload, gradient_bytes=reducer.gradient_bytes)
    levels = cluster.levels(gpus)
    group = _replica_levels(levels, pipeline.stages)
    replicas = gpus // pipeline.stages

    def all_reduce(nbytes: float) -> float:
        return all_reduce_time(reducer.algorithm, group, nbytes)

    # Stage boundaries inside a node use its links, otherwise the network.
    boundary = levels[0] if pipeline.stages <= levels[0].size or len(levels) == 1 else levels[-1]

    def p2p(nbytes: float) -> float:
        return boundary.latency + nbytes / boundary.bandwidth

    compression = reducer.compression if workload.gradient_bytes != wire.gradient_bytes else None

    def convert(nbytes: float) -> float:
        assert compression is not None
        return compression.seconds(nbytes / wire.gradient_bytes, replicas, accelerator)

    step = step_time(wire, accelerator, all_reduce if replicas > 1 else None, bucket, pipeline, p2p, first_bucket,
                     convert if compression is not None else None)
    single = step_time(workload, accelerator, None, bucket).total
    return Prediction(gpus, reducer, bucket, pipeline, step, single, gpus * workload.batch_per_gpu)


def _buckets_for(workload: Workload, buckets: Sequence[float] | None) -> list[float]:
    """The bucket sizes to try: the ones given, as given (a system's fixed message size), else the candidates
    below the whole gradient and the whole gradient."""
    if buckets:
        return sorted(set(buckets))
    whole = workload.gradient_size
    return sorted({b for b in BUCKET_CANDIDATES if b < whole}) + [whole]


def _pick(candidates: list[Prediction], tolerance: float) -> Prediction:
    """The first (simplest) candidate within `tolerance` of the fastest."""
    fastest = min(c.step_time for c in candidates)
    return next(c for c in candidates if c.step_time <= fastest * (1 + tolerance))


def best_bucket(workload: Workload, accelerator: Accelerator, cluster: Cluster, gpus: int, reducer: ReduceAlgorithm,
                pipeline: Pipeline = NO_PIPELINE, buckets: Sequence[float] | None = None,
                tolerance: float = TOLERANCE, first_bucket: float = FIRST_BUCKET_BYTES) -> Prediction:
    """The largest bucket whose step is within `tolerance` of the fastest.

    In a pure alpha–beta model ever smaller buckets keep shaving the exposed tail, but
    each collective also costs a launch and bookkeeping this model does not see, so a
    gain below the tolerance is not worth more, smaller messages.
    """
    sizes = sorted(_buckets_for(workload, buckets), reverse=True)
    candidates = [predict(workload, accelerator, cluster, gpus, reducer, size, pipeline, first_bucket)
                  for size in sizes]
    fastest = min(c.step_time for c in candidates)
    return next(c for c in candidates if c.step_time <= fastest * (1 + tolerance))


def gpu_counts(cluster: Cluster, max_gpus: int) -> list[int]:
    """1, 2, 4, ... up to `max_gpus` (and `max_gpus` itself), keeping counts that fill whole nodes."""
    if max_gpus < 1:
        raise ValueError(f"max_gpus must be >= 1, got {max_gpus}")
    counts = {1 << k for k in range(max_gpus.bit_length()) if 1 << k <= max_gpus} | {max_gpus}
    valid = []
    for count in sorted(counts):
        try:
            cluster.levels(count)
        except ValueError:
            continue
        valid.append(count)
    return valid


def _pipelines(gpus: int, batch_per_gpu: int, max_stages: int, recompute: bool) -> list[Pipeline]:
    shapes = [NO_PIPELINE]
    stages = 2
    while stages <= min(max_stages, gpus):
        if gpus % stages == 0:
            for factor in (1, 2, 4, 8):
                micro = stages * factor
                if micro <= batch_per_gpu * stages:
                    shapes.append(Pipeline(stages, micro, recompute))
        stages *= 2
    return shapes


def plan(workload: Workload, accelerator: Accelerator, cluster: Cluster, counts: Sequence[int],
         reducers: Sequence[ReduceAlgorithm] = REDUCERS, buckets: Sequence[float] | None = None,
         max_stages: int = 1, recompute: bool = False, tolerance: float = TOLERANCE,
         first_bucket: float = FIRST_BUCKET_BYTES) -> Plan:
    """Predict every GPU count × reducer (best bucket each) and recommend one configuration per GPU count.

    With `max_stages` > 1 the recommendation also weighs pipelines of K = 2, 4, ...
    stages with M = K, 2K, 4K, 8K micro-batches; near-ties go to fewer stages, fewer
    micro-batches (bigger micro-batches keep a GPU busier than this model credits),
    the earlier reducer and the larger bucket. `tolerance` is the relative step-time
    difference treated as a tie. `buckets`, given, are the only sizes tried (a system with a
    fixed message size); `first_bucket` is the size of the first one backward fills.
    `published.PublishedCase` predicts every published row through this function, as
    `replicator plan` does, so the command and `--reproduce` are one model.
    """
    result = Plan()
    for gpus in counts:
        candidates: list[Prediction] = []
        for pipeline in _pipelines(gpus, workload.batch_per_gpu, max_stages, recompute):
            for reducer in reducers:
                best = best_bucket(workload, accelerator, cluster, gpus, reducer, pipeline, buckets, tolerance,
                                   first_bucket)
                if pipeline == NO_PIPELINE:
                    result.predictions[(gpus, reducer.name)] = best
                candidates.append(best)
        result.recommended[gpus] = _pick(candidates, tolerance)
    return result
