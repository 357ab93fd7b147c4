"""No silent divergence: replicas' parameters and optimizer state compared, and unsynchronized gradients refused.

`ReplicaGuard.require_identical` compares everything a replica trains with (the built modules'
parameters and buffers, the wrapped optimizers' parameters, state and hyperparameters) in
one agreement of two digests: at the start and end of `run()` and before every checkpoint.
`UnownedGradients` catches the usual cause of drift early: a trainable parameter that gets a
gradient and is updated although no wrapped optimizer owns it (`repl.wrap_optimizer` forgotten).
"""

from __future__ import annotations

import functools
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from replicator.comm.agreement import Agreement
from replicator.errors import ReplicatorUsageError
from replicator.identity import Fingerprints, fingerprint, require_identical
from replicator.nn.spectral import SPECTRAL_NORM_RULE, power_iteration_buffers
from replicator.sync.fsdp import is_sharded
from replicator.sync.optimizer import SyncedOptimizers

__all__ = ["ReplicaGuard", "UnownedGradients"]

_ADVICE = (
    "Training them together would average gradients of different models. Build the model and wrap its "
    "optimizers inside `with repl.scope():` (which copies replica 0's values to every replica), change parameters "
    "only through wrapped optimizers, and after loading weights or optimizer state on some replicas only (Horovod's "
    "recipe: on replica 0) call repl.broadcast_state(model, optimizer) on every replica, or use repl.restore()."
)
_PLAIN = (bool, int, float, str, type(None))


class ReplicaGuard:
    """Compares what the replicas train with; watches for gradients nobody synchronizes.

    `modules()` gives the modules being trained (those built in repl.scope(), or this
    process's pipeline stages); `names` names their tensors in errors.
    """

    def __init__(self, agreement: Agreement, optimizers: SyncedOptimizers,
                 modules: Callable[[], list[torch.nn.Module]], names: dict[int, str],
                 optimizer_state: bool = True) -> None:
        self.agreement = agreement
        # DiLoCo's sync groups keep their own inner optimizer state (as the paper): only the rest must agree.
        self.optimizer_state = optimizer_state
        self.optimizers = optimizers
        self.modules = modules
        self.names = names
        self._fingerprints = Fingerprints()

    def require_identical(self, where: str) -> None:
        """Raise on every replica unless all hold bit-identical parameters, buffers and optimizer state."""
        if self.agreement.size > 1:
            named = self.named_state()
            require_identical(self.agreement, named, where, functools.partial(self._advice, named), self._fingerprints)

    def _advice(self, named: list[tuple[str, torch.Tensor]], differing: list[str]) -> str:
        """The usual advice, preceded by spectral norm's rule when its power-iteration buffers are among those named."""
        iterated = power_iteration_buffers(self.modules())
        spectral = {name for name, tensor in named if id(tensor) in iterated}
        if not spectral.intersection(differing):
            return _ADVICE
        return SPECTRAL_NORM_RULE if spectral.issuperset(differing) else f"{SPECTRAL_NORM_RULE} {_ADVICE}"

    def named_state(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the replicas must agree on, named, in an order every replica shares."""
        named: list[tuple[str, torch.Tensor]] = []
        listed: set[int] = set()

        def add(name: str, tensor: torch.Tensor) -> None:
            if is_sharded(tensor):  # shard="parameters": each replica holds other shards of it, by design
                return
            if id(tensor) not in listed:
                listed.add(id(tensor))
                named.append((name, tensor))

        for module in self.modules():
            prefix = type(module).__name__
            for name, tensor in [*module.named_parameters(prefix=prefix), *module.named_buffers(prefix=prefix)]:
                add(self.names.get(id(tensor), name), tensor)
        for wrapped in self.optimizers.wrapped:
            optimizer, label = wrapped.optimizer, wrapped.synchronizer.label
            for number, group in enumerate(optimizer.param_groups):
                add(f"{label} param_groups[{number}] options", _options(group))
                for param in group["params"]:
                    param_name = wrapped.synchronizer.name_of(param)
                    add(param_name, param)
                    state_of = optimizer.state.get(param, {}) if self.optimizer_state else {}
                    for key, value in sorted(state_of.items(), key=lambda item: str(item[0])):
                        state = _as_tensor(value)
                        if state is not None:
                            add(f"{label} state {key!r} of {param_name}", state)
        return named

    def watch_gradients(self) -> UnownedGradients:
        """An observer of the run that refuses updates from gradients no wrapped optimizer synchronized."""
        unowned = [(self.names.get(id(p), name), p) for module in self.modules()
                   for name, p in module.named_parameters(prefix=type(module).__name__)
                   if p.requires_grad and not is_lazy(p) and id(p) not in self.optimizers.owner]
        return UnownedGradients(self.agreement, list({id(p): (n, p) for n, p in unowned}.values()))


def _options(group: dict[str, Any]) -> torch.Tensor:
    """One number for a parameter group's options (lr, momentum, betas...): a replica with another lr trains apart."""
    parts = []
    for key in sorted(key for key in group if key != "params"):
        value = group[key]
        if isinstance(value, torch.Tensor):  # a tensor lr: its value, not its repr (which names the device)
            parts.append(f"{key}={fingerprint(value)}")
        elif isinstance(value, _PLAIN) or (isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN)
                                                                                     for v in value)):
            parts.append(f"{key}={value!r}")
    return torch.tensor([zlib.crc32(";".join(parts).encode("utf-8"))], dtype=torch.int64)


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, int, float)):
        return torch.tensor([float(value)], dtype=torch.float64)
    return None


class UnownedGradients:
    """A run observer: a trainable parameter that no wrapped optimizer owns must not be trained.

    Post-accumulate-grad hooks on those parameters only (usually none) note a gradient as
    backward produces it, even if step_fn clears it again; the parameter's version counter,
    which every in-place update (an optimizer's step) advances, tells whether it then changed.
    Gradients alone are fine, as under DDP (a body that fine-tuning does not train but forgot to
    freeze stays identical). The replicas compare notes after the run's 1st, 2nd, 4th, 8th...
    step, in one agreement of two counts, and stop once no replica has such parameters; an
    update anywhere raises on every replica. On one replica nothing can diverge: it warns.
    """

    def __init__(self, agreement: Agreement, watched: list[tuple[str, torch.Tensor]]) -> None:
        self.agreement = agreement
        self.seen: dict[int, str] = {}
        self._order = {id(param): number for number, (_, param) in enumerate(watched)}  # the model's order
        self._params = {id(param): param for _, param in watched}
        self._versions = {id(param): param._version for _, param in watched}
        self._hooks = [param.register_post_accumulate_grad_hook(functools.partial(self._saw, name))
                       for name, param in watched]
        self._watching = True
        self._steps = 0

    def _saw(self, name: str, param: torch.Tensor) -> None:
        self.seen.setdefault(id(param), name)

    def on_input_wait(self, seconds: float) -> None:
        pass

    def on_agreement_wait(self, seconds: float) -> None:
        pass

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        self._steps += 1
        if self._watching and not self._steps & (self._steps - 1):  # a power of two: log2(steps) checks in all
            self.check(step)

    def check(self, step: int) -> None:
        trained = sorted((key for key in self.seen if self._params[key]._version != self._versions[key]),
                         key=self._order.__getitem__)
        names = ", ".join(self.seen[key] for key in trained)
        if self.agreement.size == 1:
            if trained:
                warnings.warn(f"{names} got gradients and were updated, but no optimizer wrapped with "
                              "repl.wrap_optimizer() owns them: on one replica this trains as plain PyTorch does, "
                              "but with several replicas each would train its own copy, and run() raises",
                              stacklevel=2)
                self._stop()
            return
        # The label is what a user reads when replicas diverge here: what run() was doing, in their terms.
        what = f"run() after {step + 1} step(s): checking that no parameter is updated without repl.wrap_optimizer()"
        verdict = self.agreement.require_same(what, "", [len(self._hooks), len(trained)])
        if verdict.maxima[1]:
            self._stop()
            raise ReplicatorUsageError(
                f"{names or 'parameters on another replica'} got gradients and were updated by step {step}, but no "
                f"optimizer wrapped with repl.wrap_optimizer() owns them (raised on replica {self.agreement.rank}): "
                "nobody averages their gradients, so every replica would train its own copy of the model. Wrap the "
                "optimizer that updates them inside the scope, `optimizer = repl.wrap_optimizer(torch.optim.SGD("
                "model.parameters(), ...))`, or freeze them with requires_grad_(False)"
            )
        if verdict.maxima[0] == 0:  # no replica has such parameters: nothing more to watch
            self._stop()

    def _stop(self) -> None:
        self._watching = False
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def on_run_end(self) -> None:
        self._stop()
