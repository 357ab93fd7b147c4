"""examples/d4pg.py: its categorical projection on hand-computed values, a short job, and a missing environment."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "d4pg.py"


@pytest.fixture(scope="module")
def d4pg() -> ModuleType:
    spec = importlib.util.spec_from_file_location("d4pg", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def project(d4pg: ModuleType, probs: list[float], reward: float, discount: float) -> list[float]:
    atoms = torch.arange(5, dtype=torch.float64)  # 0, 1, 2, 3, 4: spacing 1
    out = d4pg.categorical_projection(torch.tensor([probs], dtype=torch.float64), atoms,
                                      torch.tensor([reward], dtype=torch.float64),
                                      torch.tensor([discount], dtype=torch.float64))
    return out[0].tolist()


def test_categorical_projection_on_hand_computed_values(d4pg: ModuleType) -> None:
    # Atom 2 moved to 2.5: half to atom 2, half to atom 3.
    assert project(d4pg, [0, 0, 1, 0, 0], reward=0.5, discount=1.0) == pytest.approx([0, 0, 0.5, 0.5, 0])
    # Discount 0 (a terminal step): every atom moves to the reward, 1.25: 3/4 to atom 1, 1/4 to atom 2.
    assert project(d4pg, [0.2] * 5, reward=1.25, discount=0.0) == pytest.approx([0, 0.75, 0.25, 0, 0])
    # Atoms landing exactly on atoms (0 -> 1, 4 -> 3) keep all their mass there.
    assert project(d4pg, [0.5, 0, 0, 0, 0.5], reward=1.0, discount=0.5) == pytest.approx([0, 0.5, 0, 0.5, 0])
    # Shrunk by 0.5 and shifted by 0.5: 0 -> 0.5, 1 -> 1, 2 -> 1.5, 3 -> 2, 4 -> 2.5.
    assert project(d4pg, [0.2] * 5, reward=0.5, discount=0.5) == pytest.approx([0.1, 0.4, 0.4, 0.1, 0])
    # Beyond the support: clipped to its ends, the top end included (no mass lost past v_max).
    assert project(d4pg, [0.2] * 5, reward=10.0, discount=1.0) == pytest.approx([0, 0, 0, 0, 1])
    assert project(d4pg, [0.2] * 5, reward=-3.0, discount=0.5) == pytest.approx([1, 0, 0, 0, 0])


def test_categorical_projection_keeps_the_mean_inside_the_support(d4pg: ModuleType) -> None:
    generator = torch.Generator().manual_seed(0)
    atoms = torch.linspace(-100, 0, 51, dtype=torch.float64)
    probs = torch.softmax(torch.randn(64, 51, generator=generator, dtype=torch.float64), dim=-1)
    discount = torch.rand(64, generator=generator, dtype=torch.float64) * 0.9
    reward = -torch.rand(64, generator=generator, dtype=torch.float64) * 10
    projected = d4pg.categorical_projection(probs, atoms, reward, discount)
    assert projected.min() >= 0 and projected.sum(-1) == pytest.approx(torch.ones(64, dtype=torch.float64))
    expected = reward + discount * (probs * atoms).sum(-1)
    # float64: the projection's 51-term sums of |p x atom| <= 100 and the expectation's, both rounded:
    # 2 x gamma_(51+4)(float64) x 100 = 1.2e-12 at most, inside 1e-9.
    assert (projected * atoms).sum(-1) == pytest.approx(expected, abs=1e-9)


def test_categorical_projection_computes_on_its_inputs_device(d4pg: ModuleType) -> None:
    # On a GPU learner every input is a CUDA tensor; the meta device shows the same thing on any machine: the
    # projection must allocate where its inputs live (a CPU buffer there raised "Expected all tensors to be on the
    # same device" on the GPU).
    atoms = torch.linspace(-100, 0, 51, device="meta")
    projected = d4pg.categorical_projection(torch.empty(8, 51, device="meta"), atoms, torch.empty(8, device="meta"),
                                            torch.empty(8, device="meta"))
    assert projected.device.type == "meta" and projected.shape == (8, 51)


def run_example(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The example run plainly: it launches its own job of learners, actors and the evaluator."""
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "REPLICATOR_PROGRESS": "0",
                                         "REPLICATOR_DEVICE": "cpu", "REPLICATOR_THREADS": "1",
                                         "REPLICATOR_TIMEOUT": "30", "PYTHONPATH": str(ROOT),
                                         "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]})


# Small enough for seconds: 200 warm-up transitions, then a learner step (batch 64) per 2 env steps.
SHORT_RUN = ["--actors", "1", "--steps", "60", "--min-replay", "200", "--batch-size", "64", "--samples-per-insert",
             "32", "--update-period", "20", "--eval-every", "200", "--eval-episodes", "2", "--hidden", "32"]


@pytest.mark.timeout(150)
def test_two_learners_one_actor_and_the_evaluator_learn_with_prioritized_replay_and_write_the_curve(
        tmp_path: Path) -> None:
    result = run_example(*SHORT_RUN, "--learners", "2", "--prioritized", "--seed", "1", "--out", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "starting 4 processes: 2 learner(s), 1 actor(s) and the evaluator" in output
    assert "env steps | learner steps" in output and "learning curve written" in output
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert curve["points"] and all(math.isfinite(p["mean_return"]) for p in curve["points"])
    assert curve["points"][0]["env_steps"] >= 200 and curve["settings"]["learners"] == 2
    # Learner 0 added the job's counters: every learner step ran, on both learners' shards.
    figures = curve["actor_learner"]
    assert figures["learners"] == 2 and figures["actors"] == 1 and figures["learner_steps"] == 60
    assert figures["samples"] == 60 * 64 and figures["samples_per_insert"] > 0
    assert figures["policy_lag"]["count"] == figures["inserts"] > 200
    assert (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.timeout(150)
def test_an_environment_that_does_not_exist_fails_on_every_process_naming_it() -> None:
    result = run_example("--actors", "1", "--env", "NoSuchTask-v0", timeout=140)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    for who in ("learner (rank 0)", "actor (rank 1)", "evaluator (rank 2)"):
        assert f"EnvironmentUnavailable: {who}: --env NoSuchTask-v0: Environment `NoSuchTask` doesn't exist" in output
    assert "pprint_registry" in output


def test_a_control_suite_task_without_dm_control_says_what_to_install(d4pg: ModuleType,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dm_control", None)  # as if not installed, wherever the test runs
    with pytest.raises(d4pg.EnvironmentUnavailable, match="actor \\(rank 1\\): --env dmc:cartpole-swingup needs "
                                                          "DeepMind's Control Suite") as error:
        d4pg.probe_env("dmc:cartpole-swingup", "actor (rank 1)")
    assert "pip install -e '.[dmc]'" in str(error.value)
