"""Tolerances derived from rounding-error analysis (dtype epsilon, magnitudes, reduction length), not from one CPU.

Why the suite needs this: two computations of the same mathematical value by different kernels (another batch
shape, thread count, SIMD width, reduction order, autocast) agree only up to rounding, and which kernel runs
follows the CPU (MKL picks its GEMM by instruction set, ATen its vectorized reductions by
ATEN_CPU_CAPABILITY). A bound measured on one CPU is a few ulp that another CPU exceeds; a bound derived here
holds on every CPU, and still fails any real bug (a row, sample or step out of place moves a value by O(1)
of its magnitude, not by n * eps).

The one fact used (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5 and Lemma 3.1):
a sum or dot product of n terms computed in floating point, in ANY order and blocking, with or without FMA,
differs from the exact value by at most

    gamma_n * sum(|terms|),     gamma_n = n*u / (1 - n*u),     u = eps/2 (the unit roundoff).

Two kernels each lie within that of the exact value, so within 2 * gamma_n * sum(|terms|) of each other;
that is `bound()`. Where bit-equality is promised instead (the same inputs, shapes and order on both sides,
e.g. every replica applying the same averaged gradient), tests keep `torch.equal` and say why it holds.
"""

from __future__ import annotations

import torch

Number = float | torch.Tensor


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of one rounding to `dtype` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def gamma(length: int, dtype: torch.dtype) -> float:
    """Higham's gamma_n: the relative error bound of an n-term sum or dot product in any order."""
    nu = length * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"a reduction of {length} terms in {dtype} has no useful error bound (n*u = {nu:.3g} >= 1)")
    return nu / (1 - nu)


def bound(dtype: torch.dtype, magnitude: Number, length: int, *, steps: int = 1, sides: int = 2) -> Number:
    """How far two correct results may lie apart: sides * steps * gamma(length) * magnitude.

    magnitude: sum(|terms|) of the reduction that produced a value (a tensor gives one bound per element);
        where it is not known term by term, the largest |value| the computation passes through, times the
        number of terms it adds, over-estimates it.
    length: the number of roundings a value passes through: a reduction's terms, plus one for each operation
        applied after it (a bias, an activation, an optimizer's update).
    steps: training steps whose errors accumulate. To first order each step carries the previous error on
        (its Jacobian is near the identity for the small learning rates of the tests) and adds its own, so the
        bounds add up; this is a first-order estimate, not a proof for training that amplifies its errors.
    sides: 2 when both results are rounded (two kernels), 1 when one of them is exact or computed in a much
        wider dtype.
    """
    return sides * steps * gamma(length, dtype) * magnitude


def linear_bound(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Element by element bound for inputs @ weight.T + bias computed by two different GEMM kernels.

    Each output is a dot product of in_features terms |x_k * w_k|, plus the bias: in_features + 1 roundings.
    """
    magnitude = inputs.abs() @ weight.abs().T
    if bias is not None:
        magnitude = magnitude + bias.abs()
    return torch.as_tensor(bound(inputs.dtype, magnitude, weight.shape[1] + 1))


def assert_within(got: torch.Tensor, want: torch.Tensor, tolerance: Number, what: str = "") -> None:
    """Fail with the worst element, its difference and its bound when |got - want| > tolerance anywhere."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    difference = (got.double() - want.double()).abs()
    allowed = torch.as_tensor(tolerance, dtype=torch.float64).expand_as(difference)
    excess = difference - allowed
    if bool((excess > 0).any()) or not bool(torch.isfinite(got).eq(torch.isfinite(want)).all()):
        worst = int(excess.flatten().argmax())
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {difference.numel()} elements off; the worst, flat index "
            f"{worst}, by {difference.flatten()[worst].item():.3g} where the bound is "
            f"{allowed.flatten()[worst].item():.3g}"
        )


def momentum_sgd_bound(gradients: list[list[torch.Tensor]], learning_rates: list[float], momentum: float,
                       relative_error: float) -> list[float]:
    """Per parameter tensor: how far two runs of SGD with momentum may end apart when every gradient they apply
    may differ by `relative_error` of its size (two kernels' roundings), to first order.

    gradients[s] and learning_rates[s]: what one run applied at its s-th update. A gradient applied at update s
    reaches the final parameters through the momentum buffer of every later update t, weighted by
    learning_rates[t] * momentum**(t - s); an error of e * |g_s| in it moves them by at most that much. One bound per
    tensor, its largest element's: a rounding in one activation reaches every weight of its row, so an element
    whose own gradient happens to cancel to near zero still inherits its neighbours' errors. First order: the
    parameters' own drift changes later gradients by learning rate x curvature x drift, smaller still.
    """
    updates = len(gradients)
    bounds = [0.0] * len(gradients[0])
    for s, applied in enumerate(gradients):
        reach = sum(learning_rates[t] * momentum ** (t - s) for t in range(s, updates))
        for index, gradient in enumerate(applied):
            bounds[index] += relative_error * reach * float(gradient.abs().max())
    return bounds


def largest(tensors: list[torch.Tensor]) -> float:
    """The largest |element| among tensors: the magnitude of values a computation passes through."""
    return max(float(t.detach().abs().max()) for t in tensors if t.numel())


def training_bound(dtype: torch.dtype, values: list[torch.Tensor], length: int, steps: int) -> float:
    """How far two trainings of the same model on the same samples may end apart when their batches are cut
    differently (replicas, micro-batches, stages): each step's gradients are the same sums in another order and
    through other kernels, gamma_length relative at most, and the parameters carry each step's error on.

    values: the parameters compared; their largest |element| stands for the magnitude each update is rounded at.
    length: the longest reduction behind one gradient element in one step (the samples or tokens it sums over,
    plus the widest fan-in its backward passes through, plus a few roundings for the optimizer's update).
    A first-order estimate (see `bound`); a sample counted twice or an average over the wrong count is off by a
    fraction of a gradient, orders of magnitude more.
    """
    return float(bound(dtype, largest(values), length, steps=steps))


# The pipeline tests' small models compare max differences computed inside the replicas, where the values' own
# magnitudes are not at hand, so their magnitude is stated: Linear layers of fan-in <= 16 whose weights start
# within 1/sqrt(fan-in) <= 1 and move by a few steps of lr <= 0.5, losses of <= 10 classes (log 10 = 2.3 at the
# start, falling): every parameter and loss stays within 4. Each step sums a batch of <= 16 samples through fan-ins
# of <= 16, then the loss's mean and the optimizer's update: 16 + 16 + 4 roundings.
SMALL_MODEL_MAGNITUDE = 4.0
SMALL_MODEL_LENGTH = 16 + 16 + 4


def small_model_bound(steps: int) -> float:
    """`bound` for a small model (see above) trained `steps` steps on batches cut two different ways."""
    return float(bound(torch.float32, SMALL_MODEL_MAGNITUDE, SMALL_MODEL_LENGTH, steps=steps))
