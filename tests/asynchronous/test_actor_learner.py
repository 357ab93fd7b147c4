"""Actor–learner: N-step returns, prioritized sampling, the rate limiter, learners equal to one, fresh weights, faults.

Every job is real processes on Gloo, with a toy environment (no gymnasium): learners first, then actors, then the
evaluator, as `rp.Replicator(mode="actor_learner", actors=A, evaluator=E)` lays them out.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.asynchronous.actor_learner.nstep import NStepAdder
from replicator.errors import ReplicatorUsageError
from replicator.testing import ReplicaFailure, run_replicas

from _events import announce, wait_for
from _numerics import assert_within, bound, training_bound

SHORT = {"REPLICATOR_TIMEOUT": "30"}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def toy_actor(actor: rp.ActorContext, *, sleep_s: float = 0.0, steps: int | None = None) -> None:
    """Ten-step episodes: observation (t / 10, actor id), a random action, a reward that depends on both.

    Adds while the learners run (or `steps` times, then returns)."""
    t = 0
    while actor.running and (steps is None or actor.env_steps < steps):
        observation = torch.tensor([t / 10, float(actor.actor_id)])
        action = torch.rand(1)
        reward = float(observation.sum() - action.sum())
        next_observation = torch.tensor([(t + 1) / 10, float(actor.actor_id)])
        actor.add(observation=observation, action=action, reward=reward, next_observation=next_observation,
                  terminated=False, truncated=t == 9)
        t = 0 if t == 9 else t + 1
        if sleep_s:
            time.sleep(sleep_s)


def regression_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: rp.ReplaySample) -> torch.Tensor:
    inputs = torch.cat([batch.observation, batch.action], dim=1)
    loss = torch.nn.functional.mse_loss(model(inputs).squeeze(1), batch.reward)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


# -- N-step assembly and prioritized sampling (one job, two tests) ------------------------------------------------
GAMMA = 0.5
# (observation, reward, terminated, truncated): a 5-step episode that terminates, then a 4-step one that is cut.
SCRIPT = [*[(t, float(t + 1), t == 4, False) for t in range(5)],
          *[(100 + t, 10.0 * (t + 1), False, t == 3) for t in range(4)]]
# Hand-computed 3-step transitions with gamma 0.5, in the order the adder releases them:
# observation -> (reward, discount, next observation).
EXPECTED = {
    0: (1 + 0.5 * 2 + 0.25 * 3, 0.125, 3), 1: (2 + 0.5 * 3 + 0.25 * 4, 0.125, 4),
    2: (3 + 0.5 * 4 + 0.25 * 5, 0.0, 5), 3: (4 + 0.5 * 5, 0.0, 5), 4: (5.0, 0.0, 5),  # terminated: no bootstrap
    100: (10 + 0.5 * 20 + 0.25 * 30, 0.125, 103), 101: (20 + 0.5 * 30 + 0.25 * 40, 0.125, 104),
    102: (30 + 0.5 * 40, 0.25, 104), 103: (40.0, 0.5, 104),  # truncated: bootstrap with gamma^k
}
ALPHA, BETA = 0.6, 0.4
PRIORITY_STEPS, PRIORITY_BATCH = 200, 16


def scripted_actor(actor: rp.ActorContext) -> None:
    for observation, reward, terminated, truncated in SCRIPT:
        actor.add(observation=torch.tensor([float(observation)]), action=torch.tensor([float(observation)]),
                  reward=reward, next_observation=torch.tensor([float(observation + 1)]), terminated=terminated,
                  truncated=truncated)
    while actor.running:
        time.sleep(0.01)


def prioritized_job() -> dict[str, Any]:
    repl = rp.Replicator(mode="actor_learner", actors=1)
    replay = rp.Replay(capacity=16, batch_size=PRIORITY_BATCH, samples_per_insert=None, min_size=len(EXPECTED),
                       n_step=3, discount=GAMMA, prioritized=True, priority_exponent=ALPHA,
                       importance_exponent=BETA, seed=5)
    with repl.scope():
        model = torch.nn.Linear(1, 1)
    seen: dict[int, tuple[float, float, float]] = {}
    keys: dict[int, int] = {}
    counted: list[torch.Tensor] = []
    weights: list[tuple[torch.Tensor, torch.Tensor]] = []

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        for row in range(len(batch.key)):
            observation = int(batch.observation[row, 0])
            seen[observation] = (float(batch.reward[row]), float(batch.discount[row]),
                                 float(batch.next_observation[row, 0]))
            keys[observation] = int(batch.key[row])
        if repl.global_step == 0:  # priority key + 1 for every item; from step 2 the batches are drawn after this
            every = torch.arange(len(EXPECTED))
            replay.update_priorities(every, (every + 1).double())
        elif repl.global_step >= 2:
            counted.append(batch.key.clone())
            weights.append((batch.key.clone(), batch.weight.clone()))

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=PRIORITY_STEPS, actor_fn=scripted_actor):
        pass
    del model
    return {"seen": seen, "keys": keys, "counted": counted, "weights": weights}


@pytest.fixture(scope="module")
def prioritized_run() -> dict[str, Any]:
    return run_replicas(prioritized_job, 2, timeout_s=120, env=SHORT)[0]


def test_n_step_returns_match_hand_computed_values(prioritized_run: dict[str, Any]) -> None:
    seen = prioritized_run["seen"]
    assert sorted(seen) == sorted(EXPECTED)
    for observation, (reward, discount, next_observation) in EXPECTED.items():
        # Exactly: integer rewards and observations, discounts that are powers of 0.5, sums far below 2**24.
        assert seen[observation] == (reward, discount, next_observation), observation


def test_the_adder_releases_every_transition_once_per_episode() -> None:
    adder = NStepAdder(3, GAMMA)
    released = []
    for observation, reward, terminated, truncated in SCRIPT:
        o = torch.tensor([float(observation)])
        released += adder.add(o, o, reward, o + 1, terminated, truncated)
    assert [int(t.observation) for t in released] == list(EXPECTED)
    assert [(t.reward, t.discount, float(t.next_observation)) for t in released] == list(EXPECTED.values())


def test_prioritized_sampling_matches_its_priorities(prioritized_run: dict[str, Any]) -> None:
    keys = torch.cat(prioritized_run["counted"])
    assert sorted(prioritized_run["keys"].values()) == list(range(len(EXPECTED)))  # items 0..8, in insert order
    scaled = torch.arange(1, len(EXPECTED) + 1, dtype=torch.float64) ** ALPHA
    probability = scaled / scaled.sum()
    observed = torch.bincount(keys, minlength=len(EXPECTED)).double()
    expected = probability * keys.numel()
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 26.12, (chi_square, observed, expected)  # 8 degrees of freedom, p = 0.001
    for batch_keys, weight in prioritized_run["weights"]:
        raw = (len(EXPECTED) * probability[batch_keys]) ** -BETA
        # float32 against float64: the priorities' normalizing sum (one term per stored item), the power, the
        # division by the largest: len(EXPECTED) + 4 roundings of weights that are at most 1.
        assert_within(weight, (raw / raw.max()).float(), bound(torch.float32, 1.0, len(EXPECTED) + 4), "weights")


# -- two learners: identical, and equal to one learner on the same batches --------------------------------------
EQUAL_STEPS = 12


def two_learners_job() -> tuple[str, list[torch.Tensor], list[list[torch.Tensor]], dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=1)
    replay = rp.Replay(capacity=64, batch_size=8, samples_per_insert=4.0, min_size=8, seed=3)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    batches: list[list[torch.Tensor]] = []

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> torch.Tensor:
        batches.append([batch.observation.clone(), batch.action.clone(), batch.reward.clone()])
        return regression_step(model, optimizer, batch)

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=EQUAL_STEPS, actor_fn=toy_actor, update_period=3):
        pass
    return repl.role, [p.detach().clone() for p in model.parameters()], batches, repl.last_run["actor_learner"]


def test_two_learners_hold_identical_parameters_equal_to_one_learner_on_the_same_batches() -> None:
    results = run_replicas(two_learners_job, 3, timeout_s=120, env=SHORT)
    assert [r[0] for r in results] == ["learner", "learner", "actor"]
    (_, first, batches0, figures), (_, second, batches1, _) = results[0], results[1]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)  # bit for bit: one synchronous replica group
    assert len(batches0) == len(batches1) == EQUAL_STEPS
    assert all(len(b[0]) == 4 for b in batches0 + batches1)  # each learner samples batch_size / 2 of its shard
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for part0, part1 in zip(batches0, batches1, strict=True):
        batch = rp.ReplaySample(*(torch.cat([a, b]) for a, b in zip(part0, part1, strict=True)),
                                weight=torch.ones(8), key=torch.zeros(8, dtype=torch.int64), discount=torch.ones(8),
                                next_observation=torch.zeros(8, 2))
        regression_step(model, optimizer, batch)
    # 2 learners x 4 rows against 8 rows at once: the gradient's sums over 8 rows through a fan-in of 3 in another
    # order, and the update, for EQUAL_STEPS steps.
    tolerance = training_bound(torch.float32, [p.detach() for p in model.parameters()], 8 + 3 + 3, EQUAL_STEPS)
    for index, (mine, reference) in enumerate(zip(first, model.parameters(), strict=True)):
        assert_within(mine, reference.detach(), tolerance, f"parameter {index}")
    # The one actor fed both shards (it is the only one), and the counters cover the job.
    assert figures["learners"] == 2 and figures["samples"] == 8 * EQUAL_STEPS
    assert figures["inserts"] >= 8 and figures["env_steps"] >= figures["inserts"]


# -- the rate limiter: a slow and a fast actor ---------------------------------------------------------------------
STEPS = 60

def rate_limited_job() -> tuple[str, dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=2)
    replay = rp.Replay(capacity=1000, batch_size=8, samples_per_insert=4.0, tolerance=0.1, min_size=16, seed=1)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    def actor_fn(actor: rp.ActorContext) -> None:
        toy_actor(actor, sleep_s=0.05 if actor.actor_id == 0 else 0.0)  # actor 0 is slow, actor 1 fast

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> torch.Tensor:
        time.sleep(0.03)  # a learner slower than the fast actor, so that the limiter must hold that actor back
        return regression_step(model, optimizer, batch)

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=STEPS, actor_fn=actor_fn, update_period=10):
        pass
    return repl.role, repl.last_run["actor_learner"]


def test_the_rate_limiter_keeps_samples_per_insert_within_tolerance_with_a_slow_and_a_fast_actor() -> None:
    (_, learner), (_, slow), (_, fast) = run_replicas(rate_limited_job, 3, timeout_s=120, env=SHORT)
    assert learner["samples"] == STEPS * 8
    # rel=0.1 is the limiter's own band (rp.Replay(..., tolerance=0.1)), not a rounding bound: counts, no kernels.
    assert learner["samples_per_insert"] == pytest.approx(4.0, rel=0.1), learner
    assert learner["target_samples_per_insert"] == 4.0
    # The fast actor ran ahead and was held back for most of the run; the slow one much less.
    assert fast["wait_seconds"] > 0.3 and fast["wait_seconds"] > 2 * slow["wait_seconds"], (slow, fast)
    assert fast["transitions_sent"] > slow["transitions_sent"]
    assert learner["env_steps"] == slow["env_steps"] + fast["env_steps"]


# -- fresh weights: actors and the evaluator see the newest weights every update_period --------------------------
PERIOD = 4


class Stamped(torch.nn.Module):
    """A model whose `stamp` buffer holds the learner step its weights come from."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = make_model()
        self.register_buffer("stamp", torch.zeros(()))


def fresh_weights_job(directory: str) -> tuple[str, Any, dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=1, evaluator=True)
    progress = Path(directory) / "evaluator-saw-env-steps"  # the learner's last step waits for it: a run can be
    # shorter than one of the evaluator's naps
    replay = rp.Replay(capacity=100, batch_size=2, samples_per_insert=1.0, tolerance=0.0, min_size=4)
    with repl.scope():
        model = Stamped()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    seen: list[tuple[int, int, float]] = []

    def actor_fn(actor: rp.ActorContext) -> None:
        if actor.is_evaluator:
            while actor.running:
                actor.update_weights()
                seen.append((actor.counters()["env_steps"], actor.version, float(model.stamp)))
                if seen[-1][0] > 0:
                    announce(progress)
                time.sleep(0.05)
            return
        t = 0
        while actor.running:
            observation = torch.tensor([t / 10, 0.0])
            actor.add(observation=observation, action=torch.rand(1), reward=1.0, next_observation=observation,
                      truncated=t == 9)
            seen.append((actor.env_steps, actor.version, float(model.stamp)))
            t = (t + 1) % 10

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> torch.Tensor:
        loss = regression_step(model.linear, optimizer, batch)
        model.stamp.fill_(repl.global_step + 1)  # the weights after this step are version global_step + 1
        if repl.global_step == 29:  # the last step
            wait_for(progress)
        return loss

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=30, actor_fn=actor_fn, update_period=PERIOD):
        pass
    return repl.role, seen, repl.last_run["actor_learner"]


def test_actors_see_weights_no_older_than_the_update_period_allows(tmp_path: Path) -> None:
    (_, _, learner), (_, actor, _), (role, evaluator, _) = run_replicas(fresh_weights_job, 3, str(tmp_path),
                                                                        timeout_s=120, env=SHORT)
    assert role == "evaluator" and evaluator and learner["evaluator"] is True
    for _, version, stamp in actor + evaluator:
        assert stamp == version  # the weights in place are those of the version the actor reports
    changed = [steps for (steps, version, _), (_, before, _) in zip(actor[1:], actor, strict=False)
               if version != before]
    assert changed and all(steps % PERIOD == 0 for steps in changed)  # pulls every PERIOD env steps, no others
    # Between two pulls the actor inserts PERIOD transitions; at 1 sample per insert, batches of 2 and a band of
    # ±1.5 samples, the learner takes at most 3 steps meanwhile (+1: it publishes just before drawing a batch).
    lag = learner["policy_lag"]
    assert lag["count"] == learner["inserts"] and 1 <= lag["max"] <= 4, lag
    assert evaluator[-1][0] > 0 and [v for _, v, _ in evaluator] == sorted(v for _, v, _ in evaluator)


# -- the evaluator ends the run early (a target return reached): every learner stops at the same step -----------
def ended_early_job() -> tuple[str, int, list[torch.Tensor], dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=1, evaluator=True)
    replay = rp.Replay(capacity=200, batch_size=4, samples_per_insert=None, min_size=8, seed=2)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    def actor_fn(actor: rp.ActorContext) -> None:
        if not actor.is_evaluator:
            return toy_actor(actor)
        while actor.running and actor.counters()["learner_steps"] < 10:
            time.sleep(0.02)
        actor.end_run("enough")
        while actor.running:  # the learners take a few more steps, then release everyone
            time.sleep(0.02)

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> torch.Tensor:
        return regression_step(model, optimizer, batch)

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=100_000, actor_fn=actor_fn):
        pass
    return repl.role, repl.global_step, [p.detach().clone() for p in model.parameters()], repl.last_run


def test_the_evaluator_ends_the_run_and_every_learner_stops_at_the_same_step() -> None:
    results = run_replicas(ended_early_job, 4, timeout_s=120, env=SHORT)
    assert [r[0] for r in results] == ["learner", "learner", "actor", "evaluator"]
    (_, steps0, params0, run0), (_, steps1, params1, run1) = results[0], results[1]
    assert 10 <= steps0 == steps1 < 1_000, (steps0, steps1)
    for a, b in zip(params0, params1, strict=True):
        assert torch.equal(a, b)
    for figures in (run0["actor_learner"], run1["actor_learner"]):
        assert figures["ended"] == "the evaluator (rank 3) asked to end the run: enough"
        assert figures["learner_steps"] == steps0


# -- faults --------------------------------------------------------------------------------------------------------
def killed_actor_job() -> tuple[str, dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=2)
    replay = rp.Replay(capacity=500, batch_size=4, samples_per_insert=2.0, min_size=8)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    def actor_fn(actor: rp.ActorContext) -> None:
        if actor.actor_id == 1:  # dies early: the learners need 60 steps x 4 samples / 2 = 120 inserts
            toy_actor(actor, steps=20)
            os.kill(os.getpid(), signal.SIGKILL)
        toy_actor(actor, sleep_s=0.002)

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> torch.Tensor:
        return regression_step(model, optimizer, batch)

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=60, actor_fn=actor_fn, update_period=5):
        pass
    return repl.role, repl.last_run


def test_a_killed_actor_leaves_the_job_running(run_failing_fast: Callable[..., Any]) -> None:
    # Two learners, two actors: actor 1 alone feeds learner 1's shard until it dies; then actor 0 feeds both.
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(killed_actor_job, 4, collective_timeout_s=15)
    assert [(e.rank, e.kind) for e in failure.value.errors] == [(3, "died")]  # only the actor that was killed
    results = failure.value.results
    (_, learner0), (_, learner1), (role, actor) = results[0], results[1], results[2]
    assert learner0["steps"] == learner1["steps"] == 60 and role == "actor"
    for learner in (learner0, learner1):
        departed = learner["actor_learner"]["departed"]
        assert list(departed) == [1] and departed[1]["how"] == "died" and departed[1]["rank"] == 3
    assert actor["actor_learner"]["env_steps"] > 20


def checkpointed_job(directory: str, steps: int) -> tuple[str, list[int], list[torch.Tensor], list[Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=1)
    replay = rp.Replay(capacity=100, batch_size=4, samples_per_insert=2.0, min_size=8)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.05))
    first: list[Any] = []

    def actor_fn(actor: rp.ActorContext) -> None:
        first.append((actor.version, [p.detach().clone() for p in model.parameters()]))
        toy_actor(actor)

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> torch.Tensor:
        return regression_step(model, optimizer, batch)

    steps_run = [step for step, _ in repl.run(step_fn, repl.prepare_input(replay), steps=steps, actor_fn=actor_fn,
                                              checkpoint_every=2, checkpoint_dir=directory)]
    return repl.role, steps_run, [p.detach().clone() for p in model.parameters()], first


def test_learners_checkpoint_and_resume_and_actors_pull_the_resumed_weights(tmp_path: Path) -> None:
    directory = str(tmp_path / "checkpoints")
    (_, steps, saved, _), _ = run_replicas(checkpointed_job, 2, directory, 4, timeout_s=120, env=SHORT)
    assert steps == [0, 1, 2, 3]
    (_, steps, _, _), (_, _, _, first) = run_replicas(checkpointed_job, 2, directory, 6, timeout_s=120, env=SHORT)
    assert steps == [4, 5]  # resumed at step 4
    version, weights = first[0]
    assert version == 4  # the actor's first pull: the restored learner's weights
    for mine, reference in zip(weights, saved, strict=True):
        assert torch.equal(mine, reference)


# -- bad input: a clear error on every process, never a hang ------------------------------------------------------
@pytest.mark.parametrize(("make", "words"), [
    (lambda: rp.Replicator(mode="actor_learner", actors=0), "needs actors >= 1"),
    (lambda: rp.Replicator(mode="actor_learner", actors=1), "leave no learner"),  # this test is one process
    (lambda: rp.Replicator(actors=2), "belong to mode='actor_learner'"),
    (lambda: rp.Replay(capacity=4, batch_size=8), "more samples per step than the replay can hold"),
    (lambda: rp.Replay(capacity=4, batch_size=4, min_size=8), "min_size=8"),
], ids=["no-actor", "more-roles-than-processes", "actors-without-mode", "batch>capacity", "min_size>capacity"])
def test_bad_arguments_are_refused_before_any_group_is_built(make: Callable[[], Any], words: str) -> None:
    with pytest.raises(ReplicatorUsageError, match=words):
        make()


def bad_input_job(case: str) -> None:
    repl = rp.Replicator(mode="actor_learner", actors=2 if case == "malformed" else 1)
    replay = rp.Replay(capacity=64, batch_size=3 if case == "uneven" else 4, samples_per_insert=None, min_size=4)
    with repl.scope():
        model = make_model()

    def actor_fn(actor: rp.ActorContext) -> None:
        if actor.actor_id == 1:
            toy_actor(actor, steps=3)
            actor.add(observation=torch.zeros(3), action=torch.zeros(1), reward=0.0, next_observation=torch.zeros(3))
        toy_actor(actor)

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        time.sleep(0.01)

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=10_000, actor_fn=actor_fn):
        pass
    del model


@pytest.mark.parametrize(("case", "world", "words"), [
    ("malformed", 3, ["actor 1 (rank 2)", "observation", "shape (3,) float32", "shape (2,) float32"]),
    ("uneven", 3, ["batch_size=3", "does not split over 2 learners"]),
])
def test_bad_input_raises_on_every_process(run_failing_fast: Callable[..., Any], case: str, world: int,
                                           words: list[str]) -> None:
    # Collectives would give up after 600 s, the harness after 90: waiting for a timeout instead of raising would end
    # in run_replicas' TimeoutError, not this ReplicaFailure. No clock decides.
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(bad_input_job, world, case, collective_timeout_s=600)
    assert sorted(e.rank for e in failure.value.errors) == list(range(world))
    for error in failure.value.errors:
        assert all(word in error.message for word in words), error
