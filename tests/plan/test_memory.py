"""The planner's model-state memory per shard level and bytes sent per step, against hand-computed numbers, and
`replicator plan`'s memory table, budget note and --json fields."""

from __future__ import annotations

import json
import pathlib

import pytest

from replicator import cli
from replicator.plan.memory import SHARD_LEVELS, shard_memory, smallest_fitting

HERE = pathlib.Path(__file__).resolve().parent
PSI = 1_000_000  # Ψ parameters


def _totals(replicas: int, optimizer: str = "adam", element_bytes: int = 4,
            largest_unit: float | None = None) -> dict[str, float]:
    return {level: shard_memory(level, PSI, replicas, optimizer, element_bytes, largest_unit).total
            for level in SHARD_LEVELS}


def test_fp32_adam_follows_the_zero_formulas_by_hand() -> None:
    # N = 4, a largest layer of 50,000 parameters:
    # none 16Ψ; optimizer 4Ψ + 4Ψ + 8Ψ/4 = 10Ψ; gradients 4Ψ + 12Ψ/4 = 7Ψ; parameters 16Ψ/4 + 4 × 50,000 bytes.
    assert _totals(4, largest_unit=50_000) == {"none": 16_000_000, "optimizer": 10_000_000,
                                               "gradients": 7_000_000, "parameters": 4_200_000}
    # One replica: nothing to shard, nothing gathered.
    assert set(_totals(1, largest_unit=50_000).values()) == {16_000_000}
    # Without a per-layer profile the whole model is the gathered unit: 16Ψ/2 + 4Ψ.
    assert _totals(2)["parameters"] == 12_000_000


def test_other_optimizers_and_dtypes_by_hand() -> None:
    # SGD with momentum, fp32, N = 2: none 12Ψ; optimizer 4Ψ + 4Ψ + 4Ψ/2 = 10Ψ; gradients 4Ψ + 8Ψ/2 = 8Ψ.
    momentum = _totals(2, "momentum", largest_unit=0)
    assert (momentum["none"], momentum["optimizer"], momentum["gradients"], momentum["parameters"]) == (
        12_000_000, 10_000_000, 8_000_000, 6_000_000)
    # Plain SGD keeps no state: optimizer sharding saves nothing. bf16 Adam: half of fp32's every figure.
    assert _totals(4, "sgd")["optimizer"] == _totals(4, "sgd")["none"] == 8_000_000
    fp32 = _totals(4, largest_unit=50_000)
    assert _totals(4, "adam", 2, 50_000) == {level: total / 2 for level, total in fp32.items()}


def test_bytes_sent_per_step_are_two_psi_for_an_all_reduce_and_three_for_parameters() -> None:
    # A ring sends (N-1)/N of each tensor: N = 4, fp32: 2 × 4Ψ × 3/4 = 6 MB; parameters 3 × 4Ψ × 3/4 = 9 MB.
    sent = {level: shard_memory(level, PSI, 4).sent_bytes for level in SHARD_LEVELS}
    assert sent == {"none": 6_000_000, "optimizer": 6_000_000, "gradients": 6_000_000, "parameters": 9_000_000}
    assert shard_memory("parameters", PSI, 1).sent_bytes == 0


def test_the_least_sharded_level_that_fits_a_budget() -> None:
    levels = [shard_memory(level, PSI, 4, largest_unit=50_000) for level in SHARD_LEVELS]
    assert smallest_fitting(levels, 16_000_000).level == "none"  # type: ignore[union-attr]
    assert smallest_fitting(levels, 9_999_999).level == "gradients"  # type: ignore[union-attr]
    assert smallest_fitting(levels, 4_200_000).level == "parameters"  # type: ignore[union-attr]
    assert smallest_fitting(levels, 4_199_999) is None


@pytest.mark.parametrize("arguments, message", [
    (("zero3", PSI, 2), "shard level must be one of none, optimizer, gradients, parameters, got 'zero3'"),
    (("none", PSI, 2, "adagrad"), "optimizer must be one of adam, momentum, sgd, got 'adagrad'"),
    (("none", PSI, 0), "replicas must be >= 1"),
])
def test_bad_input_names_what_is_wrong(arguments: tuple[object, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_memory(*arguments)  # type: ignore[arg-type]


def _run_plan(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    monkeypatch.syspath_prepend(str(HERE))
    assert cli.main(["plan", *argv]) == 0
    return capsys.readouterr().out


# 1024 × 1024 + 1024 + 1024 × 1024 + 1024 + 1024 × 512 + 512 parameters, the largest layer 1024 × 1024 + 1024.
PLAN = ("--model-from", "test_memory:three_layers", "--step-ms", "10", "--max-gpus", "8", "--gpus-per-node", "4")
MLP_PARAMS = 2 * (1024 * 1024 + 1024) + 1024 * 512 + 512
LARGEST = 1024 * 1024 + 1024


def three_layers() -> object:
    """A factory for --model-from: two square layers and a narrower one."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512))


def test_plan_prints_memory_per_shard_level_and_names_the_level_a_budget_needs(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # fp32 Adam: 16Ψ = 42.0 MB without sharding; at 8 GPUs, optimizer 8Ψ + 8Ψ/8 = 23.6 MB fits 30 MB.
    table = _run_plan(capsys, monkeypatch, *PLAN, "--memory-per-gpu", "0.03")
    rows = {line.split()[1]: line for line in table.splitlines() if line.startswith("│")}
    # By GPU count: 16Ψ = 42 MB nowhere fits; at 2, optimizer 12Ψ = 31.5 MB does not, gradients 10Ψ does.
    assert "nothing fits" in rows["1"] and "shard='gradients'" in rows["2"] and "shard='optimizer'" in rows["8"]
    assert f"{16 * MLP_PARAMS / 1e9:.3g} GB" in rows["8"] and f"{9 * MLP_PARAMS / 1e9:.3g} GB" in rows["8"]
    printed = " ".join(table.split())
    assert "Model state per replica (adam, float32" in printed
    assert (f"Memory: model state without sharding is {16 * MLP_PARAMS / 1e9:.3g} GB per replica, over "
            "--memory-per-gpu 0.03 GB; at 8 GPUs the least sharded level that fits is "
            f"rp.Replicator(shard='optimizer') ({9 * MLP_PARAMS / 1e9:.3g} GB)") in printed
    # Nothing fits 1 MB at 8 GPUs: shard='parameters' needs 16Ψ/8 + the largest layer.
    tight = " ".join(_run_plan(capsys, monkeypatch, *PLAN, "--memory-per-gpu", "0.001").split())
    assert (f"no shard level fits --memory-per-gpu 0.001 GB at 8 GPUs (shard='parameters' needs "
            f"{(2 * MLP_PARAMS + 4 * LARGEST) / 1e9:.3g} GB per replica)") in tight


def test_plan_json_carries_each_levels_bytes_traffic_and_the_fitting_level(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    records = json.loads(_run_plan(capsys, monkeypatch, *PLAN, "--optimizer", "momentum", "--gradient-dtype",
                                   "bfloat16", "--memory-per-gpu", "0.0061", "--json"))
    at_four = next(r for r in records if r["gpus"] == 4 and r["stages"] == 1)["memory"]
    # bf16 SGD with momentum at 4 replicas: none 6Ψ, optimizer 4Ψ + 2Ψ/4, gradients 2Ψ + 4Ψ/4,
    # parameters 6Ψ/4 + 2 × the largest layer; all-reduce 2 × 2Ψ × 3/4, parameters 3 × 2Ψ × 3/4.
    assert at_four["replicas"] == 4 and at_four["optimizer"] == "momentum" and at_four["dtype"] == "bfloat16"
    assert at_four["bytes_per_replica"] == pytest.approx({
        "none": 6 * MLP_PARAMS, "optimizer": 4.5 * MLP_PARAMS, "gradients": 3 * MLP_PARAMS,
        "parameters": 1.5 * MLP_PARAMS + 2 * LARGEST}, rel=1e-15)
    assert at_four["sent_bytes_per_step"] == pytest.approx({
        "none": 3 * MLP_PARAMS, "optimizer": 3 * MLP_PARAMS, "gradients": 3 * MLP_PARAMS,
        "parameters": 4.5 * MLP_PARAMS}, rel=1e-15)
    assert at_four["largest_unit_bytes"] == 2 * LARGEST and at_four["budget_bytes"] == pytest.approx(6.1e6)
    # 6.1 MB: gradients' 3Ψ = 7.87 MB is over it, parameters' 1.5Ψ + 2 × the largest layer = 6.04 MB fits.
    assert at_four["smallest_fitting"] == "parameters"
    assert next(r for r in records if r["gpus"] == 1)["memory"]["smallest_fitting"] is None  # 6Ψ = 15.7 MB
    # The table's figures, in --json, for every record: a pipeline's too.
    assert all(set(r["memory"]["bytes_per_replica"]) == set(SHARD_LEVELS) for r in records)


@pytest.mark.parametrize("argv, flag", [
    (("--memory-per-gpu", "0"), "--memory-per-gpu"),
    (("--memory-per-gpu", "lots"), "--memory-per-gpu"),
    (("--optimizer", "adagrad"), "--optimizer"),
])
def test_bad_memory_flags_are_a_clear_error_naming_the_flag(argv: tuple[str, ...], flag: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", *argv])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert flag in error and "Traceback" not in error, error


def test_without_layers_the_table_leaves_the_gathered_unit_out_and_says_so(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    printed = _run_plan(capsys, monkeypatch, "--params", "1M", "--step-ms", "10", "--max-gpus", "4", "--json")
    at_four = next(r for r in json.loads(printed) if r["gpus"] == 4)["memory"]
    assert at_four["largest_unit_bytes"] is None and at_four["bytes_per_replica"]["parameters"] == 4_000_000  # 16Ψ/4
    table = " ".join(_run_plan(capsys, monkeypatch, "--params", "1M", "--step-ms", "10", "--max-gpus", "4").split())
    assert "'parameters' leaves out the unit gathered whole: the layers are not known" in table
