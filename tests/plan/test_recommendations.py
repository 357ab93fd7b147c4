"""Every reducer `replicator plan` recommends is one `Replicator(reducer=...)` accepts: parsed, and trained with."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.cli.plan import add_arguments, main
from replicator.plan import presets, published
from replicator.plan.planner import (
    REDUCERS,
    Cluster,
    ReduceAlgorithm,
    gpu_counts,
    plan,
    runtime_reducer,
    with_compression,
)
from replicator.plan.step import Accelerator, Workload
from replicator.sync.reducers import parse_reducer
from replicator.testing import run_replicas

from _numerics import assert_within, bound

EVERY_ALGORITHM: tuple[ReduceAlgorithm, ...] = (
    *with_compression(REDUCERS),
    *with_compression(REDUCERS, "bf16")[len(REDUCERS):],
    *(case.algorithm for case in published.PUBLISHED_CASES),
)


def _recommended(cluster: Cluster, max_gpus: int) -> set[str]:
    """Every reducer the planner predicts or recommends for each model preset on `cluster`."""
    seen: set[str] = set()
    for model in (presets.MODELS["resnet50"], presets.MODELS["vgg16"]):
        workload = Workload(model.params, model.forward_flops, batch_per_gpu=32, profile=model.profile())
        result = plan(workload, Accelerator(presets.P100_SXM2_FP32.value, presets.COMPUTE_EFFICIENCY), cluster,
                      gpu_counts(cluster, max_gpus), with_compression(REDUCERS), max_stages=4)
        seen |= {p.reducer for p in result.predictions.values()} | {p.reducer for p in result.recommended.values()}
    return seen


def _printed(capsys: pytest.CaptureFixture[str], *argv: str) -> set[str]:
    """The reducer strings `replicator plan` prints as its recommendations (`reducer='...'`)."""
    parser = argparse.ArgumentParser(prog="replicator plan")
    add_arguments(parser)
    assert main(parser.parse_args(list(argv))) == 0
    return set(re.findall(r"reducer='([^']+)'", capsys.readouterr().out))


@pytest.mark.parametrize("algorithm", EVERY_ALGORITHM, ids=lambda a: a.name)
def test_every_planner_algorithm_names_a_runtime_reducer(algorithm: ReduceAlgorithm) -> None:
    spec = parse_reducer(algorithm.reducer)  # raises ValueError for a name the runtime rejects
    assert (spec.compressor is not None) == (algorithm.gradient_bytes == 2), algorithm
    assert spec.topology == ("hierarchical" if algorithm.algorithm == "hierarchical" else "flat"), algorithm


def test_every_printed_recommendation_parses(capsys: pytest.CaptureFixture[str]) -> None:
    printed: set[str] = set()
    for model in ("resnet50", "vgg16", "bert_large"):
        printed |= _printed(capsys, "--model", model, "--max-gpus", "64", "--fp16", "--max-stages", "4")
        # A slow network, where the hierarchy and compression pay.
        printed |= _printed(capsys, "--model", model, "--max-gpus", "64", "--fp16", "--inter-bw", "0.5")
    assert printed, "replicator plan printed no recommendation"
    slow_network = Cluster.two_level(8, 150e9, 5e-6, 1.25e9, 50e-6)
    predicted = _recommended(published.PUBLISHED_CASES[0].cluster(), 256) | _recommended(slow_network, 256)
    for reducer in printed | predicted:
        parse_reducer(reducer)  # raises ValueError for a name the runtime rejects


def test_runtime_reducer_refuses_what_no_reducer_runs() -> None:
    assert runtime_reducer("rhd", 2) == "fp16" and runtime_reducer("hierarchical", 2) == "fp16@hierarchical"
    with pytest.raises(ValueError, match="no runtime reducer"):
        ReduceAlgorithm("int8-ring", "ring", gradient_bytes=1)
    with pytest.raises(ValueError, match="no runtime reducer"):
        ReduceAlgorithm("butterfly", "butterfly")


# -- a recommendation for one node, pasted into Replicator in two processes ---------------------
def _one_step(configurations: list[tuple[str, float]]) -> dict[str, Any]:
    """One SGD step of a small regression through Replicator(reducer=..., bucket_cap_mb=...) per configuration,
    and the full-batch step."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
    out: dict[str, Any] = {}
    for reducer, bucket_cap_mb in configurations:
        repl = rp.Replicator(reducer=reducer, bucket_cap_mb=bucket_cap_mb)
        with repl.scope():
            torch.manual_seed(0)
            model = torch.nn.Linear(6, 3)
            optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        share = len(x) // repl.num_replicas
        mine = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
        optimizer.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
        out[reducer] = [p.detach().clone() for p in model.parameters()]
        getattr(repl.reducer, "close", lambda: None)()
    torch.manual_seed(0)
    alone = torch.nn.Linear(6, 3)
    F.mse_loss(alone(x), y).backward()
    torch.optim.SGD(alone.parameters(), lr=0.1).step()
    out["one process"] = [p.detach().clone() for p in alone.parameters()]
    return out


def _step_magnitudes() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """|the starting parameters| and lr x sum over the 2 replicas of |their share of the averaged gradient|."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    shares = []
    for rows in (slice(0, 4), slice(4, 8)):
        model.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        shares.append([0.1 * p.grad.abs() / 2 for p in model.parameters()])
    return [p.detach().abs() for p in model.parameters()], [a + b for a, b in zip(*shares)]


@pytest.mark.numerics  # shards of 4 rows against 8, and fp16 on the wire
def test_a_one_node_recommendation_trains_in_two_processes() -> None:
    # Two GPUs in one node: every reducer the planner can name there, the recommended one first.
    node = Cluster.two_level(2, presets.NVLINK1_GPU_PAIR.value, presets.INTRA_NODE_LATENCY,
                             presets.INFINIBAND_EDR.value, presets.NETWORK_LATENCY)
    workload = Workload(presets.MODELS["resnet50"].params, presets.MODELS["resnet50"].forward_flops, 32)
    result = plan(workload, Accelerator(presets.P100_SXM2_FP32.value, 0.5), node, [2], with_compression(REDUCERS))
    chosen = [result.recommended[2], *result.predictions.values()]
    configurations = list(dict.fromkeys((p.reducer, p.bucket_cap_mb) for p in chosen))
    reducers = list(dict.fromkeys(reducer for reducer, _ in configurations))
    assert set(reducers) == {"flat", "hierarchical", "fp16", "fp16@hierarchical"}
    configurations = [next(c for c in configurations if c[0] == reducer) for reducer in reducers]
    results = run_replicas(_one_step, 2, configurations, timeout_s=180)
    start, terms = _step_magnitudes()
    for reducer in reducers:
        for index, (got, expected) in enumerate(zip(results[0][reducer], results[0]["one process"])):
            # Lossless reducers give the full-batch step up to fp32 round-off: the parameter, and the update's sums
            # over 8 rows through a fan-in of 6. fp16 rounds each replica's share of the update's gradient, their
            # sum and the result once each (3 roundings of its sum of |terms|), on the replicas' side only.
            tolerance = bound(torch.float32, start[index] + terms[index], 8 + 6 + 2)
            if reducer.startswith("fp16"):
                tolerance = tolerance + bound(torch.float16, terms[index], 3, sides=1)
            assert_within(got, expected, tolerance, f"{reducer}: parameter {index}")
        assert all(torch.equal(a, b) for a, b in zip(results[0][reducer], results[1][reducer])), reducer
