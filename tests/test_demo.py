"""The demo's training script on 2 real replicas: it learns, agrees across replicas, and reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

from replicator.demo import digits  # noqa: E402
from replicator.testing import run_replicas  # noqa: E402

STEPS = 30


def test_two_replicas_learn_digits_and_write_figures(tmp_path: Path) -> None:
    result_path = tmp_path / "result.json"
    argv = ["--steps", str(STEPS), "--global-batch", "64", "--image-size", "8", "--result", str(result_path), "--quiet"]
    results = run_replicas(digits.main, 2, argv, timeout_s=120)

    written = json.loads(result_path.read_text())
    expected = {"replicas", "global_batch", "per_replica_batch", "steps", "test_accuracy", "images_per_second",
                "communication_share", "step_time_ms", "first_loss", "last_loss"}
    assert expected <= written.keys()
    assert written == pytest.approx(results[0])  # replica 0 wrote what it returned
    assert written["replicas"] == 2 and written["per_replica_batch"] == 32
    assert written["steps"] == STEPS
    # The losses are all-reduced and the evaluation is collective: every replica saw the same figures.
    assert results[1]["test_accuracy"] == results[0]["test_accuracy"]
    assert results[1]["last_loss"] == pytest.approx(results[0]["last_loss"])
    assert written["last_loss"] < 0.5 * written["first_loss"]
    assert written["test_accuracy"] > 0.6  # chance is 0.1; 30 steps of 64 digits get well past it
    assert written["images_per_second"] > 0 and written["step_time_ms"] > 0
    assert 0.0 <= written["communication_share"] < 1.0
