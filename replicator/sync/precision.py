"""Mixed precision: autocast around every step, and fp16's loss scale, applied where backward starts and divided out
in the averaging."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.autograd.graph import GradientEdge

from replicator.comm.collectives import group_size
from replicator.errors import ReplicatorUsageError
from replicator.sync.state import GradientState

if TYPE_CHECKING:
    from replicator.topology import ProcessGroups

__all__ = ["PRECISIONS", "Precision", "LossScale", "MixedPrecision"]

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# torch.amp.GradScaler's own defaults, read from its signature so that they cannot drift apart.
_SCALER = {name: parameter.default for name, parameter in inspect.signature(torch.amp.GradScaler).parameters.items()}


@dataclass(frozen=True)
class Precision:
    """What `rp.Replicator(precision=...)` takes: "fp32", "bf16", "fp16", or this, to tune fp16's loss scale.

    The loss-scale settings and their defaults are torch.amp.GradScaler's: the scale starts at
    `init_scale`, is multiplied by `backoff_factor` after an update whose averaged gradients are
    not finite (the update is skipped), and by `growth_factor` after `growth_interval` finite
    updates in a row.
    """

    name: str = "fp32"
    init_scale: float = float(_SCALER["init_scale"])
    growth_factor: float = float(_SCALER["growth_factor"])
    backoff_factor: float = float(_SCALER["backoff_factor"])
    growth_interval: int = int(_SCALER["growth_interval"])

    @classmethod
    def of(cls, value: str | Precision) -> Precision:
        """`value` as a Precision; raises ReplicatorUsageError naming the choices when it is none of them."""
        settings = value if isinstance(value, Precision) else cls(value) if isinstance(value, str) else None
        if settings is None or settings.name not in PRECISIONS:
            shown = settings.name if settings is not None else value
            raise ReplicatorUsageError(
                f"precision={shown!r} is not one of {tuple(PRECISIONS)} (or rp.Precision('fp16', init_scale=...)): "
                "'bf16' and 'fp16' run step_fn under torch.autocast, 'fp16' with a loss scale as well")
        if not (settings.init_scale > 0 and settings.growth_factor > 1 and 0 < settings.backoff_factor < 1
                and settings.growth_interval >= 1):
            raise ReplicatorUsageError(
                f"{settings} needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1 "
                "(torch.amp.GradScaler's rules)")
        return settings


class LossScale:
    """fp16's dynamic loss scale: torch.amp.GradScaler's settings, state_dict and update rule.

    Each step's updates note whether their averaged gradients were finite (`record`); when the
    step ends, the scale is updated once, by the kernel GradScaler.update() runs itself
    (torch._amp_update_scale_). Averaged gradients are the same on every replica, so every
    replica reaches the same verdicts and keeps the same scale without a word; the stages of a
    pipeline hold different gradients and agree on each verdict before it is recorded
    (SyncedOptimizers, as for nonfinite="skip"). Its state_dict is GradScaler's, so either
    loads the other's; checkpoints keep it after the LR schedulers.
    """

    def __init__(self, settings: Precision, device: torch.device) -> None:
        self.scale = torch.full((), settings.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)  # finite updates in a row
        self.growth_factor, self.backoff_factor = settings.growth_factor, settings.backoff_factor
        self.growth_interval = settings.growth_interval
        self.value = settings.init_scale  # the scale on the host, read once per update
        self._verdicts: list[bool] = []  # this step's updates: were their averaged gradients finite?

    def record(self, finite: bool) -> None:
        """Note one update's verdict (already agreed across a pipeline's stages)."""
        self._verdicts.append(finite)

    def end_step(self) -> None:
        """Update the scale once per step that decided some update, as GradScaler.update() after an iteration."""
        if not self._verdicts:  # an accumulation micro-step: no update, no verdict, the same scale
            return
        found_inf = torch.tensor(0.0 if all(self._verdicts) else 1.0, device=self.scale.device)
        self._verdicts.clear()
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self.value = float(self.scale)

    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's state_dict format."""
        return {"scale": self.value, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["scale"])
        self.scale.fill_(self.value)
        self.growth_tracker.fill_(int(state["_growth_tracker"]))
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])


def check_autocast(device_type: str, dtype: torch.dtype) -> None:
    """Raise ReplicatorUsageError where torch cannot autocast to `dtype` on this device (it would only warn and run
    in fp32: a silent wrong answer to the question the user asked)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.autocast(device_type, dtype=dtype)
    except (RuntimeError, AssertionError, ValueError) as error:
        caught = [warnings.WarningMessage(str(error), RuntimeWarning, "", 0)]
    refusals = [str(w.message) for w in caught if "support" in str(w.message)]
    if refusals:
        name = next((name for name, kind in PRECISIONS.items() if kind == dtype), str(dtype))
        other = "fp16" if name == "bf16" else "bf16"
        raise ReplicatorUsageError(
            f"precision={name!r}: torch {torch.__version__} cannot autocast to {dtype} on {device_type} "
            f"({refusals[0].splitlines()[0]}); use precision={other!r} or 'fp32', or a newer torch")


class Optimizers(Protocol):
    """What MixedPrecision needs of the job's wrapped optimizers (replicator.sync.optimizer.SyncedOptimizers)."""

    state: GradientState
    loss_scale: LossScale | None
    skipped_steps: list[int]

    def reopen_reduced(self, factor: float) -> None: ...

    def finalize_completed(self) -> None: ...


class MixedPrecision:
    """Applies a Precision to run()'s steps: autocast around every step_fn call and, for fp16, the loss scale.

    fp16's loss scale is applied where backward starts: while a step runs, every outermost
    backward pass (`loss.backward()`, `torch.autograd.backward(...)`) starts from its roots'
    gradients times the scale, so step_fn stays as in fp32. Scaling there, rather than at the
    outputs of the modules built in repl.scope(), is exact whatever the loss is made of: a
    term of the parameters themselves (weight decay written by hand), a module's output fed
    to another (a GAN's D(G(z)), a recurrent call) or a submodule called directly are all
    scaled once. Nested passes (a reentrant checkpoint's recomputation) are left alone, and
    so is torch.autograd.grad, whose results go to no optimizer. The roots take the scale
    divided by the number of replicas and of accumulated micro-steps: each sample's
    activation gradients are then bit for bit those of one process on the concatenated batch
    (sums over samples, the weight gradients, are rounded per replica). The averaging multiplies by the inverse
    (GradientState.grad_scale), so unscaling costs no pass of its own; a pipeline scales its
    own losses (`scale_losses`).
    """

    def __init__(self, settings: str | Precision, device: torch.device, optimizers: Optimizers,
                 groups: ProcessGroups) -> None:
        self.settings = Precision.of(settings)
        self.name = self.settings.name
        self.dtype = PRECISIONS[self.name]
        self.device_type = device.type
        if self.dtype is not None:
            check_autocast(self.device_type, self.dtype)
        # The scale lives on the host even for CUDA replicas: GradScaler's update kernel runs there, so
        # reading it each step never waits for the GPU, and a CPU scalar multiplies CUDA losses as is.
        self.loss_scale = LossScale(self.settings, torch.device("cpu")) if self.name == "fp16" else None
        optimizers.loss_scale = self.loss_scale  # it decides every update (SyncedOptimizers)
        self.optimizers = optimizers
        self.state: GradientState = optimizers.state
        self.replicas = group_size(groups.replica)  # those that average the gradients
        self._roots = torch.ones((), device=device)  # what this step's roots' gradients are multiplied by
        self._pipelines = 0  # inside a pipeline's step, which scales its own losses
        self._run_start = 0

    # -- around run() and its steps ---------------------------------------------------
    def begin_run(self) -> None:
        self._run_start = self.state.step

    def figures(self) -> dict[str, Any]:
        """For repl.last_run: the precision, the steps of this run whose update was skipped, the final loss scale."""
        figures: dict[str, Any] = {"precision": self.name,
                                   "skipped_steps": [s for s in self.optimizers.skipped_steps if s >= self._run_start]}
        if self.loss_scale is not None:
            figures["loss_scale"] = self.loss_scale.value
        return figures

    def states(self) -> list[LossScale]:
        """What checkpoints keep besides the LR schedulers."""
        return [self.loss_scale] if self.loss_scale is not None else []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step_fn call of run(): autocast and, for fp16, the scaled backward passes."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            if self.loss_scale is None:
                yield
                return
            divisor = float(self.replicas * self.state.accumulation)
            self._roots = self.loss_scale.scale / divisor
            original = torch.autograd.backward
            torch.autograd.backward = self._scaled(original)
            self.state.grad_scale = self.loss_scale.value / divisor
            try:
                yield
            finally:
                torch.autograd.backward = original
                self.state.grad_scale = 1.0
        self.loss_scale.end_step()

    @property
    def scale_losses(self) -> Callable[[], contextlib.AbstractContextManager[Callable[[torch.Tensor],
                                                                                       torch.Tensor]]] | None:
        """fp16: what a pipeline stage enters around its training step (replicator.pipeline.StageHooks)."""
        return self._pipeline_step if self.loss_scale is not None else None

    @contextlib.contextmanager
    def _pipeline_step(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """A stage's backward passes start from gradients it received, already scaled, or from its own losses,
        which it scales with what this yields: the scaling of every outermost backward pass stands aside."""
        self._pipelines += 1
        try:
            yield lambda loss: loss * self._roots
        finally:
            self._pipelines -= 1
        if self.replicas == 1:
            self.optimizers.finalize_completed()

    def _scaled(self, original: Callable[..., None]) -> Callable[..., None]:
        def backward(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> None:
            if "grad_variables" in kwargs:  # torch's deprecated name of grad_tensors
                grad_tensors = kwargs.pop("grad_variables")
            if self._pipelines or torch._C._current_graph_task_id() != -1:
                return original(tensors, grad_tensors, *args, **kwargs)
            # A second backward pass before step() adds to averages already unscaled (and divided over the
            # micro-steps): each replica takes them back to its own units first, which the next round undoes.
            self.optimizers.reopen_reduced(self.state.grad_scale * self.state.accumulation)
            original(tensors, self._root_gradients(tensors, grad_tensors), *args, **kwargs)
            if self.replicas == 1:  # replicas average (and unscale) at the end of backward: so does one
                self.optimizers.finalize_completed()

        return backward

    def _root_gradients(self, tensors: Any, grad_tensors: Any) -> list[torch.Tensor | None]:
        """The gradients a backward pass starts from, times the scale (torch makes a scalar root's 1 itself)."""
        roots = [tensors] if isinstance(tensors, (torch.Tensor, GradientEdge)) else list(tensors)
        if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
            given = [grad_tensors] * len(roots) if grad_tensors is None else [grad_tensors]
        else:
            given = list(grad_tensors)
        scaled: list[torch.Tensor | None] = []
        for root, grad in zip(roots, given):
            if grad is not None:
                scaled.append(grad * self._roots)
            elif isinstance(root, torch.Tensor) and root.requires_grad and root.numel() == 1:
                # As GradScaler.scale(loss).backward(): the root's gradient is the scale, in the root's dtype.
                scaled.append((torch.ones_like(root, dtype=torch.float32) * self._roots).to(root.dtype))
            else:
                scaled.append(None)  # torch raises its own error (a non-scalar root needs a gradient)
        return scaled
