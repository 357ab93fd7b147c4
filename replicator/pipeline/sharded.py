"""A stage sharded with FSDP2 (shard="parameters"): its units gathered once per step, reduce-scattered once after it.

FSDP2 on its own gathers a unit's parameters in every forward and backward and reduce-scatters
its gradients at the end of every backward pass: a stage running M micro-batches would gather
2M times and reduce-scatter M partial sums, where one step needs one of each. So around a
training step the stage (every replica of it alike, in module order):

- `begin()`: keeps the units gathered for the whole step (`reshard_after_forward`,
  `reshard_after_backward` off), lets every backward pass accumulate the unsharded gradients
  without a collective (`requires_gradient_sync` off) and gathers every unit now, before any
  of the step's computation, so that a step failing part way on one replica cannot leave the
  others waiting in a unit's all-gather;
- `reduce()`: once every replica's step succeeded, reduce-scatters each unit's accumulated
  gradient once, hands each replica its shard of the average, and reshards the parameters;
- `discard()`: once some replica's step failed, drops the accumulated gradients and reshards,
  with no collective, on every replica alike.

`reduce()` runs FSDP2's post-backward by hand, after the schedule's last backward, as
torch.distributed.pipelining's stage does (`perform_reduce_grad`): a split backward's weight
pass (zero-bubble schedules) runs outside the autograd hooks FSDP2 would otherwise reduce in.
Like it, it reads FSDP2's internal state (`fully_shard.state(unit)`'s parameter groups);
tests/pipeline/test_pipeline_sharding.py fails on a torch that changes it. Internal to
replicator.pipeline.
"""

from __future__ import annotations

from torch import nn

from replicator._torch_names import FSDPModule, fsdp_param_groups, fully_shard

__all__ = ["ShardedUnits"]


class ShardedUnits:
    """The FSDP2 units of one stage's module, and what a training step does with them (see the module)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._units: list[FSDPModule] = []

    @property
    def units(self) -> list[FSDPModule]:
        """The stage's FSDP2 units, in module order; found once they exist (repl.scope() shards the stage when it
        ends, after repl.pipeline() built it)."""
        if not self._units:
            self._units = [m for m in self._module.modules() if isinstance(m, FSDPModule)]
        return self._units

    def begin(self) -> None:
        """Before the step's first forward: keep every unit gathered and every gradient local; gather them now."""
        for unit in self.units:
            if hasattr(unit, "set_reshard_after_forward"):  # else (older torch) gathered again for each micro-batch
                unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_is_last_backward(False)
        for unit in self.units:
            unit.unshard()

    def reduce(self) -> None:
        """After the step succeeded on every replica: one reduce-scatter per unit, then every unit resharded."""
        self._end_of_step()
        states = [fully_shard.state(unit) for unit in self.units]  # type: ignore[attr-defined]
        for state in states:
            for group in fsdp_param_groups(state):
                group.post_backward()
        # The root's end-of-backward callback waits for the reductions and resets the iteration's state.
        for state in states:
            if state._is_root:
                state._root_post_backward_final_callback()

    def discard(self) -> None:
        """After the step failed on some replica: drop the accumulated gradients and reshard, with no collective."""
        self._end_of_step()
        for unit in self.units:
            state = fully_shard.state(unit)  # type: ignore[attr-defined]
            if state._is_root and hasattr(unit, "reset_iter_state"):  # the iteration's trackers (recent torch)
                unit.reset_iter_state()
            for group in fsdp_param_groups(state):
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):
                        param.unsharded_param.grad = None
                group.reshard()

    def _end_of_step(self) -> None:
        """Back to FSDP2's behaviour between steps (an evaluation's forward gathers and frees each unit)."""
        for unit in self.units:
            if hasattr(unit, "set_reshard_after_forward"):
                unit.set_reshard_after_forward(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_is_last_backward(True)
