"""A failing process leaves one way, however it was started: run_replicas, `replicator launch` or plain torchrun.

The observable difference is what its peers hear. A learner of `mode="actor_learner"` whose step_fn raises
closes its job as failing, which tells its actors why through the job's store ("learner 0 (rank 0) failed;
see its error"); a learner that merely disappeared would leave them with "stopped answering" instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from replicator.testing import ReplicaFailure, run_replicas

# One learner, one actor. The learner raises at its fourth step while the actor keeps adding transitions.
JOB = textwrap.dedent(
    """
    import torch
    import replicator as rp


    def job():
        repl = rp.Replicator(mode=rp.ActorLearner(actors=1))
        replay = rp.Replay(capacity=100, batch_size=4, samples_per_insert=2.0, min_size=8)
        with repl.scope():
            model = torch.nn.Linear(3, 1)
            optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))

        def actor_fn(actor):
            while actor.running:
                actor.add(observation=torch.zeros(2), action=torch.zeros(1), reward=0.0,
                          next_observation=torch.zeros(2))

        def step_fn(ctx, batch):
            if ctx.step == 3:
                raise ValueError("the learner broke on purpose")
            loss = model(torch.cat([batch.observation, batch.action], dim=1)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        for _ in repl.run(step_fn, repl.prepare_input(replay), steps=1_000, actor_fn=actor_fn):
            pass


    if __name__ == "__main__":
        job()
    """
)
TOLD = "actor 0 (rank 1) stops: learner 0 (rank 0) failed; see its error"


def failing_learner_job() -> None:
    namespace: dict[str, object] = {}
    exec(compile(JOB, "failing_learner_job", "exec"), namespace)  # the very script the launchers run
    namespace["job"]()  # type: ignore[operator]


def test_under_run_replicas_the_actor_is_told_that_the_learner_failed() -> None:
    # REPLICATOR_TIMEOUT is long: an actor left to find out by itself would outlast run_replicas' 90 s.
    with pytest.raises(ReplicaFailure) as failure:
        run_replicas(failing_learner_job, 2, timeout_s=90, env={"REPLICATOR_TIMEOUT": "300"})
    learner, actor = failure.value.errors
    assert "the learner broke on purpose" in learner.message, learner
    assert TOLD in actor.message, actor


def _environment() -> dict[str, str]:
    env = {"REPLICATOR_PROGRESS": "0", "REPLICATOR_DEVICE": "cpu", "REPLICATOR_TIMEOUT": "300",
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]}
    if "PYTHONPATH" in os.environ:  # a checkout put first on the path reaches the replicas too
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


@pytest.mark.parametrize("launcher", ["replicator launch", "torchrun"])
def test_under_a_launcher_the_actor_is_told_that_the_learner_failed(tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(JOB)
    logs = tmp_path / "logs"
    if launcher == "replicator launch":
        command = [sys.executable, "-m", "replicator.cli", "launch", "-n", "2", "--threads", "1",
                   "--log-dir", str(logs), str(script)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(script)]
    # A safety net only: an actor left to find out by itself would wait for its 300 s timeout.
    done = subprocess.run(command, capture_output=True, text=True, env=_environment(), timeout=150)
    said = done.stdout + done.stderr
    if launcher == "replicator launch":  # the launcher keeps each replica's full error in its log
        said += "".join(path.read_text() for path in logs.rglob("*") if path.is_file())
    assert done.returncode != 0, said
    assert "the learner broke on purpose" in said, said
    assert TOLD in said, said
