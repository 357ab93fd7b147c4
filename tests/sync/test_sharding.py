"""shard="optimizer" / "gradients" (ZeRO-1/2): bit for bit what shard=None gives, with 1/N of the optimizer state.

Why bit for bit: both levels reduce every bucket with the same reducer as shard=None (the same
additions in the same order: the shared-memory reducer's owner of a slice sums the rows of that
slice with one `sum(dim=0)`, Gloo's all-reduce the same way on every run), and each replica then
applies the optimizer's element-wise arithmetic to its slice of the same averaged gradient.
Against one process the summation order differs, so there the comparison has a tolerance.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_replicas

GLOBAL_BATCH = 12  # divides by 1, 2, 3
STEPS = 4
LRS = (0.05, 0.1)
EPS = torch.finfo(torch.float32).eps
# Against one process: every update moves a parameter by at most lr (Adam's |m / sqrt(v)| <= ~1; SGD's
# |grad| < 1 here), in a direction that differs from one process's by the roundings on its way, bounded
# by 32 ulps relative: the batch sum in another order (log2(GLOBAL_BATCH) < 4), the sum over replicas
# (<= 2), the moments, root and quotient (~10), doubled for the momentum that carries earlier steps'.
# STEPS updates add up. (Measured: 1.8e-7 at most, against 1.5e-6.)
ONE_PROCESS_ATOL = STEPS * max(LRS) * 32 * EPS


class Net(torch.nn.Module):
    """Tied weights, a frozen layer, a parameter of one element (fewer than the replicas)."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6).requires_grad_(False)
        self.hidden = torch.nn.Linear(6, 16)
        self.head = torch.nn.Linear(16, 6)
        self.decode = torch.nn.Linear(6, 6, bias=False)
        self.decode.weight = self.encode.weight  # tied
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.tanh(self.encode(x))))
        return self.decode(self.head(torch.tanh(self.hidden(h)))) * self.scale


def param_groups(model: Net) -> list[dict[str, Any]]:
    """Two groups with different learning rates, interleaved in the buckets' order."""
    first = [model.encode.weight, model.encode.bias, model.head.weight, model.frozen.weight]
    second = [model.hidden.weight, model.hidden.bias, model.head.bias, model.scale]
    return [{"params": first, "lr": LRS[0]}, {"params": second, "lr": LRS[1]}]


def make_optimizer(kind: str, model: Net) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(param_groups(model), lr=LRS[0], momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(param_groups(model), lr=LRS[0], weight_decay=0.1)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randn(GLOBAL_BATCH, 6, generator=generator)


def cloned(state: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    return {number: {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
            for number, entry in state.items()}


def parameters_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def reference(kind: str) -> list[torch.Tensor]:
    """One process, the whole batch each step."""
    torch.manual_seed(0)
    model = Net()
    optimizer = make_optimizer(kind, model)
    for step in range(STEPS):
        x, y = global_batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return parameters_of(model)


def train(case: str, shard: str | None) -> dict[str, Any]:
    """Inside a replica: train `case` with `shard`; the parameters, the (gathered) optimizer state and what was seen."""
    kind = "adamw" if case in ("adamw", "clip", "buckets", "skip") else "sgd"
    micro_steps = 2 if case == "accumulate" else 1
    repl = rp.Replicator(shard=shard, nonfinite="skip" if case == "skip" else "raise",
                         bucket_cap_mb=0.0005 if case == "buckets" else 25.0,  # ~130 elements a bucket: several
                         reducer=REDUCERS.get(case, "auto"),  # auto: shared memory on one node
                         uneven_batches="weighted" if case == "weighted" else "refuse",
                         precision=case if case in ("bf16", "fp16") else "fp32")
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer(kind, model))
        scheduler = repl.wrap_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    repl.accumulate(micro_steps)
    seen: dict[str, Any] = {"grads_after_backward": []}

    def input_fn(ctx: rp.InputContext):
        share = ctx.per_replica_batch_size(GLOBAL_BATCH)
        micro = share // micro_steps
        for step in range(STEPS):
            if case == "weighted":  # replica r takes 2 + 2r... of the batch's samples (N = 2: 5 and 7; 3: 2, 4, 6)
                sizes = [5, 7] if ctx.num_input_pipelines == 2 else [2, 4, 6]
                x, y = global_batch(step)
                start = sum(sizes[: ctx.input_pipeline_id])
                yield x[start : start + sizes[ctx.input_pipeline_id]], y[start : start + sizes[ctx.input_pipeline_id]]
                continue
            x, y = global_batch(step)
            if case == "skip" and step == 1 and ctx.input_pipeline_id == ctx.num_input_pipelines - 1:
                x = x.clone()
                x[-1, 0] = float("nan")  # the last replica's batch only: every replica must skip this update
            mine = slice(ctx.input_pipeline_id * share, (ctx.input_pipeline_id + 1) * share)
            for m in range(micro_steps):
                part = slice(m * micro, (m + 1) * micro)
                yield x[mine][part], y[mine][part]

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> Any:
        x, y = batch
        optimizer.zero_grad()
        if case == "no_sync":  # the first half's gradients stay local; the second backward averages both
            half = x.shape[0] // 2
            with repl.no_sync():
                (0.5 * F.mse_loss(model(x[:half]), y[:half])).backward()
            (0.5 * F.mse_loss(model(x[half:]), y[half:])).backward()
        else:
            F.mse_loss(model(x), y).backward()
        seen["grads_after_backward"].append(sum(p.grad is not None for p in model.parameters()))
        if case == "clip":
            seen.setdefault("norms", []).append(float(repl.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()
        if case == "schedule":  # the shard optimizer takes the user's learning rates at every step
            scheduler.step()
        return None

    for _ in repl.run(step_fn, repl.prepare_input(input_fn), record=False):
        pass
    sharded = repl.optimizers.wrapped[0].sharded
    if sharded is not None:
        seen["state_bytes"] = sharded.state_bytes()
        seen["pieces"] = len(sharded.pieces)
        seen["groups_in_slice"] = sum(bool(group["params"]) for group in sharded.shard.param_groups)
    seen["user_state_entries"] = len(optimizer.state)
    seen["trainable"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad)
    seen["state"] = cloned(optimizer.state_dict()["state"])
    repl.close()
    return {"params": parameters_of(model), **seen}


REDUCERS = {"flat": "flat", "compressed": "bf16+ef", "hierarchical": "hierarchical"}
CASES = ("sgd", "adamw", "clip", "accumulate", "skip", "buckets", "flat", "no_sync", "weighted", "schedule", "bf16",
         "fp16", "compressed")


def all_levels(cases: tuple[str, ...]) -> dict[tuple[str, str | None], dict[str, Any]]:
    return {(case, shard): train(case, shard) for case in cases for shard in (None, "optimizer", "gradients")}


def same_state(a: dict[Any, dict[str, Any]], b: dict[Any, dict[str, Any]]) -> bool:
    if a.keys() != b.keys():
        return False
    for number in a:
        if a[number].keys() != b[number].keys():
            return False
        for key, value in a[number].items():
            other = b[number][key]
            if isinstance(value, torch.Tensor):
                if not (isinstance(other, torch.Tensor) and value.shape == other.shape and torch.equal(value, other)):
                    return False
            elif value != other:
                return False
    return True


@pytest.mark.parametrize("replicas", [2, 3])
def test_sharded_levels_match_unsharded_bit_for_bit(replicas: int) -> None:
    results = run_replicas(all_levels, replicas, CASES, timeout_s=400)
    for case in CASES:
        for replica, result in enumerate(results):
            plain = result[(case, None)]
            for shard in ("optimizer", "gradients"):
                got = result[(case, shard)]
                where = f"{case}, shard={shard!r}, replica {replica} of {replicas}"
                if case == "clip" and shard == "gradients":
                    # The norm is summed from the slices (one all-reduce), in another order than from the whole
                    # gradients: the clip factor may differ in its last bits, relative <= elements * eps.
                    atol = STEPS * max(LRS) * got["trainable"] * EPS
                    assert all(torch.allclose(g, e, atol=atol, rtol=0) for g, e in zip(got["params"], plain["params"]))
                    assert got["norms"] == pytest.approx(plain["norms"], rel=got["trainable"] * EPS), where
                    continue
                assert all(torch.equal(g, e) for g, e in zip(got["params"], plain["params"])), where
                # The gathered state is the whole state, equal to what every unsharded replica holds.
                assert same_state(got["state"], plain["state"]), where
                assert got["user_state_entries"] == 0, where  # the user's optimizer holds none of it
                if case == "clip":
                    assert got["norms"] == plain["norms"], where  # "optimizer": the whole averages, as unsharded
        initial = parameters_of(_initial())
        assert any(not torch.equal(p, q) for p, q in zip(results[0][(case, None)]["params"], initial)), case
    # "gradients" frees every .grad by the end of the backward pass that averages; "optimizer" keeps the averages,
    # in all 7 trainable tensors (encode.weight tied to decode.weight, encode.bias, hidden.*, head.*, scale).
    assert all(n == 0 for n in results[0][("sgd", "gradients")]["grads_after_backward"])
    assert all(n == 7 for n in results[0][("sgd", "optimizer")]["grads_after_backward"])
    # Some replica's slice holds parameters of both groups (a slice crosses the groups' boundary).
    assert any(result[("adamw", "optimizer")]["groups_in_slice"] == 2 for result in results)


def _initial() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("replicas", [2, 3])
def test_optimizer_state_per_replica_is_one_nth(replicas: int) -> None:
    results = run_replicas(all_levels, replicas, ("adamw",), timeout_s=240)
    trainable = results[0][("adamw", None)]["trainable"]
    presence_slots = 7  # one per trainable tensor, after the gradients in the bucket: slices are cut from both
    for result in results:
        assert result[("adamw", None)]["user_state_entries"] == 7  # unsharded: every tensor's state, everywhere
        for shard in ("optimizer", "gradients"):
            got = result[("adamw", shard)]
            # AdamW: exp_avg and exp_avg_sq (8 bytes an element) for the slice, plus a 4-byte step per piece.
            slice_bytes = got["state_bytes"] - 4 * got["pieces"]
            assert slice_bytes % 8 == 0
            assert abs(slice_bytes / 8 - trainable / replicas) <= presence_slots + 1, (shard, slice_bytes)
    totals = {shard: sum(r[("adamw", shard)]["state_bytes"] - 4 * r[("adamw", shard)]["pieces"] for r in results)
              for shard in ("optimizer", "gradients")}
    assert totals == {"optimizer": 8 * trainable, "gradients": 8 * trainable}  # every element's state, once


@pytest.mark.parametrize("replicas", [2, 3])
def test_sharded_levels_match_one_process(replicas: int) -> None:
    results = run_replicas(all_levels, replicas, ("sgd", "adamw"), timeout_s=240)
    for kind in ("sgd", "adamw"):
        expected = reference(kind)
        for shard in ("optimizer", "gradients"):
            for got in (result[(kind, shard)]["params"] for result in results):
                for g, e in zip(got, expected):
                    assert torch.allclose(g, e, atol=ONE_PROCESS_ATOL, rtol=0), (kind, shard, (g - e).abs().max())


def test_gradients_level_keeps_slices_and_releases_buckets() -> None:
    results = run_replicas(memory_of_gradients, 3, timeout_s=240)
    trainable = results[0]["trainable"]
    assert sum(result["slice_elements"] for result in results) == trainable  # each averaged element, once
    for result in results:
        assert result["grads"] == 0  # no full-size .grad after the backward pass that averages
        assert result["bucket_elements_between_steps"] == 0  # the transport buckets are released
        # During backward: the bucket being filled and the one travelling, never all of them.
        assert result["buckets"] >= 3 and 1 <= result["most_buckets_alive"] <= 2, result


def memory_of_gradients() -> dict[str, int]:
    repl = rp.Replicator(shard="gradients", bucket_cap_mb=0.0002)  # ~50 elements a bucket
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", model))
    seen: dict[str, int] = {"most_buckets_alive": 0}
    buckets = repl.optimizers.wrapped[0].synchronizer.buckets

    def count_alive(param: torch.Tensor) -> None:  # after the synchronizer's own hook: registered later
        if repl.global_step > 0:  # the first backward finds every bucket as wrapping built it
            alive = sum(bucket.buffer.numel() > 0 for bucket in buckets)
            seen["most_buckets_alive"] = max(seen["most_buckets_alive"], alive)

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(count_alive)

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        sharded = repl.optimizers.wrapped[0].sharded
        assert sharded is not None
        seen["slice_elements"] = sum(piece.numel() for piece in sharded.slices.values())
        seen["grads"] = sum(p.grad is not None for p in model.parameters())
        optimizer.step()

    batches = [global_batch(step) for step in range(2)]
    share = GLOBAL_BATCH // repl.num_replicas
    mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    for _ in repl.run(step_fn, [(x[mine], y[mine]) for x, y in batches], record=False):
        pass
    seen["buckets"] = len(buckets)
    seen["bucket_elements_between_steps"] = sum(bucket.buffer.numel() for bucket in buckets)
    seen["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    repl.close()
    return seen


@pytest.mark.parametrize(("arguments", "message"), [
    ({"shard": "zero2"}, r"unknown shard='zero2'; choose None .*'optimizer' \(ZeRO-1.*'gradients' \(ZeRO-2"),
    ({"shard": "parameters", "precision": "fp16"}, r"shard='parameters' with precision='fp16' is not available yet"),
    ({"shard": "parameters", "mode": "async", "parameter_servers": 1}, r"mode='sync' only, not mode='async'"),
    ({"shard": "optimizer", "mode": "async", "parameter_servers": 1}, r"mode='sync' only, not mode='async'"),
    ({"shard": "gradients", "mode": "actor_learner", "actors": 1}, r"mode='sync' only, not mode='actor_learner'"),
    ({"shard": "optimizer", "mode": rp.ParameterServers()}, r"mode='sync' only, not mode='async'"),
    ({"shard": "parameters", "uneven_batches": "weighted"},
     r"shard='parameters' with uneven_batches='weighted' is not available yet"),
])
def test_bad_shard_arguments_are_refused_before_the_job_starts(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(rp.ReplicatorUsageError, match=message):
        rp.Replicator(**arguments)


def refusals() -> list[str]:
    """Inside a replica: what a slice-less reducer and sparse gradients raise, before any update."""
    found = []
    try:
        rp.Replicator(shard="optimizer", reducer="powersgd:2")
    except rp.ReplicatorUsageError as error:
        found.append(str(error))
    repl = rp.Replicator(shard="gradients")
    with repl.scope():
        embedding = torch.nn.Embedding(10, 4, sparse=True)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(embedding.parameters(), lr=0.1))
    before = embedding.weight.detach().clone()

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        embedding(batch).sum().backward()
        optimizer.step()

    try:
        for _ in repl.run(step_fn, [torch.tensor([1, 2])], record=False):
            pass
    except rp.ReplicatorUsageError as error:
        found.append(str(error))
    found.append(str(torch.equal(before, embedding.weight.detach())))
    repl = rp.Replicator(shard="optimizer")
    with repl.scope():
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", model))
    try:
        repl.broadcast_state(model, optimizer)
    except rp.ReplicatorUsageError as error:
        found.append(str(error))
    return found


def test_slice_less_reducers_sparse_gradients_and_broadcast_state_are_refused_on_every_replica() -> None:
    for found in run_replicas(refusals, 2, timeout_s=120):
        assert "cannot use reducer 'powersgd:2'" in found[0]
        assert "cannot slice the sparse gradients of" in found[1] and "sparse_as_dense=True" in found[1]
        assert found[2] == "True"  # refused before any update
        assert "cannot copy replica 0's state of an optimizer wrapped with shard=" in found[3]


def checkpointed(directory: str, shard: str | None, resume: bool) -> dict[str, Any]:
    """Inside a replica: AdamW for STEPS steps, saving after 2 (resume=False), or resuming from that save."""
    repl = rp.Replicator(shard=shard)
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer("adamw", model))
    found: dict[str, Any] = {}
    if resume:
        repl.restore(f"{directory}/saved")
        found["restored_state"] = cloned(optimizer.state_dict()["state"])  # torch's state_dict shares the tensors

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    share = GLOBAL_BATCH // repl.num_replicas
    mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    batches = [(x[mine], y[mine]) for x, y in (global_batch(step) for step in range(STEPS))]
    for step, _ in repl.run(step_fn, batches, steps=STEPS, record=False):
        if step == 2 and not resume:
            repl.save(f"{directory}/saved")
            found["saved_state"] = cloned(optimizer.state_dict()["state"])
    found["params"] = parameters_of(model)
    repl.close()
    return found


def test_checkpoints_move_between_replica_counts_and_levels() -> None:
    """Saved at N = 3 with shard="gradients" (the whole state, gathered); resumed at N = 2 with each level and at
    N = 1: the restored state is the saved one, and the levels resume bit for bit alike."""
    with tempfile.TemporaryDirectory() as directory:
        uninterrupted = run_replicas(checkpointed, 3, directory, "gradients", False, timeout_s=240)[0]
        resumed = {shard: run_replicas(checkpointed, 2, directory, shard, True, timeout_s=240)
                   for shard in (None, "optimizer", "gradients")}
        alone = run_replicas(checkpointed, 1, directory, None, True, timeout_s=240)[0]
    for shard, results in resumed.items():
        for result in results:
            assert same_state(result["restored_state"], uninterrupted["saved_state"]), shard
            assert all(torch.equal(g, e) for g, e in zip(result["params"], resumed[None][0]["params"])), shard
    assert same_state(alone["restored_state"], uninterrupted["saved_state"])
    for got in (resumed["gradients"][0]["params"], alone["params"]):
        for g, e in zip(got, uninterrupted["params"]):  # other replica counts: other summation orders
            assert torch.allclose(g, e, atol=ONE_PROCESS_ATOL, rtol=0), (g - e).abs().max()


def shared_memory_scatter_and_gather() -> dict[str, Any]:
    """Inside a replica of 3 on one node: the shm reducer's scatter and all-gather, on staged tensors."""
    from replicator.sync.bucket import assign_buckets
    from replicator.sync.reducers import make_reducer
    from replicator.topology import build_process_groups, discover

    groups = build_process_groups(discover())
    reducer = make_reducer("shm", groups)
    rank = dist.get_rank()
    found: dict[str, Any] = {}
    for numel in (2, 11, 100):  # fewer elements than replicas; uneven slices; a larger one that grows the segment
        params = [torch.nn.Parameter(torch.zeros(numel))]
        (bucket,) = assign_buckets(params, 1 << 30, 1 << 30)  # a plain buffer: staged, as shard="gradients" has
        bucket.buffer.copy_(torch.arange(bucket.buffer.numel(), dtype=torch.float32) * (rank + 1))
        before = bucket.buffer.clone()
        reducer.scatter(bucket.buffer, groups.replica, bucket).wait()  # type: ignore[attr-defined]
        found[f"scatter {numel}"] = (before, bucket.buffer.clone())
        whole = torch.arange(numel, dtype=torch.float32) + 1000
        cuts = [numel * k // 3 for k in range(4)]
        mine = torch.full((numel,), -1.0)
        mine[cuts[rank] : cuts[rank + 1]] = whole[cuts[rank] : cuts[rank + 1]]
        reducer.all_gather(mine, cuts).wait()  # type: ignore[attr-defined]
        found[f"gather {numel}"] = torch.equal(mine, whole)
    reducer.close()  # type: ignore[attr-defined]
    return found


def test_shared_memory_reducer_stops_after_the_scatter_and_gathers() -> None:
    results = run_replicas(shared_memory_scatter_and_gather, 3, timeout_s=120)
    for rank, found in enumerate(results):
        for numel in (2, 11, 100):
            assert found[f"gather {numel}"], (rank, numel)
            before, after = found[f"scatter {numel}"]
            total = numel + 1  # one presence slot
            mine = slice(total * rank // 3, total * (rank + 1) // 3)
            summed = before / (rank + 1) * 6  # every replica's buffer, 1 + 2 + 3 times the same values
            assert torch.equal(after[mine], summed[mine]) and torch.equal(after[numel:], summed[numel:])
            rest = torch.ones(total, dtype=torch.bool)
            rest[mine], rest[numel:] = False, False
            assert torch.equal(after[rest], before[rest])  # nothing else is summed or written back


def disagreeing() -> str:
    try:
        rp.Replicator(shard="optimizer" if os.environ["RANK"] == "0" else None)
    except rp.ReplicaMismatchError as error:
        return str(error)
    return "no error"


def test_replicas_disagreeing_on_shard_are_refused_on_every_replica() -> None:
    for message in run_replicas(disagreeing, 2, timeout_s=120):
        assert "shard='optimizer'" in message and "shard=None" in message, message


def tiny(shard: str | None) -> dict[str, Any]:
    """A model of two elements on three replicas: one replica owns none of it, and still takes part."""
    repl = rp.Replicator(shard=shard)
    with repl.scope():
        weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        optimizer = repl.wrap_optimizer(torch.optim.AdamW([weight], lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        ((weight * batch).sum() ** 2).backward()
        optimizer.step()

    batches = [torch.tensor([[0.5, 1.0 + repl.replica_id]]) * (step + 1) for step in range(3)]
    for _ in repl.run(step_fn, batches, record=False):
        pass
    sharded = repl.optimizers.wrapped[0].sharded
    pieces = len(sharded.pieces) if sharded is not None else -1
    state = cloned(optimizer.state_dict()["state"])
    repl.close()
    return {"weight": weight.detach().clone(), "pieces": pieces, "state": state}


def tiny_at_every_level() -> dict[str | None, dict[str, Any]]:
    return {shard: tiny(shard) for shard in (None, "optimizer", "gradients")}


def test_a_replica_owning_no_element_still_steps_alike() -> None:
    results = run_replicas(tiny_at_every_level, 3, timeout_s=120)
    assert sorted(result["gradients"]["pieces"] for result in results) == [0, 1, 1]
    for result in results:
        for shard in ("optimizer", "gradients"):
            assert torch.equal(result[shard]["weight"], result[None]["weight"]), shard
            assert same_state(result[shard]["state"], result[None]["state"]), shard


def on_two_nodes() -> dict[tuple[str, str | None], dict[str, Any]]:
    return {(case, shard): train(case, shard) for case in ("adamw", "hierarchical")
            for shard in (None, "optimizer", "gradients")}


def test_sharded_levels_across_simulated_nodes() -> None:
    """2 nodes of 2 replicas: "auto" sums through shared memory inside a node and across nodes in chunks, and the
    parameters' all-gather falls back to the process group; "hierarchical" sums in socket rings per level."""
    results = run_replicas(on_two_nodes, 4, local_world_size=2, timeout_s=400)
    for case in ("adamw", "hierarchical"):
        for result in results:
            for shard in ("optimizer", "gradients"):
                got, plain = result[(case, shard)], result[(case, None)]
                assert all(torch.equal(g, e) for g, e in zip(got["params"], plain["params"])), (case, shard)
                assert same_state(got["state"], plain["state"]), (case, shard)
