"""benchmarks/actor_learner.py: its SB3-design ring buffer, and a short run of both arms."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "actor_learner.py"


def test_the_ring_buffer_overwrites_the_oldest_and_samples_only_what_it_holds() -> None:
    sys.path.insert(0, str(BENCHMARK.parent))  # the benchmark imports its _harness as a sibling
    try:
        spec = importlib.util.spec_from_file_location("actor_learner", BENCHMARK)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARK.parent))
    buffer = module.RingBuffer(5, observation_size=1, action_size=1, seed=0)
    for t in range(3):
        buffer.add(np.array([t]), np.array([0.5]), float(t), np.array([t + 1]), t == 2)
    assert (len(buffer), buffer.full) == (3, False)
    observation, action, reward, next_observation, terminated = buffer.sample(300)
    assert set(observation[:, 0].tolist()) == {0, 1, 2}, "only the rows written so far"
    assert (next_observation - observation).eq(1).all() and (reward == observation[:, 0]).all()
    assert (terminated == (observation[:, 0] == 2)).all() and (action == 0.5).all()
    for t in range(3, 7):
        buffer.add(np.array([t]), np.array([0.5]), float(t), np.array([t + 1]), False)
    assert (len(buffer), buffer.full, buffer.position) == (5, True, 2)
    observation = buffer.sample(500)[0]
    assert set(observation[:, 0].tolist()) == {2, 3, 4, 5, 6}, "0 and 1, the oldest, were overwritten"


@pytest.mark.timeout(150)
def test_a_short_benchmark_run_reports_every_arm(tmp_path: Path) -> None:
    output = tmp_path / "actor_learner.json"
    d4pg = ("--steps 40 --min-replay 200 --batch-size 64 --samples-per-insert 32 --hidden 32 --update-period 20")
    command = [sys.executable, str(BENCHMARK), "--algorithms", "d4pg", "td3", "ddpg", "--seeds", "0", "--env-steps",
               "300", "--learning-starts", "200", "--eval-every", "150", "--eval-episodes", "2", "--replay-repeats",
               "1", "--replay-inserts", "500", "--job-replay-inserts", "300",
               "--replay-batches", "20", "--d4pg-args", d4pg, "--json", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=140, cwd=ROOT,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "REPLICATOR_THREADS": "1",
                                 "REPLICATOR_DEVICE": "cpu", "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(output.read_text())
    for name in ("td3", "ddpg"):
        [run] = report[name]["runs"]
        assert [point["env_steps"] for point in run["curve"]] == [150, 300]
        assert all(math.isfinite(point["mean_return"]) for point in run["curve"])
        assert report[name]["recipe"]["learning_starts"] == 200
    assert report["td3"]["recipe"]["critics"] == 2 and report["ddpg"]["recipe"]["critics"] == 1
    # The library's arm: examples/d4pg.py launched as a job of 4, its curve and counters read back.
    [library] = report["d4pg"]["runs"]
    assert library["learner_steps"] == 40 and library["curve"]
    assert all(math.isfinite(point["mean_return"]) for point in library["curve"])
    assert library["target_samples_per_insert"] == 32 and library["samples_per_insert"] > 0
    assert library["pull_interval_learner_steps"] == 20 * 2 * 32 / 64
    targets = report["d4pg_targets"]
    assert set(targets) == {"env_steps_to_target", "wall_ratio_to_td3", "samples_per_insert", "policy_lag_p95"}
    replay = report["replay"]
    for arm in ("ring_buffer", "rp_replay"):
        assert replay[arm]["inserts_per_s"]["median"] > 0 and replay[arm]["samples_per_s"]["median"] > 0
    assert "ring buffer (numpy, SB3's design)" in result.stdout and "rp.Replay (1 learner + 1 actor" in result.stdout
