"""examples/d4pg.py: its N-step returns and categorical projection on hand-computed values, and a short run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
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


def observation(t: int) -> np.ndarray:
    return np.array([t], dtype=np.float32)


def run_episode(d4pg: ModuleType, rewards: list[float], *, terminated: bool, n_step: int = 3,
                discount: float = 0.5) -> list:
    """The transitions of one episode of len(rewards) steps from o0, ended by termination or truncation."""
    assembler = d4pg.NStepAssembler(n_step, discount)
    out = []
    for t, reward in enumerate(rewards):
        last = t == len(rewards) - 1
        out += assembler.add(observation(t), np.array([t / 10], np.float32), reward, observation(t + 1),
                             terminated=terminated and last, truncated=not terminated and last)
    return out


def summary(transitions: list) -> list[tuple[float, float, float, float]]:
    return [(float(x.observation[0]), x.reward, x.discount, float(x.next_observation[0])) for x in transitions]


def test_n_step_returns_after_a_time_limit_keep_bootstrapping(d4pg: ModuleType) -> None:
    # n = 3, discount 0.5, rewards 1, 2, 4, 8, 16, then the time limit: windows of 3 while they
    # fill, then the last steps with the horizon they have; all bootstrap from o5.
    transitions = run_episode(d4pg, [1, 2, 4, 8, 16], terminated=False)
    assert summary(transitions) == [
        (0, 1 + 0.5 * 2 + 0.25 * 4, 0.125, 3),
        (1, 2 + 0.5 * 4 + 0.25 * 8, 0.125, 4),
        (2, 4 + 0.5 * 8 + 0.25 * 16, 0.125, 5),
        (3, 8 + 0.5 * 16, 0.25, 5),
        (4, 16, 0.5, 5),
    ]
    assert [float(x.action[0]) for x in transitions] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_n_step_returns_after_termination_do_not_bootstrap(d4pg: ModuleType) -> None:
    transitions = run_episode(d4pg, [1, 2, 4, 8, 16], terminated=True)
    assert [d for _, _, d, _ in summary(transitions)] == [0.125, 0.125, 0.0, 0.0, 0.0]
    assert [r for _, r, _, _ in summary(transitions)] == [3.0, 6.0, 12.0, 16.0, 16.0]
    # An episode shorter than n: nothing until it ends, then every step with discount 0.
    assert summary(run_episode(d4pg, [1, 2], terminated=True)) == [(0, 2.0, 0.0, 2), (1, 2.0, 0.0, 2)]


def test_n_step_windows_do_not_cross_episodes(d4pg: ModuleType) -> None:
    assembler = d4pg.NStepAssembler(3, 0.5)
    action = np.zeros(1, np.float32)
    assert len(assembler.add(observation(0), action, 1.0, observation(1), False, True)) == 1
    # The next episode starts from an empty window: its first transition needs 3 steps of its own.
    assert assembler.add(observation(10), action, 4.0, observation(11), False, False) == []
    assert assembler.add(observation(11), action, 4.0, observation(12), False, False) == []
    [first] = assembler.add(observation(12), action, 4.0, observation(13), False, False)
    assert (first.observation[0], first.reward, first.discount) == (10, 4 + 2 + 1, 0.125)


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
    assert (projected * atoms).sum(-1) == pytest.approx(expected, abs=1e-9)


def test_prioritized_replay_samples_in_proportion_to_priority(d4pg: ModuleType) -> None:
    replay = d4pg.LocalReplay(8, 1, 1, 4_000, prioritized=True, priority_exponent=0.5, importance_exponent=1.0,
                              seed=0)
    for t in range(4):
        replay.insert(d4pg.Transition(observation(t), np.zeros(1, np.float32), 0.0, 1.0, observation(t + 1)))
    replay.update_priorities(torch.arange(4), torch.tensor([1.0, 4.0, 9.0, 16.0]))
    batch = replay.sample()
    # priority ** 0.5 = 1, 2, 3, 4: drawn 10%, 20%, 30%, 40% of the time.
    frequency = torch.bincount(batch.key, minlength=4).double() / len(batch.key)
    assert frequency.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.03)
    assert batch.observation[:, 0].tolist() == batch.key.double().tolist()
    # Importance weights (size * P) ** -1 / max: 1, 1/2, 1/3, 1/4 of the rarest item's.
    weights = {int(k): float(w) for k, w in zip(batch.key, batch.weight)}
    assert [weights[k] for k in range(4)] == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4], rel=1e-6)


def run_example(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "REPLICATOR_PROGRESS": "0",
                                         "REPLICATOR_THREADS": "1", "PYTHONPATH": str(ROOT)})


# Small enough for seconds: 200 warm-up transitions, then a learner step (batch 64) per 2 env steps.
SHORT_RUN = ["--single-process", "--steps", "100", "--min-replay", "200", "--batch-size", "64",
             "--samples-per-insert", "32", "--eval-every", "200", "--eval-episodes", "2", "--hidden", "32"]


@pytest.mark.timeout(60)
def test_a_short_single_process_run_learns_and_writes_its_curve(tmp_path: Path) -> None:
    result = run_example(*SHORT_RUN, "--seed", "1", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "env steps | learner steps" in result.stdout and "learning curve written" in result.stdout
    curve = json.loads((tmp_path / "curve.json").read_text())
    points = curve["points"]
    # Episodes of 200 steps end by the time limit, so every env step is in the replay by 200 and 400.
    assert [(p["env_steps"], p["learner_steps"]) for p in points] == [(200, 0), (400, 100)]
    assert points[-1]["samples_per_insert"] == pytest.approx(32)
    assert all(math.isfinite(p["mean_return"]) for p in points) and math.isfinite(points[-1]["critic_loss"])
    assert points[-1]["critic_loss"] < math.log(51), "the critic should beat a uniform guess over its 51 atoms"
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_a_short_prioritized_run(d4pg: ModuleType, tmp_path: Path) -> None:
    torch_threads = torch.get_num_threads()
    try:
        curve = d4pg.main([*SHORT_RUN, "--prioritized", "--out", ""])
    finally:
        torch.set_num_threads(torch_threads)
    assert [(p.env_steps, p.learner_steps) for p in curve.points] == [(200, 0), (400, 100)]
    assert math.isfinite(curve.points[-1].critic_loss) and curve.points[-1].critic_loss < math.log(51)


def test_a_control_suite_task_without_dm_control_says_what_to_install(d4pg: ModuleType) -> None:
    if importlib.util.find_spec("dm_control") is not None:
        pytest.skip("dm_control is installed here")
    with pytest.raises(ImportError, match="--env dmc:cartpole-swingup needs DeepMind's Control Suite") as error:
        d4pg.main(["--single-process", "--env", "dmc:cartpole-swingup"])
    assert "pip install dm-control" in str(error.value)
