"""`replicator launch --max-restarts`: a killed replica restarts the whole job, which resumes and ends identical."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from replicator.launch import LaunchSpec, torchrun_arguments
from replicator.launch.recovery import Outcome, run_attempts
from replicator.testing import run_replicas
from replicator.testing.checkpointed_job import launch_job, main, recovery_problems

STEPS, EVERY = 20, 4
JOB = ("--steps", str(STEPS), "--every", str(EVERY), "--keep", "2")


def test_attempts_run_until_one_succeeds_and_never_after_an_interrupt() -> None:
    seen: list[int] = []
    lines: list[str] = []

    def fails_twice(attempt: int) -> Outcome:
        seen.append(attempt)
        return Outcome(attempt == 2, {} if attempt == 2 else {1: -9})

    assert run_attempts(fails_twice, 2, lines.append) == 0 and seen == [0, 1, 2]
    assert "rank 1: killed by signal 9 (SIGKILL), no error recorded" in lines[0]
    assert "attempt 1 (restart 1 of at most 2)" in lines[1]  # attempts count from 0, as current_attempt() does
    seen.clear()
    assert run_attempts(fails_twice, 1, lines.append) == 1 and seen == [0, 1]
    assert run_attempts(lambda attempt: Outcome(False, interrupted=True), 5, lines.append) == 130


def test_each_attempt_is_a_fresh_rendezvous_without_torchrun_restarts() -> None:
    local = LaunchSpec(target="train.py", args=["--log", "x"], nproc_per_node=2)
    arguments = torchrun_arguments(local, attempt=1)
    assert arguments[arguments.index("--max-restarts") + 1] == "0"
    # Script options never reach torchrun's parser; the worker entry runs the script.
    assert arguments[-5:] == ["--", "replicator.launch.worker", "train.py", "--log", "x"]
    nodes = LaunchSpec(target="train.py", args=[], nnodes=2, master="10.0.0.1:29400")
    commands = [torchrun_arguments(nodes, attempt) for attempt in range(3)]
    ports = [command[command.index("--master-port") + 1] for command in commands]
    assert ports == ["29400", "29401", "29402"]  # every node's launcher moves to the same new port


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final parameters (2 replicas, like the launched jobs)."""
    workdir = tmp_path_factory.mktemp("reference")
    argv = ["--dir", str(workdir / "checkpoints"), "--out", str(workdir / "params.pt"), *JOB]
    run_replicas(main, 2, argv, timeout_s=240)
    return torch.load(workdir / "params.pt", weights_only=True)


def test_a_replica_killed_at_a_random_step_is_restarted_and_ends_identical(tmp_path: Path, reference: dict) -> None:
    chooser = random.Random()
    kill_step, kill_rank = chooser.randrange(1, STEPS), chooser.randrange(2)
    result = launch_job(tmp_path, *JOB, "--kill-step", str(kill_step), "--kill-rank", str(kill_rank), max_restarts=2)
    problems = recovery_problems(result, reference, steps=STEPS, every=EVERY)
    assert not problems, (kill_step, kill_rank, result.output[-3000:])
    assert "restarting the whole job: attempt 1 (restart 1 of at most 2)" in result.output


def test_a_replica_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(
    tmp_path: Path, reference: dict
) -> None:
    result = launch_job(tmp_path, *JOB, "--kill-save", "8", "--kill-rank", "1", max_restarts=1)
    assert not recovery_problems(result, reference, steps=STEPS, every=EVERY), result.output[-3000:]
    # Step 8's checkpoint never became visible, so attempt 1 resumes after step 4.
    assert [step for attempt, step, _ in result.steps if attempt == 1][0] == 5
