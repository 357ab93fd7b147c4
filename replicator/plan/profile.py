"""A model's gradient profile: per-layer gradient sizes and backward compute, in the order backward produces them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replicator.plan._checks import raise_if

if TYPE_CHECKING:
    import torch

__all__ = ["Layer", "GradientProfile", "ReadyBucket", "FIRST_BUCKET_BYTES", "from_module", "from_factory"]

# The runtime's first bucket (replicator.sync.synchronizer, as torch DDP's): small, so the first
# message leaves early in backward. tests/plan checks the two agree.
FIRST_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class Layer:
    """One parameter-owning layer: its gradient elements and its share of backward compute (any unit)."""

    params: int
    compute: float


@dataclass(frozen=True)
class ReadyBucket:
    """A gradient bucket: its bytes and when it is ready, as a fraction of the backward pass (0 start, 1 end)."""

    nbytes: float
    ready: float


@dataclass(frozen=True)
class GradientProfile:
    """Layers in backward order (the last layer of forward first), as the runtime buckets them.

    A bucket is ready when backward has computed its last layer: the fraction of backward
    compute up to and including that layer. `forward_flops` is the forward FLOPs of one
    sample when the profile was measured with an example input (None otherwise).
    """

    layers: tuple[Layer, ...]
    forward_flops: float | None = None

    def __post_init__(self) -> None:
        raise_if(not self.layers, "a gradient profile needs at least one layer with parameters")
        raise_if(any(layer.params < 0 or layer.compute < 0 for layer in self.layers),
                 "a layer's params and compute must be >= 0")
        raise_if(self.params <= 0, "a gradient profile needs at least one gradient element")

    @classmethod
    def uniform(cls, params: float) -> GradientProfile:
        """One layer: gradient bytes appear at a steady rate over backward (buckets split it evenly)."""
        return cls((Layer(int(params), 1.0),))

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def buckets(self, cap_bytes: float, element_bytes: int,
                first_cap_bytes: float = FIRST_BUCKET_BYTES) -> list[ReadyBucket]:
        """Buckets as the runtime forms them (replicator.sync.bucket.assign_buckets) and when each is ready.

        Layers are indivisible, so a bucket closes once it reaches the cap (the first at
        `first_cap_bytes`) and may exceed it by its last layer. A profile of one layer is the
        exception: it stands for a model whose layers we do not know, so it is cut evenly,
        as gradient bytes arriving at a steady rate.
        """
        raise_if(cap_bytes <= 0, f"bucket size must be > 0 bytes, got {cap_bytes}")
        if len(self.layers) == 1:
            return _even(self.params * element_bytes, cap_bytes, min(first_cap_bytes, cap_bytes))
        total_compute = sum(layer.compute for layer in self.layers)
        result: list[ReadyBucket] = []
        filled = done = 0.0
        for layer in self.layers:
            filled += layer.params * element_bytes
            done += layer.compute
            if filled and filled >= (min(first_cap_bytes, cap_bytes) if not result else cap_bytes):
                result.append(ReadyBucket(filled, _fraction(done, total_compute)))
                filled = 0.0
        if filled:
            result.append(ReadyBucket(filled, 1.0))
        return result


def _fraction(done: float, total: float) -> float:
    return min(1.0, done / total) if total > 0 else 1.0


def _even(total: float, cap: float, first: float) -> list[ReadyBucket]:
    """`total` bytes arriving at a steady rate, cut into a `first`-sized bucket and then `cap`-sized ones."""
    sizes: list[float] = []
    remaining = float(total)
    while remaining > 0:
        size = first if not sizes else cap
        # A sliver below a millionth of a bucket is floating-point noise, not a bucket of its own.
        if remaining - size <= size * 1e-6:
            size = remaining
        sizes.append(size)
        remaining -= size
    result, produced = [], 0.0
    for size in sizes:
        produced += size
        result.append(ReadyBucket(size, min(1.0, produced / total)))
    return result


def from_module(module: torch.nn.Module, example: torch.Tensor | None = None) -> GradientProfile:
    """The profile of a module: trainable parameters per module in reverse registration order.

    With an `example` input of one sample (on the meta device, like the module), forward
    FLOPs are counted per module (torch.utils.flop_counter) and backward compute follows
    them; without one, each layer's compute is taken proportional to its parameters
    (right for transformers, pessimistic for CNNs, whose early layers compute most).
    A module's own FLOPs without parameters (a pooling, an attention product) count
    towards the nearest parameter-owning module before it.
    """
    seen: set[int] = set()
    owners: list[tuple[str, int]] = []
    for name, sub in module.named_modules():
        count = 0
        for param in sub.parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                count += param.numel()
        owners.append((name, count))
    if not any(count for _, count in owners):
        raise ValueError(f"{type(module).__name__} has no trainable parameters: nothing to all-reduce")
    flops: dict[str, float] = {}
    total = None
    if example is not None:
        flops, total = _count_flops(module, example)
    layers: list[Layer] = []
    pending = 0.0  # FLOPs met before the first parameter-owning module
    for name, count in owners:
        own = flops.get(name, 0.0)
        if count:
            layers.append(Layer(count, (own + pending) if example is not None else float(count)))
            pending = 0.0
        elif layers:
            layers[-1] = Layer(layers[-1].params, layers[-1].compute + own)
        else:
            pending += own
    return GradientProfile(tuple(reversed(layers)), total)


def _count_flops(module: torch.nn.Module, example: torch.Tensor) -> tuple[dict[str, float], float]:
    """Each module's own forward FLOPs (its children's excluded) and the total, for one `example` batch."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        module(example)
    counts = counter.get_flop_counts()
    root = type(module).__name__
    inclusive: dict[str, float] = {}
    for name, _ in module.named_modules():
        key = f"{root}.{name}" if name else root
        inclusive[name] = float(sum(counts.get(key, {}).values()))
    own = dict(inclusive)
    for name, sub in module.named_modules():
        for child, _ in sub.named_children():
            own[name] -= inclusive[f"{name}.{child}" if name else child]
    batch = example.shape[0] if example.dim() else 1
    return own, float(counter.get_total_flops()) / batch


def from_factory(factory: Callable[[], object], spec: str, input_shape: Sequence[int] | None = None,
                 input_dtype: str = "float32") -> GradientProfile:
    """Build the module `factory` makes (`spec`: package.module:factory, for messages) on the meta device (no memory,
    no data) and read its profile.

    `input_shape` is one sample's shape without the batch dimension (3,224,224 for an
    image; 512 for a sequence of token ids with `input_dtype` "long"); given, FLOPs are
    counted. Errors name the flag `--model-from`, since that is where a spec comes from.
    """
    import torch

    try:
        with torch.device("meta"):
            module = factory()
    except Exception as error:  # a user's factory may fail any way; say which and how
        raise ValueError(f"--model-from {spec}: the factory raised {type(error).__name__}: {error}") from error
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"--model-from {spec}: the factory returned {type(module).__name__}, not a torch.nn.Module")
    example = None
    if input_shape is not None:
        dtype = getattr(torch, input_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"--input-dtype {input_dtype!r} is not a torch dtype; use float32 or long")
        example = torch.zeros((1, *input_shape), dtype=dtype, device="meta")
    try:
        return from_module(module, example)
    except ValueError as error:
        raise ValueError(f"--model-from {spec}: {error}") from error
    except Exception as error:
        raise ValueError(f"--model-from {spec}: forward on an input of shape {tuple(input_shape or ())} failed "
                         f"({type(error).__name__}: {error}); check --input-shape and --input-dtype") from error
