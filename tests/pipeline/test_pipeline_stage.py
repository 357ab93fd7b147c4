"""Pipelines in real processes: K stages x M micro-batches train exactly like one process on the whole batch.

To stay quick on a 2-core machine each process launch runs many configurations; the
fixtures launch once per pipeline shape and the tests read their results.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from replicator._tree import tensors as iter_tensors
from replicator.comm import p2p
from replicator.pipeline import PipelineError, build_pipeline
from replicator.pipeline.build import agreed_balance
from replicator.pipeline.timeline import measured_bubble, plot_gantt, write_chrome_trace
from replicator.testing import run_replicas
from replicator.topology import build_process_groups, discover

from _events import SteppedClock
from _numerics import small_model_bound

STEPS = 3
BATCHES = [16, 13, 11]  # shapes change from step to step; 13 and 11 split unevenly
CHUNKS = [1, 4, 8]
SCHEDULE_NAMES = ["gpipe", "1f1b"]
CHECKPOINTS = ["always", "except_last", "never"]
OPTIMIZERS = ["sgd", "adam"]
# Pipelines against one process on the same batches cut into micro-batches: STEPS steps of a small model.
ATOL = small_model_bound(STEPS)


# -- the model: messages between stages are a tensor, a tuple (with an int tensor) and a dict --


class Fork(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tanh(x), x * 0.5, (x[:, 0] > 0).long()  # per sample, so splitting changes nothing


class ToDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        a, b, parity = inputs
        return {"a": self.linear(a), "b": b, "parity": parity}


class Merge(nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return inputs["a"] + inputs["b"] * inputs["parity"].unsqueeze(1)


class Switch(nn.Module):
    """Identity, unless a test sets `mode` to misbehave."""

    mode = "ok"

    def forward(self, x: Any) -> Any:
        if Switch.mode == "string":
            return "not a tensor"
        if Switch.mode == "raise":
            raise RuntimeError("boom in forward")
        if Switch.mode == "raise_in_backward":
            return {**x, "a": _RaiseInBackward.apply(x["a"])} if isinstance(x, dict) else _RaiseInBackward.apply(x)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


def make_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 16), nn.Tanh(), Fork(), ToDict(), Switch(), Merge(), nn.Linear(16, 16), nn.ReLU(),
            nn.Linear(16, 3)]


# Cut after Fork (a tuple with an int tensor travels) and after Switch (a dict travels);
# with 3 stages Switch ends the middle stage, where a bad output must be caught.
BALANCE = {1: [9], 2: [3, 6], 3: [3, 2, 4]}


def make_batches(total: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    sizes = BATCHES if total is None else [total] * STEPS
    return [(torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)) for n in sizes]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def reference_training(
    layers: list[nn.Module],
    optimizer_name: str,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = nn.Sequential(*layers)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _stage_of(groups: Any) -> int:
    return groups.stage_ranks.index(dist.get_rank()) if dist.is_initialized() else 0


def _max_diff(stage_state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((float((v - reference[k]).abs().max()) for k, v in stage_state.items()), default=0.0)


# -- workers (run in every process) --------------------------------------------------------


def equivalence_worker(num_stages: int) -> dict[str, Any]:
    groups = build_process_groups(discover(), stages=num_stages)
    stage_id = _stage_of(groups)
    batches = make_batches()
    references = {name: reference_training(make_layers(), name, batches) for name in OPTIMIZERS}
    results: dict[str, Any] = {}
    configurations = itertools.product(CHUNKS, SCHEDULE_NAMES, CHECKPOINTS, OPTIMIZERS)
    for chunks, schedule, checkpoint, optimizer_name in configurations:
        pipe = build_pipeline(
            make_layers(), stage_id=stage_id, num_stages=num_stages, balance=BALANCE[num_stages],
            stage_ranks=groups.stage_ranks, stage_group=groups.stage, chunks=chunks, schedule=schedule,
            recompute=checkpoint,
        )
        optimizer = make_optimizer(optimizer_name, pipe.parameters())
        losses = []
        for x, y in batches:
            optimizer.zero_grad()
            losses.append(pipe.train_step(x, y, F.cross_entropy).item())
            optimizer.step()
        state, reference_losses = references[optimizer_name]
        key = f"M={chunks} {schedule} checkpoint={checkpoint} {optimizer_name}"
        results[key] = {
            "param_diff": _max_diff(pipe.module.state_dict(), state),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, reference_losses)),
        }
    # Evaluation after training: the last stage returns the unsplit model's output.
    pipe.eval()
    reference_model = nn.Sequential(*make_layers())
    reference_model.load_state_dict(references[OPTIMIZERS[-1]][0])
    x = batches[0][0]
    output = pipe.eval_step(x)
    with torch.no_grad():
        expected = reference_model.eval()(x)
    results["eval"] = None if output is None else float((output - expected).abs().max())
    return results


def p2p_round_trip(groups: Any, stage_id: int) -> bool:
    """Every dtype, nesting and a header longer than the first message survive the trip both ways."""
    value = {
        "a much longer key than usual, to push the header past the first message's bytes" * 4: torch.randn(3, 2),
        "dtypes": [torch.arange(4, dtype=d) for d in (torch.int8, torch.int32, torch.int64, torch.uint8, torch.float16,
                                                       torch.bfloat16, torch.float64)],
        "flags": (torch.tensor([True, False]), torch.zeros(0, 5), torch.tensor(7.0, requires_grad=True)),
        "complex": torch.tensor([1 + 2j], dtype=torch.complex128),
        "gradient slot": None,
    }
    peer = groups.stage_ranks[1 - stage_id]
    out = p2p.Link(peer, groups.stage, torch.device("cpu"))
    into = p2p.Link(peer, groups.stage, torch.device("cpu"))
    if stage_id == 0:
        out.send("key", value, microbatch=3, microbatch_size=2, batch_size=9, allow_none=True, loss=1.25)
        back = into.recv("key")
    else:
        back = into.recv("key")
        out.send("key", back.value, microbatch=back.microbatch, microbatch_size=back.microbatch_size,
                 batch_size=back.batch_size, allow_none=True, loss=back.loss)
    out.settle_all()
    got = back.value
    same = [torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(iter_tensors(value), iter_tensors(got))]
    return (
        (back.microbatch, back.microbatch_size, back.batch_size, back.loss) == (3, 2, 9, 1.25)
        and list(got) == list(value) and all(same) and len(same) == 12
        and got["gradient slot"] is None and isinstance(got["flags"], tuple) and isinstance(got["dtypes"], list)
        and got["flags"][2].requires_grad and not got["flags"][0].requires_grad
    )


def p2p_sizes(groups: Any, stage_id: int) -> dict[str, Any]:
    """Shapes grow, shrink and come back: values always arrive intact, and a known size costs one message.

    Rank 0 sends, rank 1 receives; per transfer, the number of point-to-point messages
    each end posted. A receive posted with the wrong size would corrupt the values or
    kill the receiving process, so the values are compared too.
    """
    peer = groups.stage_ranks[1 - stage_id]
    link = p2p.Link(peer, groups.stage, torch.device("cpu"))
    rows = [64, 64, 200, 200, 3, 3, 64, 0]  # the first exceeds p2p.FIRST_BYTES, like most activations
    messages, intact = [], []
    for n, count in enumerate(rows):
        value = (torch.arange(count * 4, dtype=torch.float32).reshape(count, 4) + n, torch.tensor([n, count]))
        before = link.messages
        if stage_id == 0:
            link.send("same key", value, microbatch=n, microbatch_size=count, batch_size=0)
            link.settle_all()
            intact.append(True)
        else:
            got = link.recv("same key").value
            intact.append(all(torch.equal(a, b) for a, b in zip(value, got)))
            version = got[0]._version
            got[1].add_(1)  # received tensors are separate: changing one leaves the other (and autograd) alone
            intact[-1] &= torch.equal(got[0], value[0]) and got[0]._version == version
        messages.append(link.messages - before)
    # An abort is a message like any other on the same link: the next data message still fits.
    if stage_id == 0:
        link.send_abort("same key", "stage 0 failed: boom", microbatch=9)
        link.send("same key", torch.ones(64, 4), microbatch=10, microbatch_size=64, batch_size=0)
        link.settle_all()
        abort_ok = True
    else:
        abort = link.recv("same key")
        after = link.recv("same key")
        abort_ok = (abort.is_abort and abort.error == "stage 0 failed: boom" and abort.microbatch == 9
                    and torch.equal(after.value, torch.ones(64, 4)))
    return {"messages": messages, "intact": all(intact), "abort": abort_ok}


def p2p_posted_ahead(groups: Any, stage_id: int) -> bool:
    """Receives posted ahead meet their own transfers, even when a transfer outgrows its first message.

    Rank 1 posts the receives of two keys before rank 0 sends anything; every transfer is
    larger than its first message, so its remainder must not meet the receive posted for
    the next transfer.
    """
    peer = groups.stage_ranks[1 - stage_id]
    link = p2p.Link(peer, groups.stage, torch.device("cpu"))
    intact = []
    for rows in (64, 300):  # a first message of FIRST_BYTES, then one of the 64-row size: both grow
        values = {key: torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + n
                  for n, key in enumerate(["x", "y"])}
        if stage_id == 0:
            for n, (key, value) in enumerate(values.items()):
                link.send(key, value, microbatch=n, microbatch_size=rows, batch_size=0)
            link.settle_all()
        else:
            for key in values:
                link.post_recv(key)
            intact += [torch.equal(link.recv(key).value, value) for key, value in values.items()]
    return all(intact)


def messages_per_step(groups: Any, stage_id: int) -> list[int]:
    """Point-to-point messages each training step of a 2-stage, 4-micro-batch GPipe posts on this stage."""
    pipe = build_pipeline(make_layers(), stage_id=stage_id, num_stages=2, balance=BALANCE[2],
                          stage_ranks=groups.stage_ranks, stage_group=groups.stage, chunks=4)
    x, y = make_batches(total=16)[0]
    counts = []
    for _ in range(3):
        before = pipe.message_count
        pipe.train_step(x, y, F.cross_entropy)
        counts.append(pipe.message_count - before)
    return counts


def two_stage_worker(trace_dir: str) -> dict[str, Any]:
    results = equivalence_worker(2)
    groups = build_process_groups(discover(), stages=2)
    stage_id = _stage_of(groups)
    results["p2p"] = p2p_round_trip(groups, stage_id)
    results["p2p_sizes"] = p2p_sizes(groups, stage_id)
    results["p2p_posted_ahead"] = p2p_posted_ahead(groups, stage_id)
    results["messages_per_step"] = messages_per_step(groups, stage_id)
    results["batchnorm"] = batchnorm_checks(groups, stage_id)
    results["timeline"] = timeline_checks(groups, stage_id, trace_dir)
    results["time_balance"] = time_balance_check(groups)
    return results


def three_stage_worker() -> dict[str, Any]:
    results = equivalence_worker(3)
    groups = build_process_groups(discover(), stages=3)
    results["errors"] = error_checks(groups, _stage_of(groups))
    return results


# -- errors ----------------------------------------------------------------------------------


def _expect_failure(run: Callable[[], Any]) -> str:
    try:
        run()
    except PipelineError as error:
        return str(error)
    return "no error"


def error_checks(groups: Any, stage_id: int) -> dict[str, Any]:
    K = len(groups.stage_ranks)
    outcomes: dict[str, Any] = {}
    for schedule in SCHEDULE_NAMES:
        pipe = build_pipeline(make_layers(), stage_id=stage_id, num_stages=K, balance=BALANCE[K],
                              stage_ranks=groups.stage_ranks, stage_group=groups.stage, chunks=4, schedule=schedule)
        x, y = make_batches()[0]
        cases: dict[str, Callable[[], Any]] = {
            "small_batch": functools.partial(pipe.train_step, x[:2], y[:2], F.cross_entropy),
            "non_scalar_loss": functools.partial(pipe.train_step, x, y,
                                                 lambda o, t: F.cross_entropy(o, t, reduction="none")),
            "target_mismatch": functools.partial(pipe.train_step, x, y[:10], F.cross_entropy),
            "no_loss_fn": functools.partial(pipe.train_step, x, y, None),
            "eval_small_batch": functools.partial(pipe.eval_step, x[:3]),
        }
        for name, run in cases.items():
            outcomes[f"{schedule} {name}"] = _expect_failure(run)
        for mode in ["string", "raise", "raise_in_backward"]:
            Switch.mode = mode
            try:
                outcomes[f"{schedule} {mode}"] = _expect_failure(
                    functools.partial(pipe.train_step, x, y, F.cross_entropy)
                )
            finally:
                Switch.mode = "ok"
        # After all those failures the pipeline still works and agrees with one process.
        for p in pipe.parameters():
            p.grad = None
        loss = pipe.train_step(x, y, F.cross_entropy)
        expected = F.cross_entropy(nn.Sequential(*make_layers())(x), y)
        outcomes[f"{schedule} recovered"] = abs(loss.item() - expected.item())
    return outcomes


# -- batch norm ------------------------------------------------------------------------------


def make_bn_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(),
            nn.Linear(16, 3)]


def microbatched_reference(
    chunks: int, batches: list[tuple[torch.Tensor, torch.Tensor]], deferred: bool
) -> dict[str, torch.Tensor]:
    """One process, plain nn.BatchNorm, a loop over micro-batches; deferred statistics computed by hand."""
    model = nn.Sequential(*make_bn_layers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    bns = [m for m in model if isinstance(m, nn.BatchNorm1d)]
    seen: dict[int, list[torch.Tensor]] = {id(bn): [] for bn in bns}
    handles = [bn.register_forward_pre_hook(lambda m, args: seen[id(m)].append(args[0].detach())) for bn in bns]
    for x, y in batches:
        optimizer.zero_grad()
        saved = {id(bn): (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
                 for bn in bns}
        for bn in bns:
            seen[id(bn)].clear()
        for xs, ys in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
            (F.cross_entropy(model(xs), ys) * len(xs) / len(x)).backward()
        optimizer.step()
        if deferred:  # running statistics of the whole mini-batch, updated once
            for bn in bns:
                full = torch.cat(seen[id(bn)])
                mean, var, tracked = saved[id(bn)]
                bn.running_mean.copy_(0.9 * mean + 0.1 * full.mean(0))
                bn.running_var.copy_(0.9 * var + 0.1 * full.var(0, unbiased=True))
                bn.num_batches_tracked.copy_(tracked + 1)
    for handle in handles:
        handle.remove()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_batch_statistics(x: torch.Tensor) -> dict[str, torch.Tensor]:
    model = nn.Sequential(*make_bn_layers())
    model(x)
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k}


def batchnorm_checks(groups: Any, stage_id: int) -> dict[str, float]:
    batches = make_batches()
    chunks = 4
    diffs: dict[str, float] = {}
    for deferred in (False, True):
        reference = microbatched_reference(chunks, batches, deferred)
        for schedule, checkpoint in itertools.product(SCHEDULE_NAMES, CHECKPOINTS):
            pipe = build_pipeline(make_bn_layers(), stage_id=stage_id, num_stages=2, balance=[3, 4],
                                  stage_ranks=groups.stage_ranks, stage_group=groups.stage, chunks=chunks,
                                  schedule=schedule, recompute=checkpoint, deferred_batchnorm=deferred)
            optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
            for step, (x, y) in enumerate(batches):
                optimizer.zero_grad()
                pipe.train_step(x, y, F.cross_entropy)
                optimizer.step()
                if deferred and step == 0:
                    # One step in, the first batch norm (whose input does not depend on how
                    # earlier layers normalised) has exactly the unsplit model's statistics.
                    full = full_batch_statistics(x)
                    diffs[f"deferred {schedule} {checkpoint} first step vs full batch"] = _max_diff(
                        {k: v for k, v in pipe.module.state_dict().items() if k.startswith("1.running")}, full)
            state = pipe.module.state_dict()
            key = f"{'deferred' if deferred else 'per-micro-batch'} {schedule} {checkpoint}"
            diffs[key] = _max_diff(state, reference)
            tracked = [int(v) for k, v in state.items() if k.endswith("num_batches_tracked")]
            diffs[key + " tracked-miscount"] = float(sum(abs(t - STEPS * (1 if deferred else chunks)) for t in tracked))
    return diffs


# -- timeline and balance ------------------------------------------------------------------


def timeline_checks(groups: Any, stage_id: int, trace_dir: str) -> dict[str, Any]:
    pipe = build_pipeline(make_layers(), stage_id=stage_id, num_stages=2, balance=BALANCE[2],
                          stage_ranks=groups.stage_ranks, stage_group=groups.stage, chunks=4, schedule="1f1b")
    x, y = make_batches()[0]
    pipe.train_step(x, y, F.cross_entropy)
    events = pipe.gather_timeline()
    mine = [(e.op, e.microbatch) for e in events if e.stage == stage_id]
    if stage_id == 0:
        write_chrome_trace(events, os.path.join(trace_dir, "trace.json"))
        plot_gantt(events, os.path.join(trace_dir, "gantt.png"), title="1F1B, 2 stages x 4")
    return {
        "count": len(events),
        "stages": sorted({e.stage for e in events}),
        "ordered": all(e.end >= e.start for e in events),
        "bubble": measured_bubble(events),
        # 1F1B's stage 0 exchanges "RG0 SA1" after F1: on Gloo it sends before it waits.
        "sends_first": stage_id == 1 or mine.index(("send_activation", 1)) < mine.index(("recv_gradient", 0)),
    }


class Costly(nn.Module):
    """A layer whose cost is what it advances the profiler's injected clock by: no sleep, no load in the verdict."""

    def __init__(self, clock: SteppedClock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.seconds)
        return x + 0


def time_balance_check(groups: Any) -> list[int]:
    # The module itself: replicator.pipeline's `partition` attribute is the function of that name.
    partition_module = importlib.import_module("replicator.pipeline.partition")
    clock, real = SteppedClock(), partition_module.time
    partition_module.time = clock  # type: ignore[assignment]  # the profiler reads only time.perf_counter
    try:
        layers = [Costly(clock, s) for s in (0.02, 0.0, 0.0, 0.02, 0.0)]
        return agreed_balance(layers, 2, "time", sample=torch.randn(2, 2), group=groups.stage)
    finally:
        partition_module.time = real


# -- replicas x stages -------------------------------------------------------------------------


def replicas_worker() -> dict[str, float]:
    stages = 2
    groups = build_process_groups(discover(), stages=stages)
    stage_id = _stage_of(groups)
    replicas = len(groups.replica_ranks)
    replica_id = groups.replica_ranks.index(dist.get_rank())
    batches = make_batches(total=16)
    diffs: dict[str, float] = {}
    for schedule, optimizer_name in itertools.product(SCHEDULE_NAMES, OPTIMIZERS):
        reference, reference_losses = reference_training(make_layers(), optimizer_name, batches)
        pipe = build_pipeline(make_layers(), stage_id=stage_id, num_stages=stages, balance=BALANCE[2],
                              stage_ranks=groups.stage_ranks, stage_group=groups.stage, chunks=4, schedule=schedule,
                              replica=replica_id)
        optimizer = make_optimizer(optimizer_name, pipe.parameters())
        loss_diff = 0.0
        for (x, y), expected in zip(batches, reference_losses):
            shard = slice(replica_id * len(x) // replicas, (replica_id + 1) * len(x) // replicas)
            optimizer.zero_grad()
            loss = pipe.train_step(x[shard], y[shard], F.cross_entropy)
            for p in pipe.parameters():
                dist.all_reduce(p.grad, group=groups.replica)
                p.grad /= replicas
            dist.all_reduce(loss, group=groups.replica)
            loss_diff = max(loss_diff, abs(loss.item() / replicas - expected))
            optimizer.step()
        diffs[f"{schedule} {optimizer_name}"] = _max_diff(pipe.module.state_dict(), reference)
        diffs[f"{schedule} {optimizer_name} loss"] = loss_diff
    return diffs


# -- fixtures: one launch per pipeline shape ---------------------------------------------------


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("pipeline_trace"))


@pytest.fixture(scope="module")
def two_stages(trace_dir: str) -> list[dict[str, Any]]:
    return run_replicas(two_stage_worker, 2, trace_dir, timeout_s=240)


@pytest.fixture(scope="module")
def three_stages() -> list[dict[str, Any]]:
    return run_replicas(three_stage_worker, 3, timeout_s=240)


def _check_equivalence(results: list[dict[str, Any]]) -> None:
    configs = [k for k in results[0] if k.startswith("M=")]
    assert len(configs) == len(CHUNKS) * len(SCHEDULE_NAMES) * len(CHECKPOINTS) * len(OPTIMIZERS)
    bad = {
        (rank, key): value
        for rank, result in enumerate(results)
        for key, value in result.items()
        if key.startswith("M=") and (value["param_diff"] > ATOL or value["loss_diff"] > ATOL)
    }
    assert not bad, f"pipeline differs from single-process training: {bad}"


def test_two_stages_train_like_one_process(two_stages: list[dict[str, Any]]) -> None:
    _check_equivalence(two_stages)


def test_three_stages_train_like_one_process(three_stages: list[dict[str, Any]]) -> None:
    _check_equivalence(three_stages)


def test_eval_step_returns_the_output_on_the_last_stage(three_stages: list[dict[str, Any]]) -> None:
    assert [r["eval"] is None for r in three_stages] == [True, True, False]
    assert three_stages[-1]["eval"] < ATOL


def test_failures_are_raised_on_every_stage(three_stages: list[dict[str, Any]]) -> None:
    expected = {
        "small_batch": "cannot be split into 4 micro-batches",
        "non_scalar_loss": "loss_fn must return a scalar",
        "target_mismatch": "the targets hold 10 samples but the inputs 16",
        "no_loss_fn": "needs a loss_fn",
        "eval_small_batch": "cannot be split into 4 micro-batches",
        "string": "is a str",
        "raise": "boom in forward",
        "raise_in_backward": "boom in backward",
    }
    for rank, result in enumerate(three_stages):
        errors = result["errors"]
        for schedule in SCHEDULE_NAMES:
            for case, text in expected.items():
                message = errors[f"{schedule} {case}"]
                assert text in message, f"rank {rank}, {schedule} {case}: {message}"
                assert "stage" in message and "pipeline step failed" in message
            assert errors[f"{schedule} recovered"] < ATOL


def test_batchnorm_statistics_are_never_counted_twice(two_stages: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(two_stages):
        bad = {k: v for k, v in result["batchnorm"].items() if v > ATOL}
        assert not bad, f"rank {rank}: {bad}"
        assert len(result["batchnorm"]) == (
            2 * 2 * len(SCHEDULE_NAMES) * len(CHECKPOINTS) + len(SCHEDULE_NAMES) * len(CHECKPOINTS)
        )


def test_timeline_exports(two_stages: list[dict[str, Any]], trace_dir: str) -> None:
    for result in two_stages:
        timeline = result["timeline"]
        assert timeline["stages"] == [0, 1] and timeline["ordered"]
        # stage 0: 4 F, 4 B, 4 sends, 4 receives; stage 1 the same.
        assert timeline["count"] == 32
        assert 0.0 <= timeline["bubble"] < 1.0
    with open(os.path.join(trace_dir, "trace.json")) as file:
        trace = json.load(file)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 32 and {e["tid"] for e in complete} == {0, 1}
    assert {"forward", "backward", "send_activation", "recv_gradient"} <= {e["cat"] for e in complete}
    with open(os.path.join(trace_dir, "gantt.png"), "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def test_messages_carry_any_structure_of_tensors(two_stages: list[dict[str, Any]]) -> None:
    assert [r["p2p"] for r in two_stages] == [True, True]


def test_one_message_per_transfer_once_its_size_is_known(two_stages: list[dict[str, Any]]) -> None:
    for result in two_stages:
        sizes = result["p2p_sizes"]
        assert sizes["intact"] and sizes["abort"], sizes
        # 64 rows: new key, beyond the first message's bytes -> 2; the same again -> 1; 200 rows:
        # grown -> 2, then 1; 3 rows: shrunk, sent padded -> 1, 1; 64 rows: grown again -> 2; empty -> 1.
        assert sizes["messages"] == [2, 1, 2, 1, 1, 1, 2, 1], sizes


def test_receives_posted_ahead_meet_their_own_transfers(two_stages: list[dict[str, Any]]) -> None:
    assert [r["p2p_posted_ahead"] for r in two_stages] == [True, True]


def test_on_gloo_a_stage_sends_before_it_waits_to_receive(two_stages: list[dict[str, Any]]) -> None:
    """Within an exchange the schedule lists a receive first (safe for NCCL); Gloo's sends never block."""
    assert [r["timeline"]["sends_first"] for r in two_stages] == [True, True]


def test_a_training_step_posts_one_message_per_transfer(two_stages: list[dict[str, Any]]) -> None:
    for result in two_stages:
        first, *steady = result["messages_per_step"]
        # 4 activations, 4 gradients and the end-of-step status; the first step sends each
        # message that outgrows its first FIRST_BYTES in two parts.
        assert steady == [9, 9], result["messages_per_step"]
        assert first > 9


def test_time_balance_is_agreed_by_every_stage(two_stages: list[dict[str, Any]]) -> None:
    balances = [r["time_balance"] for r in two_stages]
    assert balances[0] == balances[1]
    assert balances[0] in ([1, 4], [2, 3], [3, 2])  # the two slow layers in different stages


def test_two_replicas_of_two_stages_train_like_one_process() -> None:
    results = run_replicas(replicas_worker, 4, timeout_s=240)
    bad = {(rank, k): v for rank, r in enumerate(results) for k, v in r.items() if v > ATOL}
    assert not bad, f"2 replicas x 2 stages differ from single-process training: {bad}"


def test_single_stage_pipeline_without_distributed() -> None:
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batches = make_batches()
        reference, reference_losses = reference_training(make_layers(), "sgd", batches)
        quiet_backwards = []

        @contextlib.contextmanager
        def no_sync() -> Iterator[None]:
            quiet_backwards.append(1)
            yield

        pipe = build_pipeline(make_layers(), stage_id=0, num_stages=1, chunks=4, schedule="1f1b", recompute="always",
                              no_sync=no_sync)
        optimizer = make_optimizer("sgd", pipe.parameters())
        for (x, y), expected in zip(batches, reference_losses):
            optimizer.zero_grad()
            assert pipe.train_step(x, y, F.cross_entropy).item() == pytest.approx(expected, abs=ATOL)
            optimizer.step()
        assert _max_diff(pipe.module.state_dict(), reference) < ATOL
        assert len(quiet_backwards) == STEPS * 3  # every backward but the last of each step
        with pytest.raises(PipelineError, match="loss_fn must return a scalar"):
            pipe.train_step(x, y, lambda o, t: o)
        with pytest.raises(ValueError, match="needs torch.distributed"):
            build_pipeline(make_layers(), stage_id=0, num_stages=2, balance=[4, 5])
    finally:
        torch.set_num_threads(torch_threads)


def test_receives_prove_which_sends_were_delivered() -> None:
    from replicator.pipeline.links import delivered_counts
    from replicator.pipeline.schedule import make_schedule

    gpipe = make_schedule("gpipe", 2, 4)
    stage0 = delivered_counts(gpipe, 0)
    # Stage 1 sends its first gradient after receiving all 4 activations: stage 0's copies of
    # them can go before its backwards start.
    assert [c for a, c in zip(gpipe.stages[0], stage0) if a.op.is_recv] == [4, 4, 4, 4]
    # Stage 1 hears back from stage 0 only through activations, sent before any gradient.
    assert set(delivered_counts(gpipe, 1)) == {0}
    one_f_one_b = make_schedule("1f1b", 3, 4)
    middle = [(str(a), c) for a, c in zip(one_f_one_b.stages[1], delivered_counts(one_f_one_b, 1)) if a.op.is_recv]
    assert all(c <= 4 for _, c in middle) and any(c > 0 for a, c in middle if a.startswith("RG"))


def test_encoding_a_value_keeps_none_of_its_tensors_alive() -> None:
    import gc
    import weakref

    x = torch.randn(3)
    alive = weakref.ref(x)
    gc.disable()  # a reference cycle would keep x until the collector ran: make that visible
    try:
        p2p.encode_structure({"x": [x, (x,)]})
        del x
        assert alive() is None
    finally:
        gc.enable()
