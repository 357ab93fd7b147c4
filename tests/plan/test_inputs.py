"""Inputs a user knows (measured throughput, transports, a real module's layers), overlap that follows backward,
and `replicator plan --json` and its errors, run as the command a user types."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from replicator import cli
from replicator.plan.planner import MB, Cluster, ReduceAlgorithm, predict
from replicator.plan.profile import FIRST_BUCKET_BYTES, GradientProfile, Layer, from_module
from replicator.plan.step import Accelerator, Workload, step_time
from replicator.sync import synchronizer
from replicator.sync.bucket import assign_buckets
from replicator.sync.reducers import parse_reducer

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent


def tiny_mlp() -> torch.nn.Module:
    """A factory for --model-from: a wide first layer (ready last in backward) and a small head."""
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def broken_factory() -> torch.nn.Module:
    raise RuntimeError("no weights here")


def _plan(*argv: str) -> subprocess.CompletedProcess[str]:
    """`replicator plan ...` in its own process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    return subprocess.run([sys.executable, "-m", "replicator.cli", "plan", *argv], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)


# --- measured inputs ----------------------------------------------------------------------------


def test_a_measured_step_replaces_the_flops_estimate() -> None:
    gpu = Accelerator(10e12, 0.5)
    measured = Workload(25e6, None, 32, step_s=0.09)
    step = step_time(measured, gpu, None, bucket=25 * MB)
    assert step.compute == pytest.approx(0.09) and step.backward == pytest.approx(0.06)
    with pytest.raises(ValueError, match="flops_per_sample or a measured step_s"):
        Workload(25e6, None, 32)
    with pytest.raises(ValueError, match="step_s must be > 0"):
        Workload(25e6, None, 32, step_s=0.0)


def test_a_tier_moves_its_achieved_share_of_the_line_rate() -> None:
    full = Cluster.two_level(4, 40e9, 5e-6, 12.5e9, 10e-6)
    tcp = Cluster.two_level(4, 40e9, 5e-6, 12.5e9, 10e-6, inter_efficiency=0.5)
    assert tcp.levels(16)[1].bandwidth == pytest.approx(full.levels(16)[1].bandwidth / 2)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Cluster.two_level(4, 40e9, 5e-6, 0.0, 10e-6)
    with pytest.raises(ValueError, match="efficiency"):
        Cluster.two_level(4, 40e9, 5e-6, 12.5e9, 10e-6, inter_efficiency=1.5)


# --- overlap that follows backward --------------------------------------------------------------


def test_buckets_are_ready_as_backward_reaches_them_and_the_tail_shows() -> None:
    # Backward order: a head with little gradient and little compute, then a big first layer that computes
    # most. Its gradient is ready only when backward ends, so its all-reduce cannot hide at all.
    profile = GradientProfile((Layer(1_000, 1.0), Layer(9_000_000, 9.0)))
    buckets = profile.buckets(4 * MB, 4, first_cap_bytes=4 * MB)
    assert [b.ready for b in buckets] == [1.0]  # the big layer closes the only bucket, at the end
    even = GradientProfile.uniform(profile.params).buckets(4 * MB, 4, first_cap_bytes=4 * MB)
    assert even[0].ready < 0.5  # spread evenly, the first bucket would leave early
    work = Workload(profile.params, None, 8, step_s=0.3, profile=profile)
    spread = Workload(profile.params, None, 8, step_s=0.3)
    link = 1e9
    step = step_time(work, Accelerator(1.0), lambda n: n / link, bucket=4 * MB)
    assert step.exposed == pytest.approx(step.communication)  # all of it is the tail
    assert step.tail == pytest.approx(profile.params * 4 / link)
    assert step_time(spread, Accelerator(1.0), lambda n: n / link, bucket=4 * MB).exposed < step.exposed / 2


def test_profile_buckets_match_the_runtime_buckets_of_a_real_module() -> None:
    assert FIRST_BUCKET_BYTES == synchronizer._FIRST_BUCKET_BYTES
    model = torch.nn.Sequential(*(torch.nn.Linear(300, 300) for _ in range(12)))
    cap = int(1 * MB)
    runtime = assign_buckets(list(model.parameters()), cap, min(FIRST_BUCKET_BYTES, cap))
    planned = from_module(model).buckets(cap, 4)
    # The runtime closes buckets per parameter tensor, the planner per module: the same boundaries
    # whenever a module's bias does not straddle the cap, as here.
    assert [b.nbytes for b in planned] == [bucket.numel * 4 for bucket in runtime]


def test_a_module_profile_reads_layers_in_reverse_and_counts_flops() -> None:
    with torch.device("meta"):
        model = tiny_mlp()
    profile = from_module(model, torch.zeros(1, 512, device="meta"))
    assert [layer.params for layer in profile.layers] == [1024 * 10 + 10, 512 * 1024 + 1024]
    assert profile.forward_flops == pytest.approx(2 * (512 * 1024 + 1024 * 10))
    assert profile.layers[1].compute > 40 * profile.layers[0].compute


def test_a_7b_model_on_a_slow_network_prefers_compression_and_shows_its_tail() -> None:
    work = Workload(7e9, None, 8, step_s=2.5)
    cluster = Cluster.two_level(8, 150e9, 5e-6, 12.5e9, 10e-6, 0.77, 0.54)
    flat = predict(work, Accelerator(1.0), cluster, 64, ReduceAlgorithm("flat-ring", "ring"), 256 * MB)
    fp16 = predict(work, Accelerator(1.0), cluster, 64, ReduceAlgorithm("flat-ring+fp16", "ring", 2), 256 * MB)
    assert fp16.efficiency > flat.efficiency and 0 < flat.step.tail <= flat.step.exposed


# --- the command --------------------------------------------------------------------------------


def test_plan_json_lists_every_prediction_ready_to_paste() -> None:
    result = _plan("--params", "7B", "--samples-per-s", "3", "--batch-per-gpu", "8", "--gpus-per-node", "8",
                   "--max-gpus", "32", "--inter-transport", "tcp", "--inter-bw", "12.5", "--fp16", "--json")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert {r["gpus"] for r in records} == {1, 2, 4, 8, 16, 32}
    for record in records:
        parse_reducer(record["reducer"])
        assert 0 < record["efficiency"] <= 1 and record["bucket_cap_mb"] > 0 and record["step_s"] > 0
        assert record["tail_s"] <= record["exposed_s"] + 1e-12
    recommended = [r for r in records if r["recommended"]]
    assert sorted(r["gpus"] for r in recommended) == [1, 2, 4, 8, 16, 32]
    # Each configuration a user can paste appears once; the model behind it is named apart.
    pasted = [(r["gpus"], r["reducer"], r["stages"], r["chunks"]) for r in records]
    assert len(pasted) == len(set(pasted)) and {r["reducer"] for r in records} == {
        "flat", "hierarchical", "fp16", "fp16@hierarchical"}
    # "flat" is one backend all-reduce, priced as the ring the validated model prices it as.
    assert {r["algorithm"] for r in records if r["reducer"] == "flat"} == {"flat-ring"}
    # 7B measured at 3 samples/s: 2.67 s of compute per step on one GPU.
    assert next(r for r in records if r["gpus"] == 1)["compute_s"] == pytest.approx(8 / 3)


def test_plan_reads_a_real_module_from_its_factory() -> None:
    result = _plan("--model-from", "test_inputs:tiny_mlp", "--input-shape", "512", "--max-gpus", "8", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["compute_s"] > 0


@pytest.mark.parametrize("argv, flag", [
    (("--inter-bw", "0"), "--inter-bw"),
    (("--intra-bw", "-3"), "--intra-bw"),
    (("--samples-per-s", "0"), "--samples-per-s"),
    (("--gpus-per-node", "3", "--max-gpus", "8"), "--gpus-per-node"),
    (("--model-from", "no_such_package.models:build"), "--model-from"),
    (("--model-from", "test_inputs:broken_factory"), "--model-from"),
    (("--model-from", "test_inputs"), "--model-from"),
    (("--params", "7B"), "--samples-per-s"),
    (("--inter-efficiency", "1.5"), "--inter-efficiency"),
    (("--memory-bw", "0"), "--memory-bw"),
    (("--activation-mb", "-1"), "--activation-mb"),
])
def test_bad_input_is_a_clear_error_naming_the_flag(argv: tuple[str, ...], flag: str,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # In this process, through the command's own parser and main (one real process per case is slow):
    # argparse's own errors exit 2, the planner's return 2; both name the flag on stderr.
    monkeypatch.syspath_prepend(str(HERE))
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    assert code == 2
    error = capsys.readouterr().err
    assert flag in error and "Traceback" not in error, error


def test_bad_input_from_the_command_line_process() -> None:
    result = _plan("--inter-bw", "0")
    assert result.returncode == 2 and "--inter-bw" in result.stderr, result.stderr
