"""One model for both paths: a published row typed as `replicator plan` flags prints the figure `--reproduce` prints,
and a plan whose compute comes from FLOPs says so."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from replicator import cli
from replicator.plan import presets, published

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = published.PUBLISHED_CASES
VGG16_512 = next(case for case in CASES if case.key == "horovod-vgg16-512")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    """`replicator plan ARGV` through the command's own entry point, in this process; (stdout, stderr)."""
    assert cli.main(["plan", *argv]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.fixture(scope="module")
def reproduced() -> dict[str, str]:
    """Each row's predicted efficiency as `replicator plan --reproduce` prints it, by case key."""
    result = subprocess.run([sys.executable, "-m", "replicator.cli", "plan", "--reproduce"], capture_output=True,
                            text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) == 9:
            rows[cells[0].rstrip(" †")] = cells[6]
    assert set(rows) == {case.key for case in CASES}
    return rows


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.key)
def test_a_published_row_typed_as_flags_prints_the_reproduced_figure(case: published.PublishedCase,
                                                                     reproduced: dict[str, str],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # The same computation, so the same floats: the step and the efficiency against the row's baseline.
    out, _ = _run(capsys, *case.arguments(), "--json")
    at_scale = next(r for r in json.loads(out) if r["gpus"] == case.gpus and r["recommended"])
    assert at_scale["step_s"] == case.prediction().step_time
    assert at_scale["baseline_efficiency"] == case.predict()
    # And the table a user reads says what --reproduce says.
    out, _ = _run(capsys, *case.arguments())
    printed = re.search(rf"Recommendation at {case.gpus} GPUs: .* ([\d.]+%) scaling efficiency vs "
                        rf"{case.baseline_gpus} GPUs?\.", " ".join(out.split()))
    assert printed is not None, out
    assert printed.group(1) == reproduced[case.key] == f"{case.predict():.1%}"


def test_the_vgg16_row_from_a_shell_prints_the_reproduced_figure() -> None:
    # The case, from the command line a user types, in its own process.
    result = subprocess.run([sys.executable, "-m", "replicator.cli", "plan", *VGG16_512.arguments()],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert f"{VGG16_512.predict():.1%} scaling efficiency vs 1 GPU" in " ".join(result.stdout.split())
    assert "warning" not in result.stderr


def test_the_default_model_is_the_validated_one(capsys: pytest.CaptureFixture[str]) -> None:
    # Without --all-reduce, "flat" is priced as the ring the published NCCL rows ran, and the interference is the
    # fitted one: no recursive halving-doubling credited to a backend that does not run it.
    flags = [flag for flag in VGG16_512.arguments()]
    del flags[flags.index("--all-reduce"):flags.index("--all-reduce") + 2]
    out, _ = _run(capsys, *flags, "--json")
    records = [r for r in json.loads(out) if r["gpus"] == 512]
    assert {r["algorithm"] for r in records} == {"flat-ring", "hierarchical"}
    flat = next(r for r in records if r["reducer"] == "flat")
    assert flat["efficiency"] == VGG16_512.predict()
    assert published.MODEL.interference == presets.INTERFERENCE


def test_compute_from_flops_comes_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model", "vgg16", "--gpus-per-node", "4", "--max-gpus", "16"]
    _, err = _run(capsys, *flags)
    assert "warning: compute is estimated from FLOPs" in err and "--samples-per-s" in err
    _, err = _run(capsys, *flags, "--json")
    assert "warning: compute is estimated from FLOPs" in err
    _, err = _run(capsys, *flags, "--samples-per-s", "132")
    assert "warning" not in err


@pytest.mark.parametrize("argv, message", [
    (("--baseline-gpus", "32", "--max-gpus", "16"), "--baseline-gpus"),
    (("--baseline-gpus", "6", "--max-gpus", "16"), "--baseline-gpus 6: 6 GPUs do not fill whole units"),
])
def test_a_baseline_the_plan_cannot_hold_is_a_clear_error(argv: tuple[str, ...], message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--model", "resnet50", "--samples-per-s", "238", *argv]) == 2
    assert message in capsys.readouterr().err
