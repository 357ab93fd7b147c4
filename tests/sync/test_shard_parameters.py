"""shard="parameters" (ZeRO-3): the scope's modules sharded with FSDP2, bit for bit what plain FSDP2 gives.

Why bit for bit against plain FSDP2: both shard the same units (every direct child holding
parameters, then the root) over the same two processes, from the same initial values, so
every all-gather, reduce-scatter and optimizer step is the same arithmetic on the same shards;
replicator adds no arithmetic of its own (its clip, when asked, multiplies the shards by the same
factor torch.nn.utils.clip_grads_with_norm_ computes). Against one process the reductions run
in another order, so there the comparison has a tolerance.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import replicator as rp
from replicator.errors import ReplicatorUsageError
from replicator.testing import run_replicas

REPLICAS = 2
GLOBAL_BATCH = 12
STEPS = 4
LR = 0.05
EPS = torch.finfo(torch.float32).eps
# Against one process: every update moves a parameter by at most lr (Adam's |m / sqrt(v)| <= ~1; SGD's
# |grad| < 1 here), in a direction that differs from one process's by the roundings on its way, bounded
# by 32 ulps relative: the batch sum in another order (log2(GLOBAL_BATCH) < 4), the sum over replicas
# (<= 2), the moments, root and quotient (~10), doubled for the momentum that carries earlier steps'.
# STEPS updates add up (the same derivation as tests/sync/test_sharding.py's).
ONE_PROCESS_ATOL = STEPS * LR * 32 * EPS


class Net(torch.nn.Module):
    """Three units of different sizes, and a parameter of one element (fewer than the replicas) in the root."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 16)
        self.hidden = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 6)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(torch.tanh(self.embed(x))))) * self.scale


UNITS = ("embed", "hidden", "head")  # the default policy's units: the direct children holding parameters


def every_linear(name: str, module: torch.nn.Module) -> bool:
    """A shard_policy of the user's: every Linear its own unit (hidden's two layers apart)."""
    return isinstance(module, torch.nn.Linear)


def units_of(model: Net, case: str) -> list[torch.nn.Module]:
    if case == "policy":
        return [m for m in reversed(list(model.modules())) if isinstance(m, torch.nn.Linear)]
    return [getattr(model, name) for name in UNITS]


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randn(GLOBAL_BATCH, 6, generator=generator)


def my_batch(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    share = GLOBAL_BATCH // replicas
    return x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share]


def whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def local_bytes(tensors: list[torch.Tensor]) -> int:
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in locals_)


def batch_of(step: int, replica: int, replicas: int, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = my_batch(step, replica, replicas)
    if case == "skip" and step == 1 and replica == replicas - 1:
        x = x.clone()
        x[-1, 0] = float("nan")  # the last replica's batch only: every replica must skip this update
    return x, y


def reference(kind: str, case: str) -> list[torch.Tensor]:
    """One process, the whole batch each step."""
    torch.manual_seed(0)
    model = Net()
    optimizer = make_optimizer(kind, model.parameters())
    for step in range(STEPS):
        if case == "skip" and step == 1:
            continue
        x, y = global_batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if case == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
    return [whole(p) for p in model.parameters()]


def plain_fsdp2(kind: str, case: str) -> list[torch.Tensor]:
    """torch's FSDP2 by hand, with the same units, in the processes replicator already joined."""
    torch.manual_seed(0)
    model = Net()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for unit in units_of(model, case):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(kind, model.parameters())
    for step in range(STEPS):
        x, y = batch_of(step, dist.get_rank(), dist.get_world_size(), case)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16"):  # as precision="bf16" does
            F.mse_loss(model(x), y).backward()
        if case == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if all(bool(torch.isfinite(p.grad.full_tensor()).all()) for p in model.parameters()):
            optimizer.step()
    return [whole(p) for p in model.parameters()]


def train(kind: str, case: str) -> dict[str, Any]:
    """Inside a replica: shard="parameters", then plain FSDP2, in the same processes."""
    repl = rp.Replicator(shard="parameters", nonfinite="skip" if case == "skip" else "raise",
                         precision="bf16" if case == "bf16" else "fp32")
    with repl.scope(shard_policy=every_linear if case == "policy" else None):
        torch.manual_seed(0)
        model = Net()
        if case != "two_blocks":
            optimizer = repl.wrap_optimizer(make_optimizer(kind, model.parameters()))
    if case == "two_blocks":  # the model sharded when the first block ended; its optimizer wrapped in a second
        with repl.scope():
            optimizer = repl.wrap_optimizer(make_optimizer(kind, model.parameters()))
    seen: dict[str, Any] = {"gathered": 0}

    def note_gathered(module: torch.nn.Module, args: Any) -> None:
        # Runs after FSDP2's own pre-forward hook (registered first): what is gathered while this layer runs.
        plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
        seen["gathered"] = max(seen["gathered"], sum(p.numel() * p.element_size() for p in plain))

    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_pre_hook(note_gathered)

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> Any:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if case == "clip":
            seen.setdefault("norms", []).append(float(repl.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()
        params = list(model.parameters())
        states = [v for p in params for k, v in optimizer.state[p].items() if k != "step"]
        if any(p.grad is None for p in params):  # a skipped update drops the gradients
            return None
        seen["grad_dtypes"] = {str(p.grad.dtype) for p in params}  # what was reduce-scattered
        seen["model_state_bytes"] = local_bytes(params) + local_bytes([p.grad for p in params]) + local_bytes(states)
        return None

    def input_fn(ctx: rp.InputContext):
        for step in range(STEPS):
            yield batch_of(step, ctx.input_pipeline_id, ctx.num_input_pipelines, case)

    for _ in repl.run(step_fn, repl.prepare_input(input_fn), record=False):
        pass
    params = list(model.parameters())
    result = {"sharded": all(isinstance(p, DTensor) for p in params), "params": [whole(p) for p in params],
              "units": sum(isinstance(m, FSDPModule) for m in model.modules()), "skipped": list(repl.skipped_steps),
              "fsdp2": plain_fsdp2(kind, case), "elements": sum(whole(p).numel() for p in params),
              "rows": [whole(p).shape[0] if whole(p).dim() else 1 for p in params],
              "row_elements": [whole(p)[0].numel() if whole(p).dim() else 1 for p in params], **seen}
    repl.close()
    return result


CASES = [("sgd", "plain"), ("adamw", "plain"), ("adamw", "clip"), ("adamw", "policy"), ("sgd", "skip"),
         ("adamw", "bf16"), ("sgd", "two_blocks")]


def train_cases() -> dict[tuple[str, bool], dict[str, Any]]:
    return {case: train(*case) for case in CASES}


def test_shard_parameters_matches_fsdp2_bit_for_bit_and_one_process_within_rounding() -> None:
    results = run_replicas(train_cases, REPLICAS, timeout_s=300)
    for kind, case in CASES:
        expected = reference(kind, case)
        for replica, by_case in enumerate(results):
            got = by_case[(kind, case)]
            where = f"{kind}, {case}, replica {replica} of {REPLICAS}"
            assert got["sharded"], where
            assert got["units"] == (5 if case == "policy" else 4), where  # the units and the root
            assert got["skipped"] == ([1] if case == "skip" else []), where
            # Under bf16 autocast only the computation is bf16: the parameters, and so the gradients FSDP2
            # reduce-scatters, stay fp32 (FSDP2 reduces in the gradients' dtype without a MixedPrecisionPolicy).
            assert got["grad_dtypes"] == {"torch.float32"}, where
            assert all(torch.equal(a, b) for a, b in zip(got["params"], got["fsdp2"], strict=True)), where
            # Under bf16 one process in fp32 computes another function: plain FSDP2 under autocast is the check.
            for a, b in zip(got["params"], expected if case != "bf16" else got["params"], strict=True):
                assert torch.allclose(a, b, atol=ONE_PROCESS_ATOL, rtol=0), f"{where}: {(a - b).abs().max()}"
            # Model state counted from the local tensors: parameter, gradient and optimizer state per element
            # (fp32: 4 + 4 + 8 for AdamW, 4 + 4 + 4 for SGD with momentum), 1/N of each up to FSDP2's padding
            # (dimension 0 cut in ceil(rows / N) rows: at most one row of each tensor more than 1/N).
            per_element = 16 if kind == "adamw" else 12
            psi = got["elements"]
            padding = sum(got["row_elements"])
            assert per_element * psi / REPLICAS - per_element * padding <= got["model_state_bytes"], where
            assert got["model_state_bytes"] <= per_element * (psi / REPLICAS + padding), where
        # The replicas' local tensors together are the whole state, once.
        assert sum(r[(kind, case)]["model_state_bytes"] for r in results) == per_element * psi
        # Gathered during forward: the largest unit (hidden, 32*16 + 32 + 16*32 + 16 elements) and the root's
        # own parameter (scale), never the whole model.
        largest_unit = (32 * 16 + 32 + 16 * 32 + 16 if case != "policy" else 32 * 16 + 32 + 16 * 6 + 6) * 4
        assert all(r[(kind, case)]["gathered"] <= largest_unit + 4 for r in results)
        assert all(r[(kind, case)]["gathered"] < psi * 4 for r in results)


def refusals() -> list[str]:
    """Inside a replica: what an optimizer over the model's parameters from before the sharding and
    broadcast_state() raise, before any update (accumulation: tests/sync/test_shard_accumulation.py)."""
    found = []
    repl = rp.Replicator(shard="parameters")
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        before = list(model.parameters())  # the plain parameters, replaced by shards when the block ends
    try:
        with repl.scope():
            repl.wrap_optimizer(torch.optim.SGD(before, lr=0.1))
    except ReplicatorUsageError as error:
        found.append(str(error))
    try:
        repl.broadcast_state(model)
    except ReplicatorUsageError as error:
        found.append(str(error))
    repl.close()
    repl = rp.Replicator(shard="gradients")
    try:
        with repl.scope(shard_policy=every_linear):
            pass
    except ReplicatorUsageError as error:
        found.append(str(error))
    repl.close()
    return found


def test_shard_parameters_refuses_what_it_cannot_do_on_every_replica() -> None:
    for found in run_replicas(refusals, REPLICAS, timeout_s=120):
        assert len(found) == 3, found
        assert "not a parameter of a module built in this repl.scope() block" in found[0], found[0]
        assert "built before the model was sharded" in found[0]
        assert "cannot copy replica 0's values of a model sharded with shard='parameters'" in found[1], found[1]
        assert "picks the units that shard='parameters' shards, but this Replicator has shard='gradients'" in found[2]


def save(path: str, shard: str | None) -> dict[str, Any]:
    """Inside a replica: two AdamW steps with `shard`, then repl.save(); the whole values saved."""
    repl = rp.Replicator(shard=shard)
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", model.parameters()))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    batches = [my_batch(step, repl.replica_id, repl.num_replicas) for step in range(2)]
    for _ in repl.run(step_fn, batches, record=False):
        pass
    repl.save(path)
    params = list(model.parameters())
    saved = {"params": [whole(p) for p in params],
             "exp_avg": [whole(optimizer.state[p]["exp_avg"]) for p in params], "step": repl.global_step}
    repl.close()
    return saved


def restore(path: str, shard: str | None) -> dict[str, Any]:
    """Inside a replica: restore the sharded checkpoint with `shard`."""
    repl = rp.Replicator(shard=shard)
    with repl.scope():
        torch.manual_seed(1)  # other initial values: the checkpoint must replace them
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", model.parameters()))
    repl.restore(path)
    params = list(model.parameters())
    restored = {"params": [whole(p) for p in params],
                "exp_avg": [whole(optimizer.state[p]["exp_avg"]) for p in params], "step": repl.global_step,
                # laid out as its parameter, so that the next step can run: shards of it, or whole
                "state_sharded": {isinstance(optimizer.state[p]["exp_avg"], DTensor) for p in params}}
    repl.close()
    return restored


def test_a_sharded_checkpoint_restores_unsharded_on_one_process_and_on_two_and_sharded() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "sharded")
        saved = run_replicas(save, REPLICAS, path, "parameters", timeout_s=120)[0]
        for replicas, shard in ((1, None), (REPLICAS, None), (REPLICAS, "parameters")):
            for restored in run_replicas(restore, replicas, path, shard, timeout_s=120):
                assert restored["step"] == saved["step"] == 2
                assert restored["state_sharded"] == {shard == "parameters"}
                for key in ("params", "exp_avg"):
                    assert all(torch.equal(a, b) for a, b in zip(restored[key], saved[key], strict=True)), key
        # And back: a checkpoint of one process without sharding restores sharded on two.
        path = os.path.join(directory, "plain")
        saved = run_replicas(save, 1, path, None, timeout_s=120)[0]
        for restored in run_replicas(restore, REPLICAS, path, "parameters", timeout_s=120):
            assert restored["state_sharded"] == {True}
            for key in ("params", "exp_avg"):
                assert all(torch.equal(a, b) for a, b in zip(restored[key], saved[key], strict=True)), key


def train_to(directory: str, steps: int) -> list[torch.Tensor]:
    """Inside a replica: AdamW with shard="parameters" to `steps`, saving every 2 steps and resuming from the newest."""
    repl = rp.Replicator(shard="parameters")
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", model.parameters()))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    batches = [my_batch(step, repl.replica_id, repl.num_replicas) for step in range(STEPS)]
    for _ in repl.run(step_fn, batches, steps, checkpoint_every=2, checkpoint_dir=directory, record=False):
        pass
    params = [whole(p) for p in model.parameters()]
    repl.close()
    return params


def test_training_resumed_from_a_sharded_checkpoint_is_bit_equal_to_an_uninterrupted_run() -> None:
    with tempfile.TemporaryDirectory() as directory:
        uninterrupted = run_replicas(train_to, REPLICAS, os.path.join(directory, "whole"), STEPS, timeout_s=120)
        run_replicas(train_to, REPLICAS, os.path.join(directory, "cut"), 2, timeout_s=120)  # saves at step 2
        resumed = run_replicas(train_to, REPLICAS, os.path.join(directory, "cut"), STEPS, timeout_s=120)
    for replica in range(REPLICAS):
        assert all(torch.equal(a, b) for a, b in zip(resumed[replica], uninterrupted[replica], strict=True))
