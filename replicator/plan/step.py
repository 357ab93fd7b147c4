"""One training step's time: compute, bucketed gradient all-reduce overlapped with backward, pipeline bubble."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replicator.plan._checks import raise_if
from replicator.plan.profile import FIRST_BUCKET_BYTES, GradientProfile, ReadyBucket

__all__ = [
    "BACKWARD_PER_FORWARD",
    "Workload",
    "Accelerator",
    "Pipeline",
    "NO_PIPELINE",
    "StepBreakdown",
    "gpipe_bubble_fraction",
    "bucket_sizes",
    "overlap",
    "Schedule",
    "schedule_buckets",
    "step_time",
]

# Backward computes a gradient for both the inputs and the weights of every layer:
# about twice the forward's multiply-adds.
BACKWARD_PER_FORWARD = 2.0


@dataclass(frozen=True)
class Workload:
    """What one GPU computes per step and how much gradient it must share.

    `flops_per_sample` counts forward FLOPs (a multiply-add is 2). `gradient_bytes` is
    the size of one gradient element on the wire (4 for fp32, 2 for fp16 compression).
    `activation_bytes_per_sample` matters only for pipelines: what crosses a stage
    boundary per sample. `step_s`, when given, is one training step measured on one
    device at `batch_per_gpu` (forward, backward and update): it replaces the FLOPs
    estimate, and `flops_per_sample` may then be None. `profile` gives the gradient per
    layer in backward order, so buckets are ready when backward reaches them; without it
    gradient bytes appear at a steady rate over backward.
    """

    params: float
    flops_per_sample: float | None
    batch_per_gpu: int
    gradient_bytes: int = 4
    activation_bytes_per_sample: float = 0.0
    step_s: float | None = None
    profile: GradientProfile | None = None

    def __post_init__(self) -> None:
        raise_if(self.params <= 0, f"params must be > 0, got {self.params}")
        raise_if(self.flops_per_sample is None and self.step_s is None,
                 "give flops_per_sample or a measured step_s (one device's step time)")
        raise_if(self.flops_per_sample is not None and self.flops_per_sample <= 0,
                 f"flops_per_sample must be > 0, got {self.flops_per_sample}")
        raise_if(self.step_s is not None and not self.step_s > 0, f"step_s must be > 0 s, got {self.step_s}")
        raise_if(self.batch_per_gpu < 1, f"batch_per_gpu must be >= 1, got {self.batch_per_gpu}")
        raise_if(self.gradient_bytes < 1, f"gradient_bytes must be >= 1, got {self.gradient_bytes}")
        raise_if(self.activation_bytes_per_sample < 0,
                 f"activation_bytes_per_sample must be >= 0, got {self.activation_bytes_per_sample}")
        raise_if(self.profile is not None and abs(self.profile.params - self.params) > 1e-6 * self.params + 1,
                 f"the gradient profile holds {self.profile.params if self.profile else 0:,} elements but params is "
                 f"{self.params:,.0f}; give the profile's count")

    @property
    def gradient_size(self) -> float:
        """Bytes of gradient one replica all-reduces per step."""
        return self.params * self.gradient_bytes

    def layers(self) -> GradientProfile:
        """The gradient profile: the given one, else one evenly produced layer of `params` elements."""
        return self.profile if self.profile is not None else GradientProfile.uniform(self.params)

    def forward_seconds_per_sample(self, accelerator: Accelerator) -> float:
        """One sample's forward: a third of the measured step if there is one (backward is twice forward), else
        FLOPs over the accelerator's achieved rate."""
        if self.step_s is not None:
            return self.step_s / self.batch_per_gpu / (1 + BACKWARD_PER_FORWARD)
        assert self.flops_per_sample is not None  # __post_init__ requires one of the two
        return self.flops_per_sample / accelerator.achieved_flops


@dataclass(frozen=True)
class Accelerator:
    """A GPU (or CPU): peak FLOP/s, the fraction of it a real model achieves, and how well
    communication hides under its compute.

    `overlap` is the share of the ideal overlap of gradient all-reduce with backward that
    happens: 1 where communication has resources of its own (a GPU's all-reduce moves data
    while kernels run), towards 0 where it needs the cycles the backward pass is using (Gloo's
    copies and the kernel's network stack on CPU cores that other work also keeps busy), so
    that it adds to the step instead of hiding under it (docs/results.md measures both).

    What a compressed reducer's conversions cost (`plan.conversion`): `cast_bandwidth` is the
    bytes of fp32 gradient one elementwise pass (a cast to or from 16 bits, a scaling) gets
    through per second, and `fp16_sum_rate` the gradient elements per second an fp16
    all-reduce sums beyond what its bytes cost (Gloo on CPU converts every element through
    fp32 in scalar code; NCCL sums fp16 natively). Infinite: free, as on a GPU to within
    microseconds per bucket.
    """

    peak_flops: float
    efficiency: float = 1.0
    overlap: float = 1.0
    cast_bandwidth: float = math.inf
    fp16_sum_rate: float = math.inf

    def __post_init__(self) -> None:
        raise_if(self.peak_flops <= 0, f"peak_flops must be > 0, got {self.peak_flops}")
        raise_if(not 0 < self.efficiency <= 1, f"efficiency must be in (0, 1], got {self.efficiency}")
        raise_if(not 0 <= self.overlap <= 1, f"overlap must be in [0, 1], got {self.overlap}")
        raise_if(not self.cast_bandwidth > 0, f"cast_bandwidth must be > 0 bytes/s, got {self.cast_bandwidth}")
        raise_if(not self.fp16_sum_rate > 0, f"fp16_sum_rate must be > 0 elements/s, got {self.fp16_sum_rate}")

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.efficiency


@dataclass(frozen=True)
class Pipeline:
    """K stages, M micro-batches (GPipe). `recompute`: re-materialize activations in backward."""

    stages: int = 1
    micro_batches: int = 1
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.stages < 1 or self.micro_batches < 1:
            raise ValueError(f"stages and micro_batches must be >= 1, got K={self.stages}, M={self.micro_batches}")


# Plain data parallelism: one stage, one micro-batch.
NO_PIPELINE = Pipeline()


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds per step. `communication` is the all-reduce busy time, `exposed` the part not hidden, and `tail`
    the all-reduce of the last bucket, ready only when backward ends: the part no overlap can hide.
    `conversion` is the share of `communication` a compressed reducer spends converting gradients."""

    forward: float
    backward: float
    bubble: float
    p2p: float
    communication: float
    exposed: float
    tail: float = 0.0
    conversion: float = 0.0

    @property
    def compute(self) -> float:
        return self.forward + self.backward

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.bubble + self.p2p + self.exposed


def gpipe_bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe schedule of K stages and M micro-batches, in closed form: (K-1)/(M+K-1).

    The formula; `pipeline.schedule` and `pipeline.timeline` measure the same share on a
    placed schedule and on recorded events.
    """
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages and micro_batches must be >= 1, got K={stages}, M={micro_batches}")
    return (stages - 1) / (micro_batches + stages - 1)


def bucket_sizes(total: float, bucket: float) -> list[float]:
    """Split `total` bytes into buckets of `bucket` bytes in the order gradients are ready; the last holds the rest."""
    if total <= 0:
        return []
    if bucket <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket}")
    full = math.floor(total / bucket)
    sizes = [float(bucket)] * full
    rest = total - full * bucket
    if not sizes:
        return [float(total)]
    # A sliver below a millionth of a bucket is floating-point noise, not a bucket of its own.
    if rest > bucket * 1e-6:
        sizes.append(rest)
    else:
        sizes[-1] += rest
    return sizes


def overlap(total: float, bucket: float, window: float, all_reduce: Callable[[float], float]) -> tuple[float, float]:
    """(exposed, busy) seconds of a bucketed all-reduce that runs while `window` seconds of backward go on.

    Gradient bytes appear at a steady rate over the window (a bucket is ready when its
    last byte is); buckets go out one at a time, in order, on one communication
    stream. Whatever is still on the wire when backward ends is exposed.
    """
    if window < 0:
        raise ValueError(f"overlap window must be >= 0 s, got {window}")
    sizes = bucket_sizes(total, bucket)
    ready = [ReadyBucket(size, min(1.0, produced / total)) for size, produced in zip(sizes, _running_sum(sizes))]
    timeline = schedule_buckets(ready, window, all_reduce)
    return timeline.exposed, timeline.busy


def _running_sum(values: list[float]) -> list[float]:
    sums, running = [], 0.0
    for value in values:
        running += value
        sums.append(running)
    return sums


@dataclass(frozen=True)
class Schedule:
    """When the gradient all-reduce of one step ends, measured from the start of backward."""

    end: float
    busy: float
    exposed: float
    tail: float
    conversion: float = 0.0


def schedule_buckets(buckets: Sequence[ReadyBucket], window: float, all_reduce: Callable[[float], float],
                     convert: Callable[[float], float] | None = None) -> Schedule:
    """Each bucket's all-reduce starts when the bucket is ready and the link is free (one stream, in order).

    `window` is backward's length; a bucket is ready at `ready × window`. Whatever is on
    the wire after backward ends is exposed; the last bucket is ready only then, so its
    all-reduce (the tail) shows whatever the schedule. `convert(bytes)`, for a compressed
    reducer, is the time its casts take around one bucket's all-reduce: the runtime makes
    them on the reducer's one thread, before the bucket goes out and after it is back, so
    they hold the stream as the all-reduce does.
    """
    if window < 0:
        raise ValueError(f"overlap window must be >= 0 s, got {window}")
    free = busy = tail = conversion = 0.0
    for item in buckets:
        converting = convert(item.nbytes) if convert is not None else 0.0
        tail = all_reduce(item.nbytes) + converting
        free = max(free, item.ready * window) + tail
        busy += tail
        conversion += converting
    return Schedule(free, busy, max(0.0, free - window), tail, conversion)


def step_time(
    workload: Workload,
    accelerator: Accelerator,
    all_reduce: Callable[[float], float] | None,
    bucket: float,
    pipeline: Pipeline = NO_PIPELINE,
    p2p: Callable[[float], float] | None = None,
    first_bucket: float = FIRST_BUCKET_BYTES,
    convert: Callable[[float], float] | None = None,
) -> StepBreakdown:
    """Time of one synchronous step on one GPU of a data- (and optionally pipeline-) parallel job.

    Without a pipeline, buckets form as the runtime forms them (the first of
    `first_bucket` bytes) from the workload's gradient profile and are ready as backward
    reaches their last layer. A replica of K stages takes batch_per_gpu × K samples in M
    micro-batches, so every GPU does the same work as without a pipeline; the schedule
    runs M + K - 1 slots of each micro-batch's forward and backward. Stage 0 finishes
    last, so its share of the gradient (1/K of it, produced evenly) decides the exposed
    communication, and only its last micro-batch's backward is left to hide it under.
    `all_reduce(bytes)` is None for a single replica; `p2p(bytes)` costs one activation
    transfer between stages; `convert(bytes)` a compressed reducer's casts around one bucket.
    """
    stages, micro = pipeline.stages, pipeline.micro_batches
    samples_per_micro_batch = workload.batch_per_gpu * stages / micro
    forward_slot = workload.forward_seconds_per_sample(accelerator) * samples_per_micro_batch / stages
    backward_slot = forward_slot * (BACKWARD_PER_FORWARD + (1.0 if pipeline.recompute else 0.0))
    slots = micro + stages - 1
    forward = micro * forward_slot
    backward = micro * backward_slot
    bubble = (stages - 1) * (forward_slot + backward_slot)
    p2p_time = 0.0
    if stages > 1 and p2p is not None:
        # Activations forward and their gradients backward, once per slot.
        p2p_time = 2 * slots * p2p(workload.activation_bytes_per_sample * samples_per_micro_batch)
    exposed = busy = tail = conversion = 0.0
    if all_reduce is not None:
        if stages == 1:
            buckets = workload.layers().buckets(bucket, workload.gradient_bytes, first_bucket)
        else:
            buckets = GradientProfile.uniform(workload.params / stages).buckets(
                bucket, workload.gradient_bytes, first_bucket)
        timeline = schedule_buckets(buckets, backward_slot, all_reduce, convert)
        busy, tail, conversion = timeline.busy, timeline.tail, timeline.conversion
        # Between perfect overlap (only what outlasts backward shows) and none (all of it shows).
        exposed = accelerator.overlap * timeline.exposed + (1 - accelerator.overlap) * busy
    return StepBreakdown(forward, backward, bubble, p2p_time, busy, exposed, tail, conversion)
