"""Replicas given different run() arguments fail together at the start, naming each one's value (issue 28, item 2).

Before, replicas with steps=3 and steps=5 ran three steps together; then the one with more
steps waited for the other until REPLICATOR_TIMEOUT and ended in a raw Gloo timeout. The
timeout set here is only a safety net: the verdict is each replica's message.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import replicator as rp
from replicator.errors import ReplicaMismatchError
from replicator.testing import ReplicaFailure, run_replicas

SAFETY_NET = {"REPLICATOR_TIMEOUT": "60"}  # a hang fails the test after a minute instead of five


def train(argument: str, values: tuple[object, object], folder: str | None = None) -> int:
    """Two steps of a tiny model, with `argument` set to this replica's entry of `values`."""
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(3, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mine = values[repl.replica_id]
    options: dict[str, object] = {"steps": 6}
    if argument == "accumulate":
        repl.accumulate(int(mine))  # type: ignore[call-overload]
    elif argument == "checkpoint_dir":
        options |= {"checkpoint_every": 2, "checkpoint_dir": str(Path(str(folder)) / str(mine))}
    elif argument == "checkpoint_every":
        options |= {"checkpoint_every": mine, "checkpoint_dir": folder}
    else:
        options |= {argument: mine}

    def step_fn(ctx, batch):
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        optimizer.step()

    batches = [torch.ones(2, 3)] * 4  # one epoch is 4 steps
    for _ in repl.run(step_fn, batches, progress=False, record=False, **options):  # type: ignore[arg-type]
        pass
    return repl.global_step


def failures(argument: str, values: tuple[object, object], folder: str | None = None) -> list[str]:
    with pytest.raises(ReplicaFailure) as caught:
        run_replicas(train, 2, argument, values, folder, env=SAFETY_NET)
    errors = caught.value.errors
    assert [e.rank for e in errors] == [0, 1], f"not every replica raised: {caught.value}"
    assert all(e.kind == ReplicaMismatchError.__name__ for e in errors), caught.value
    return [e.message for e in errors]


def test_replicas_given_different_steps_fail_at_once_naming_both_values() -> None:
    for message in failures("steps", (3, 5)):
        assert "run() was given different arguments on different replicas" in message, message
        assert "steps: 3 on replica(s) 0; 5 on replica(s) 1" in message, message
        assert "test_run_arguments_agree.py" in message, "the message names the run() call"
        assert "Pass every replica the same steps=" in message, message


def test_replicas_given_different_epochs_fail_at_once() -> None:
    for message in failures("epochs", (1, 2)):
        assert "epochs: 1 on replica(s) 0; 2 on replica(s) 1" in message, message
        assert "steps" not in message.splitlines()[1], "only the arguments that differ are listed"


def test_replicas_given_steps_and_none_name_none() -> None:
    for message in failures("steps", (None, 2)):
        assert "None on replica(s) 0" in message and "2 on replica(s) 1" in message, message


def test_replicas_that_would_checkpoint_at_different_steps_or_places_fail_at_once(tmp_path: Path) -> None:
    for message in failures("checkpoint_every", (2, 4), str(tmp_path)):
        assert "checkpoint_every: 2 on replica(s) 0; 4 on replica(s) 1" in message, message
    for message in failures("checkpoint_dir", ("a", "b"), str(tmp_path)):
        assert f"{str(tmp_path / 'a')!r} on replica(s) 0" in message, message
        assert f"{str(tmp_path / 'b')!r} on replica(s) 1" in message, message
    assert not list(tmp_path.rglob("*.json")), "nothing was saved before the mismatch was found"


def test_replicas_accumulating_different_counts_fail_at_once() -> None:
    for message in failures("accumulate", (1, 2)):
        assert "micro-steps per update (repl.accumulate): 1 on replica(s) 0; 2 on replica(s) 1" in message, message


def test_replicas_given_the_same_arguments_run_as_before() -> None:
    assert run_replicas(train, 2, "steps", (3, 3), env=SAFETY_NET) == [3, 3]
