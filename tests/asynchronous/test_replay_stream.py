"""Replay and weights at stream speed: credits keep the limiter exact, add_batch(), pulls on their own link, hostile
peers at the learner's service.

Real processes on Gloo and the peer link, a toy environment, as in test_actor_learner.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import replicator as rp
from replicator.asynchronous.actor_learner import exchange
from replicator.comm import frames
from replicator.comm.peer_link import KEY, connect, hello
from replicator.testing import ReplicaFailure, run_replicas

SHORT = {"REPLICATOR_TIMEOUT": "30"}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def fast_actor(actor: rp.ActorContext) -> None:
    """Adds as fast as it can, numpy arrays as a gymnasium environment gives them."""
    t = 0
    while actor.running:
        observation = np.array([t / 10, float(actor.actor_id)], dtype=np.float32)
        actor.add(observation=observation, action=np.array([0.5], dtype=np.float32), reward=float(t),
                  next_observation=observation + np.float32(0.1), truncated=t == 9)
        t = (t + 1) % 10


# -- the limiter stays exact through credits -------------------------------------------------------------------------
LIMITED_STEPS, LIMITED_BATCH, RATIO = 150, 16, 2.0


def limited_job() -> tuple[str, dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=2)
    replay = rp.Replay(capacity=10_000, batch_size=LIMITED_BATCH, samples_per_insert=RATIO, tolerance=0.1,
                       min_size=100, seed=4)
    with repl.scope():
        model = make_model()

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        pass  # an empty step: the actors, much faster than the ratio allows, must be held back by credits alone

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=LIMITED_STEPS, actor_fn=fast_actor):
        pass
    del model
    return repl.role, repl.last_run["actor_learner"]


def test_two_fast_actors_never_push_a_commit_or_a_sample_outside_the_limiters_band() -> None:
    (_, learner), (_, first), (_, second) = run_replicas(limited_job, 3, timeout_s=120, env=SHORT)
    assert learner["samples"] == LIMITED_STEPS * LIMITED_BATCH
    # Counted on every commit and every sample, not sampled: none left the band.
    assert learner["outside_band"] == 0, learner
    # rel=0.1: the bound on realised samples per insert; the band itself is ±10 % of the ratio over min_size.
    assert learner["samples_per_insert"] == pytest.approx(RATIO, rel=0.1), learner
    # The actors ran far ahead of the ratio, so they waited for credit: the back pressure reached them. Together:
    # which of two actors finds the credit gone is the scheduler's choice (one descheduled on 2 cores, or slowed
    # by its sends, may always find room while the other waits).
    assert first["wait_seconds"] + second["wait_seconds"] > 0, (first, second)
    assert learner["inserts"] <= first["transitions_sent"] + second["transitions_sent"]


# -- REPLICATOR_PEER_LINK=0: the same frames over Gloo point-to-point --------------------------------------------------
def gloo_job() -> tuple[str, dict[str, Any], str | None]:
    """limited_job's run where some process turned the peer link off; actor 1 first tries rp.join_actor, which needs
    sockets. Only rank 2 turns the link off: the job decides together, so every process goes over Gloo."""
    if os.environ["RANK"] == "2":
        os.environ["REPLICATOR_PEER_LINK"] = "0"
    repl = rp.Replicator(mode="actor_learner", actors=2)
    replay = rp.Replay(capacity=10_000, batch_size=LIMITED_BATCH, samples_per_insert=RATIO, tolerance=0.1,
                       min_size=100, seed=4)
    with repl.scope():
        model = make_model()
    refusal: list[str] = []

    def actor_fn(actor: rp.ActorContext) -> None:
        if actor.actor_id == 1:
            try:
                rp.join_actor(fast_actor, make_model(), replay, actor=1, timeout_s=30)
            except rp.ReplicatorUsageError as error:
                refusal.append(str(error))
        fast_actor(actor)

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        pass

    runs = []
    for run in (1, 2):  # a second run: its links have tags of their own, away from the first run's idle threads
        for _ in repl.run(step_fn, repl.prepare_input(replay), steps=run * LIMITED_STEPS, actor_fn=actor_fn):
            pass
        runs.append(repl.last_run["actor_learner"])
    del model
    return repl.role, runs, refusal[0] if refusal else None


def test_with_the_peer_link_off_actors_and_learners_talk_over_gloo_and_the_limiter_stays_exact() -> None:
    results = run_replicas(gloo_job, 3, timeout_s=240, env=SHORT)
    (_, learner_runs, _), (_, first_runs, _), (_, second_runs, refusal) = results
    for learner, first, second in zip(learner_runs, first_runs, second_runs, strict=True):
        assert learner["transport"] == first["transport"] == second["transport"] == "gloo"
        assert learner["learner_steps"] == LIMITED_STEPS and learner["departed"] == {}, learner
        assert learner["outside_band"] == 0, learner
        assert first["wait_seconds"] + second["wait_seconds"] > 0, (first, second)  # credits held them back
    learner = learner_runs[0]
    assert learner["samples"] == LIMITED_STEPS * LIMITED_BATCH
    assert learner["samples_per_insert"] == pytest.approx(RATIO, rel=0.1), learner  # as over sockets
    assert refusal is not None and "carries its actor–learner links over Gloo" in refusal, refusal
    assert "REPLICATOR_PEER_LINK" in refusal


# -- add_batch(): a vectorized environment ----------------------------------------------------------------------------
ENVS, BATCH_CALLS, GAMMA = 3, 8, 0.5


def batched_actor(actor: rp.ActorContext) -> None:
    """Environment e at step t observes 100 e + t, gets reward e + t; episodes of 4 steps, environment 0's end in
    termination, the others' are cut."""
    for t in range(BATCH_CALLS):
        observation = torch.tensor([[100.0 * e + t] for e in range(ENVS)])
        ended = (t % 4) == 3
        actor.add_batch(observation=observation, action=torch.zeros(ENVS, 1),
                        reward=torch.tensor([float(e + t) for e in range(ENVS)]), next_observation=observation + 1,
                        terminated=[ended and e == 0 for e in range(ENVS)],
                        truncated=[ended and e != 0 for e in range(ENVS)])
    while actor.running:
        time.sleep(0.01)


def batched_job(n_step: int) -> tuple[str, dict[float, tuple[float, float, float]], dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=1)
    replay = rp.Replay(capacity=64, batch_size=32, samples_per_insert=None, min_size=ENVS * BATCH_CALLS,
                       n_step=n_step, discount=GAMMA, seed=1)
    with repl.scope():
        model = torch.nn.Linear(1, 1)
    seen: dict[float, tuple[float, float, float]] = {}

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        for row in range(len(batch.key)):
            seen[float(batch.observation[row, 0])] = (float(batch.reward[row]), float(batch.discount[row]),
                                                     float(batch.next_observation[row, 0]))

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=40, actor_fn=batched_actor):
        pass
    del model
    return repl.role, seen, repl.last_run["actor_learner"]


def expected_transitions(n_step: int) -> dict[float, tuple[float, float, float]]:
    """Each environment's N-step transitions, computed one environment at a time from the script."""
    expected = {}
    for e in range(ENVS):
        for t in range(BATCH_CALLS):
            end = (t // 4) * 4 + 3  # the episode's last step
            last = min(t + n_step - 1, end)
            reward = sum(GAMMA ** k * (e + t + k) for k in range(last - t + 1))
            terminated = last == end and e == 0
            discount = 0.0 if terminated else GAMMA ** (last - t + 1)
            expected[100.0 * e + t] = (reward, discount, 100.0 * e + last + 1)
    return expected


@pytest.mark.parametrize("n_step", [1, 3])
def test_add_batch_stores_each_environments_transitions(n_step: int) -> None:
    (_, seen, learner), (_, _, actor) = run_replicas(batched_job, 2, n_step, timeout_s=120, env=SHORT)
    expected = expected_transitions(n_step)
    assert sorted(seen) == sorted(expected)  # 40 batches of 32 from 24 items: every one drawn (p of a miss < 1e-100)
    for observation, values in expected.items():
        # Exactly: small integers and powers of 0.5, far below 2**24.
        assert seen[observation] == values, observation
    assert learner["inserts"] == ENVS * BATCH_CALLS and actor["env_steps"] == ENVS * BATCH_CALLS


# -- weights on their own link, copied only when pulled -------------------------------------------------------------
def pulls_job(update_period: int) -> tuple[str, dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=1)
    replay = rp.Replay(capacity=1000, batch_size=8, samples_per_insert=4.0, min_size=16, seed=2)
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        inputs = torch.cat([batch.observation, batch.action], dim=1)
        loss = (model(inputs).squeeze(1) - batch.reward).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=40, actor_fn=fast_actor, update_period=update_period):
        pass
    return repl.role, repl.last_run["actor_learner"]


def test_a_learner_copies_its_weights_only_for_pulls_and_at_most_once_a_step() -> None:
    (_, never), (_, actor) = run_replicas(pulls_job, 2, 10**9, timeout_s=120, env=SHORT)
    assert actor["pulls"] == 1  # the actor's first pull, before actor_fn
    assert never["weight_copies"] == 1  # the copy published for it at the start: none while nobody pulls
    (_, often), (_, actor) = run_replicas(pulls_job, 2, 2, timeout_s=120, env=SHORT)
    assert actor["pulls"] > 10
    assert 1 <= often["weight_copies"] <= often["learner_steps"] + 1  # one per publish point at most


# -- hostile peers at the learner's service ---------------------------------------------------------------------------
def hostile_actor(actor: rp.ActorContext) -> None:
    """Before acting: four connections to learner 0's insert link that break the rules."""
    store = exchange.store()  # where the actor–learner job keeps its links' records and token
    record = json.loads(store.get(f"{KEY}address/{exchange.Keys.insert_link(actor.run, 0)}").decode())
    address = (record["host"], record["port"])

    def raw() -> socket.socket:
        sock = socket.create_connection(address, timeout=10)
        return sock

    # A wrong token.
    with raw() as sock:
        sock.sendall(b"".join(frames.encode(frames.HELLO, (), 0, 0, frames.Limits(), extension=hello(
            b"x" * 32, 7, "intruder"))))
        sock.recv(1)  # the server closes it
    # Garbage instead of a frame.
    with raw() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
        sock.recv(1)
    # With the token, a frame whose payload is past the agreed bounds.
    oversize = connect(exchange.Keys.insert_link(actor.run, 0), rank=-1, role="oversize", timeout_s=10, store=store)
    header = frames.HEADER.pack(frames.MAGIC, frames.VERSION, exchange.CHUNK, 0, 0, 0, 1 << 40)
    oversize.sock.sendall(header)
    # With the token, half a frame, then it stops (closes mid-frame).
    halfway = connect(exchange.Keys.insert_link(actor.run, 0), rank=-1, role="halfway", timeout_s=10, store=store)
    header = frames.HEADER.pack(frames.MAGIC, frames.VERSION, exchange.CHUNK, 0, 0, 3, 1000)
    halfway.sock.sendall(header + b"\x01\x00")
    halfway.close()
    oversize.close()
    fast_actor(actor)


def hostile_job() -> tuple[str, list[str], dict[str, Any]]:
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("replicator.comm.peer_link").addHandler(Collect())
    repl = rp.Replicator(mode="actor_learner", actors=1)
    replay = rp.Replay(capacity=1000, batch_size=8, samples_per_insert=None, min_size=16, seed=3)
    with repl.scope():
        model = make_model()

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        pass

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=30, actor_fn=hostile_actor):
        pass
    del model
    return repl.role, messages, repl.last_run["actor_learner"]


def test_hostile_peers_are_dropped_by_name_and_the_learner_trains_on() -> None:
    (_, messages, learner), (_, _, actor) = run_replicas(hostile_job, 2, timeout_s=120, env=SHORT)
    assert learner["learner_steps"] == 30 and learner["departed"] == {}  # it went on, and lost no actor
    assert actor["transitions_sent"] > 0
    text = "\n".join(messages)
    assert "did not present the job's token" in text, text
    assert "not a frame of the peer link" in text, text
    assert "pid " in text and "past the agreed" in text and "(oversize)" in text, text
    assert "(halfway) closed its end of the link in the middle of a frame" in text, text


# -- an actor killed and restarted on its own rejoins the running job --------------------------------------------------
def rejoin_replay() -> rp.Replay:
    return rp.Replay(capacity=5000, batch_size=8, samples_per_insert=None, min_size=16, seed=5)


def joiner_main(started: float) -> None:
    """The restarted actor 1: a process of its own, outside the torch.distributed world (see rejoin_job); `started`:
    when its interpreter started, before it imported torch."""
    model = make_model()

    def actor_fn(actor: rp.ActorContext) -> None:
        while actor.running and actor.env_steps < 200:
            fast_actor_step(actor)
        actor.end_run("the restarted actor's inserts are in")
        while actor.running:
            time.sleep(0.01)

    figures = rp.join_actor(actor_fn, model, rejoin_replay(), actor=1, update_period=5)
    with open(os.environ["JOINER_RESULT"], "w") as file:
        json.dump({"started": started, **figures}, file)


def fast_actor_step(actor: rp.ActorContext) -> None:
    t = actor.env_steps % 10
    observation = np.array([t / 10, float(actor.actor_id)], dtype=np.float32)
    actor.add(observation=observation, action=np.array([0.5], dtype=np.float32), reward=float(t),
              next_observation=observation + np.float32(0.1), truncated=t == 9)


def rejoin_job(directory: str) -> tuple[str, dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=2)
    replay = rejoin_replay()
    with repl.scope():
        model = make_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    def actor_fn(actor: rp.ActorContext) -> None:
        if actor.actor_id == 1:  # adds a little, starts its replacement, and dies
            while actor.env_steps < 50:
                fast_actor_step(actor)
            here = os.path.dirname(os.path.abspath(__file__))
            path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
            env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            start = "import time; s = time.time(); import test_replay_stream as t; t.joiner_main(s)"
            subprocess.Popen([sys.executable, "-c", start],
                             env=env | {"PYTHONPATH": path, "JOINER_RESULT": os.path.join(directory, "joiner.json")},
                             start_new_session=True)
            with open(os.path.join(directory, "killed"), "w") as file:
                file.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        while actor.running:  # actor 0 feeds the learner throughout, slowly
            fast_actor_step(actor)
            time.sleep(0.002)

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        loss = model(torch.cat([batch.observation, batch.action], dim=1)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=10**6, actor_fn=actor_fn, update_period=5):
        pass
    return repl.role, repl.last_run["actor_learner"]


def test_an_actor_killed_and_restarted_on_its_own_rejoins_and_the_learner_never_stops(tmp_path: Any) -> None:
    with pytest.raises(ReplicaFailure) as failure:
        run_replicas(rejoin_job, 3, str(tmp_path), timeout_s=240, env=SHORT)
    assert [(e.rank, e.kind) for e in failure.value.errors] == [(2, "died")]  # the killed actor, nothing else
    (_, learner), (_, actor0) = failure.value.results[0], failure.value.results[1]
    joiner = json.loads((tmp_path / "joiner.json").read_text())
    # The learner never stopped: the restarted actor ended the run, after its own inserts.
    assert learner["ended"] == "actor 1 (rank 2) asked to end the run: the restarted actor's inserts are in"
    assert learner["departed"] == {} and actor0["env_steps"] > 0
    [rejoined] = learner["rejoined"]
    assert rejoined["actor"] == 1 and rejoined["first_insert_s"] is not None
    assert "its link closed" in rejoined["departed"]["why"]  # the death was its end of file, not a timeout
    assert learner["inserts_by_actor"][1] > 50 and joiner["env_steps"] >= 200 and joiner["transitions_sent"] > 0
    killed = float((tmp_path / "killed").read_text())
    print(f"death known {rejoined['departed']['at'] - killed:.3f} s after the kill; the restarted actor's first "
          f"insert counted {rejoined['first_insert_at'] - joiner['started']:.3f} s after its interpreter started "
          f"({joiner['seconds']:.1f} s in rp.join_actor)")


# -- every actor gone: the learners stop, naming them, once the grace for a restart has passed -----------------------


def orphaned_job() -> tuple[str, dict[str, Any]]:
    repl = rp.Replicator(mode="actor_learner", actors=2)
    # No limiter: the learners could sample the items they hold forever; they must notice that no actor is left.
    replay = rp.Replay(capacity=1000, batch_size=8, samples_per_insert=None, min_size=16, seed=6)
    with repl.scope():
        model = make_model()

    def actor_fn(actor: rp.ActorContext) -> None:
        while actor.counters()["learner_steps"] < 20 * (actor.actor_id + 1):  # the learners train, then it dies
            fast_actor_step(actor)
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        time.sleep(0.001)

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=10**9, actor_fn=actor_fn):
        pass
    del model
    return repl.role, repl.last_run["actor_learner"]


def test_when_every_actor_has_died_every_learner_stops_naming_them_after_the_grace(
        run_failing_fast: Callable[..., Any]) -> None:
    # Two learners, two actors, both killed while the learners train: before, the learners went on training on their
    # old items until the harness's timeout ended the test (a TimeoutError, not this ReplicaFailure).
    with pytest.raises(ReplicaFailure) as failure:
        run_failing_fast(orphaned_job, 4, timeout_s=180, collective_timeout_s=15)
    errors = {e.rank: e for e in failure.value.errors}
    assert errors[2].kind == errors[3].kind == "died", errors
    for rank in (0, 1):
        message = errors[rank].message
        assert errors[rank].kind != "died" and f"learner {rank} (rank {rank}) stops" in message, message
        assert "every actor has stopped" in message, message
        for name in ("actor 0 (rank 2) died", "actor 1 (rank 3) died"):
            assert name in message, message
        assert "its link closed" in message and "none was restarted within 5 s" in message, message
