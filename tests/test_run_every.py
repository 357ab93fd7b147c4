"""run(every={N: hook}): called on every replica after every N-th step of the training, with the trained model.

After a restart the hook fires at the steps the uninterrupted run fired at, never for the steps
the checkpoint skipped, and sees the same model there; a hook that draws random numbers (a
shuffled evaluation loader) at a checkpoint's step leaves the resumed training bit-exact.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

SAMPLES, FEATURES, CLASSES, GLOBAL_BATCH = 64, 6, 3, 8  # 8 steps an epoch
EPOCHS, EVALUATE_EVERY, CHECKPOINT_EVERY, KILL = 5, 5, 10, 23  # the hook and a checkpoint both at step 20


def _training(directory: str, kill_at: int) -> dict[str, Any]:
    """Dropout training over a shuffled sampler for EPOCHS epochs, evaluated every 5 steps; SIGKILLed at `kill_at`."""
    repl = rp.Replicator()
    torch.manual_seed(0)
    with repl.scope():
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(16, CLASSES))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    torch.manual_seed(10 + repl.replica_id)
    data = torch.Generator().manual_seed(3)
    dataset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, FEATURES, generator=data),
                                             torch.randint(0, CLASSES, (SAMPLES,), generator=data))
    held_out = torch.utils.data.TensorDataset(torch.randn(30, FEATURES, generator=data),
                                              torch.randint(0, CLASSES, (30,), generator=data))

    def input_fn(ctx: rp.InputContext) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(dataset, batch_size=ctx.per_replica_batch_size(GLOBAL_BATCH),
                                           sampler=ctx.sampler(dataset, shuffle=True))

    def step_fn(ctx: rp.ReplicaContext, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if ctx.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    evaluations: list[dict[str, Any]] = []

    def evaluate(step: int) -> None:
        ctx = repl.context
        # Shuffled: the evaluation draws from the global generator, as a shuffled loader would.
        loader = torch.utils.data.DataLoader(held_out, batch_size=4, shuffle=True)
        model.eval()
        with torch.no_grad():
            rows = [(model(x).argmax(1) == y).double() for x, y in loader]
        model.train()
        correct = ctx.all_mean(torch.cat(rows).mean())  # a collective: every replica is here at the same step
        evaluations.append({"step": step, "accuracy": correct, "global_step": repl.global_step,
                            "parameters": [p.detach().clone() for p in model.parameters()]})

    for _ in repl.run(step_fn, repl.prepare_input(input_fn), epochs=EPOCHS, every={EVALUATE_EVERY: evaluate},
                      checkpoint_every=CHECKPOINT_EVERY, checkpoint_dir=directory, progress=False, record=False):
        pass
    return {"evaluations": evaluations, "parameters": [p.detach().clone() for p in model.parameters()]}


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_every_fires_at_the_same_steps_with_the_same_model_after_a_resume(tmp_path: Path) -> None:
    whole = run_replicas(_training, 2, str(tmp_path / "whole"), -1, timeout_s=240)
    steps = EPOCHS * GLOBAL_BATCH
    for result in whole:
        evaluations = result["evaluations"]
        assert [e["step"] for e in evaluations] == list(range(EVALUATE_EVERY, steps + 1, EVALUATE_EVERY))
        assert all(e["global_step"] == e["step"] for e in evaluations)  # after the step's update
        assert _equal(evaluations[-1]["parameters"], result["parameters"])  # the trained model, the last step's
    assert all(torch.equal(a["accuracy"], b["accuracy"]) for a, b in zip(*(r["evaluations"] for r in whole)))

    with pytest.raises(ReplicaFailure):
        run_replicas(_training, 2, str(tmp_path / "cut"), KILL, timeout_s=240)  # newest checkpoint: step 20
    resumed = run_replicas(_training, 2, str(tmp_path / "cut"), -1, timeout_s=240)
    for got, want in zip(resumed, whole, strict=True):
        # Never for the steps the checkpoint skipped (20 included: it fired before that checkpoint was written).
        assert [e["step"] for e in got["evaluations"]] == [25, 30, 35, 40]
        for evaluation, reference in zip(got["evaluations"], want["evaluations"][-4:], strict=True):
            assert torch.equal(evaluation["accuracy"], reference["accuracy"]), evaluation["step"]
            assert _equal(evaluation["parameters"], reference["parameters"]), evaluation["step"]
        assert _equal(got["parameters"], want["parameters"])


def _bad_every(every: Any) -> None:
    repl = rp.Replicator()
    for _ in repl.run(lambda ctx, batch: batch.sum(), [torch.ones(2)], every=every, progress=False, record=False):
        pass


@pytest.mark.parametrize(("every", "said"), [
    ([print], "must map step counts to functions"),
    ({0: print}, "the key 0: each key is a number of steps"),
    ({10: "evaluate"}, "the value must be a function"),
])
def test_a_bad_every_is_refused_on_every_replica(run_failing_fast: Callable[..., Any], every: Any,
                                                 said: str) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_bad_every, 2, every)
    assert [e.rank for e in caught.value.errors] == [0, 1]
    assert all(e.kind == "ReplicatorUsageError" and said in e.message for e in caught.value.errors), caught.value
