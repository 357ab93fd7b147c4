"""Actor-learner on Pendulum-v1: D4PG through replicator's regime against TD3 and DDPG to SB3's recipe; replay speed.

Command (from the repository root; about 10-20 minutes on a small machine; figures go to
benchmarks/results/actor_learner.json):

    .venv/bin/python benchmarks/actor_learner.py                       # D4PG, TD3, DDPG, seeds 0 1 2, the replays
    .venv/bin/python benchmarks/actor_learner.py --algorithms d4pg td3 --seeds 0 --full-curve
    .venv/bin/python benchmarks/actor_learner.py --algorithms --replay-repeats 5   # the replay arm alone
    .venv/bin/python benchmarks/actor_learner.py --algorithms --replay-repeats 3 --pulls 85000 10000000  # + pulls

The library's arm, `d4pg`, runs examples/d4pg.py as its own job (1 learner + 2 actors + the
evaluator: 4 processes, as `replicator launch -n 4 examples/d4pg.py --actors 2 --learners 1
--stop-at-target` does) and reads the curve.json its evaluator and learner 0 write: env steps
and wall-clock seconds (since the evaluator started; evaluation runs beside the training, in its
own process) to the first evaluation at -200, the realised samples per insert against its
target, and the p95 policy lag against an actor's pull interval in learner steps. The seeds
run in turns (d4pg, td3, ddpg for seed 0, then seed 1, ...), so slow drifts of the machine's
load hit the arms alike; the D4PG/TD3 wall ratio is the median of the per-seed ratios. The
library uses 4 processes where the baselines use one: on a machine with fewer free cores they
share them.

The peers:

- Time to -200: a single-process off-policy loop written to the SB3 zoo's Pendulum-v1
  hyperparameters (gamma 0.98, 10,000 uniformly random steps before learning, then one
  gradient step of batch 256 per env step, Adam at 1e-3, Gaussian action noise of 0.1,
  [400, 300] networks, tau 0.005, a 200,000-transition buffer; TD3 adds twin critics, target
  policy smoothing 0.2 clipped at 0.5 and a policy update every 2 steps). Every --eval-every env
  steps the clock stops and 10 deterministic episodes (fixed start states, the same for every
  arm) give the mean evaluation return. Reported per seed: env steps and wall-clock seconds
  of training (evaluation excluded) to the first evaluation at -200 or better, and their median
  over the seeds. The SB3 zoo reports about -150 at 20,000 steps for both.
- Replay throughput: a numpy ring buffer of SB3's design (preallocated arrays, a write position
  and a `full` flag, uniform sampling with replacement, batches handed over as torch tensors):
  single-transition inserts per second and sampled transitions per second (batches of 256), as
  medians over --replay-repeats repetitions, on Pendulum-sized transitions. Against it, in turns:
  `rp_replay`, rp.Replay as a job uses it (`replay_job`: 1 learner + 1 actor, limiter off): an
  actor's `actor.add()` calls per second (and the CPU microseconds of its main thread per call),
  each staging a transition that is streamed to the learner's shard in chunks over the peer
  link, then the learner's batches of 256 through `repl.run` with a step_fn that does nothing
  (the step loop's own cost included), drawn once every insert is in; `rp_replay_limited`, the
  same with samples_per_insert 1 (min_size 1,000), actor and learner running together, held to
  the ratio by the limiter's credits (its realised samples per insert and the commits or samples
  outside the band, counted: 0); `socket_stream`, the same chunks over a Unix socket pair from one
  process into a numpy ring in another (the transport alone, a floor for the stream's cost);
  `torchrl_extend`, torchrl's `ReplayBuffer.extend` in one process with chunks of 1,024 (the
  buffer PyTorch RL users pick; a ceiling; skipped when torchrl is not installed).
- Weight pulls (`--pulls 85000 10000000`, off by default): learner steps per second, SGD on an
  MLP of that many parameters (batch 64), with 2 actors that add a transition every millisecond
  and pull every 10 env steps, against the same actors not pulling, in turns; the paired ratio,
  the p95 of the pulls' latency (request to reply), the learner's weight copies and the CPU of
  the three processes per learner step (`--pull-repeats N` pairs of arms, default as the replay's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from _harness import Spread, add_json_argument, machine, machine_line, write_json
from torch import nn

import replicator as rp
from replicator.testing import run_replicas

ENV = "Pendulum-v1"
TARGET_RETURN = -200.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--algorithms", nargs="*", default=["d4pg", "td3", "ddpg"], choices=["d4pg", "td3", "ddpg"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--env-steps", type=int, default=20_000)
    parser.add_argument("--eval-every", type=int, default=1_000)
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--learning-starts", type=int, default=None,
                        help="random env steps before learning (default: the recipe's 10,000)")
    parser.add_argument("--full-curve", action="store_true", help="train all --env-steps, not only until -200")
    parser.add_argument("--d4pg-args", default="",
                        help="more arguments for examples/d4pg.py (e.g. '--steps 60 --min-replay 200' for a short run)")
    parser.add_argument("--replay-repeats", type=int, default=3, help="repetitions of the replay arm (0: skip it)")
    parser.add_argument("--replay-capacity", type=int, default=1_000_000)
    parser.add_argument("--replay-inserts", type=int, default=50_000)
    parser.add_argument("--replay-batches", type=int, default=2_000, help="batches of 256 per repetition")
    parser.add_argument("--job-replay-inserts", type=int, default=200_000,
                        help="inserts per repetition for rp.Replay in a job (streamed to the learner in chunks)")
    parser.add_argument("--pulls", nargs="*", type=int, default=[],
                        help="model sizes (parameters) of the pulls part, e.g. 85000 10000000: learner steps/s with 2 "
                             "actors pulling every 10 env steps against none (none given: skip it)")
    parser.add_argument("--pull-seconds", type=float, default=8.0, help="seconds of learner steps per pulls arm")
    parser.add_argument("--pull-repeats", type=int, default=None,
                        help="repetitions of each pulls arm (default: --replay-repeats, at least 1)")
    add_json_argument(parser, "actor_learner")
    return parser.parse_args()


# -- SB3's replay design: a preallocated numpy ring ---------------------------------------------


class RingBuffer:
    """Transitions in preallocated numpy arrays; `position` wraps around and `full` says the arrays are all valid."""

    def __init__(self, capacity: int, observation_size: int, action_size: int, seed: int = 0) -> None:
        self.capacity = capacity
        self.observation = np.zeros((capacity, observation_size), np.float32)
        self.next_observation = np.zeros((capacity, observation_size), np.float32)
        self.action = np.zeros((capacity, action_size), np.float32)
        self.reward = np.zeros(capacity, np.float32)
        self.terminated = np.zeros(capacity, np.float32)  # not truncation: a time limit keeps bootstrapping
        self.position = 0
        self.full = False
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.capacity if self.full else self.position

    def add(self, observation: np.ndarray, action: np.ndarray, reward: float, next_observation: np.ndarray,
            terminated: bool) -> None:
        i = self.position
        self.observation[i] = observation
        self.action[i] = action
        self.reward[i] = reward
        self.next_observation[i] = next_observation
        self.terminated[i] = terminated
        self.position = (i + 1) % self.capacity
        self.full = self.full or self.position == 0

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        index = self.rng.integers(0, len(self), size=batch_size)
        return tuple(torch.from_numpy(a[index]) for a in (self.observation, self.action, self.reward,
                                                          self.next_observation, self.terminated))


# -- the SB3 zoo's Pendulum-v1 recipe -----------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """TD3 by default; DDPG is one critic, no target smoothing and a policy update every step."""

    gamma: float = 0.98
    buffer_size: int = 200_000
    learning_starts: int = 10_000
    action_noise: float = 0.1  # std of the Gaussian added to actions in [-1, 1]
    learning_rate: float = 1e-3
    batch_size: int = 256
    tau: float = 0.005
    hidden: tuple[int, int] = (400, 300)
    critics: int = 2
    policy_delay: int = 2
    target_noise: float = 0.2
    target_noise_clip: float = 0.5


RECIPES = {"td3": Recipe(), "ddpg": Recipe(critics=1, policy_delay=1, target_noise=0.0)}


def mlp(inputs: int, hidden: tuple[int, int], outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden[0]), nn.ReLU(), nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
                         nn.Linear(hidden[1], outputs))


class Critics(nn.Module):
    """One Q network per critic on (observation, action); TD3 takes the smaller of its two."""

    def __init__(self, observation_size: int, action_size: int, recipe: Recipe) -> None:
        super().__init__()
        self.nets = nn.ModuleList(mlp(observation_size + action_size, recipe.hidden, 1)
                                  for _ in range(recipe.critics))

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> list[torch.Tensor]:
        joined = torch.cat([observation, action], dim=-1)
        return [net(joined).squeeze(-1) for net in self.nets]


def make_env() -> gymnasium.Env:
    bound = np.ones(1, np.float32)
    return gymnasium.wrappers.RescaleAction(gymnasium.make(ENV), -bound, bound)


@torch.no_grad()
def evaluate(policy: nn.Module, episodes: int, seed: int) -> list[float]:
    """Returns of `episodes` deterministic episodes from fixed start states, their envs stepped side by side."""
    envs = [make_env() for _ in range(episodes)]
    observations = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)])
    returns = np.zeros(episodes)
    done = np.zeros(episodes, bool)
    while not done.all():
        actions = policy(torch.as_tensor(observations)).numpy()
        for i in np.flatnonzero(~done):
            observations[i], reward, terminated, truncated, _ = envs[i].step(actions[i])
            returns[i] += reward
            done[i] = terminated or truncated
    return returns.tolist()


def evaluation_seed(seed: int) -> int:
    """The evaluation episodes' first seed: examples/d4pg.py uses the same, so both face the same start states."""
    return 10_000 + seed * 100


def train(recipe: Recipe, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the recipe: its learning curve, and the env steps and training seconds to TARGET_RETURN."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    env = make_env()
    observation_size = gymnasium.spaces.flatdim(env.observation_space)
    action_size = gymnasium.spaces.flatdim(env.action_space)
    policy = nn.Sequential(mlp(observation_size, recipe.hidden, action_size), nn.Tanh())
    critics = Critics(observation_size, action_size, recipe)
    target_policy, target_critics = _frozen_copy(policy), _frozen_copy(critics)
    policy_opt = torch.optim.Adam(policy.parameters(), lr=recipe.learning_rate)
    critic_opt = torch.optim.Adam(critics.parameters(), lr=recipe.learning_rate)
    buffer = RingBuffer(recipe.buffer_size, observation_size, action_size, seed)

    def learn(step: int) -> None:
        observation, action, reward, next_observation, terminated = buffer.sample(recipe.batch_size)
        with torch.no_grad():
            next_action = target_policy(next_observation)
            if recipe.target_noise:  # TD3's target policy smoothing
                noise = (torch.randn_like(next_action) * recipe.target_noise).clamp(
                    -recipe.target_noise_clip, recipe.target_noise_clip)
                next_action = (next_action + noise).clamp(-1.0, 1.0)
            next_q = torch.min(torch.stack(target_critics(next_observation, next_action)), dim=0).values
            target = reward + (1.0 - terminated) * recipe.gamma * next_q
        critic_loss = torch.stack([F.mse_loss(q, target) for q in critics(observation, action)]).sum()
        critic_opt.zero_grad()
        critic_loss.backward()
        critic_opt.step()
        if step % recipe.policy_delay == 0:
            policy_loss = -critics(observation, policy(observation))[0].mean()
            policy_opt.zero_grad()
            policy_loss.backward()
            policy_opt.step()
            with torch.no_grad():
                for online, slow in ((policy, target_policy), (critics, target_critics)):
                    for p, p_target in zip(online.parameters(), slow.parameters()):
                        p_target.lerp_(p, recipe.tau)

    curve: list[dict[str, float]] = []
    reached: dict[str, float] | None = None
    train_seconds, started = 0.0, time.perf_counter()
    observation, _ = env.reset(seed=seed * 1_000 + 1)
    for env_step in range(1, args.env_steps + 1):
        if env_step <= recipe.learning_starts:
            action = rng.uniform(-1.0, 1.0, action_size).astype(np.float32)
        else:
            with torch.no_grad():
                action = policy(torch.as_tensor(observation)).numpy()
            action = np.clip(action + rng.normal(0.0, recipe.action_noise, action_size), -1.0, 1.0).astype(np.float32)
        next_observation, reward, terminated, truncated, _ = env.step(action)
        buffer.add(observation, action, float(reward), next_observation, terminated)
        observation = env.reset()[0] if terminated or truncated else next_observation
        if env_step > recipe.learning_starts:
            learn(env_step - recipe.learning_starts)
        if env_step % args.eval_every == 0:
            train_seconds += time.perf_counter() - started
            returns = evaluate(policy, args.eval_episodes, evaluation_seed(seed))
            point = {"env_steps": env_step, "seconds": train_seconds, "mean_return": float(np.mean(returns)),
                     "std_return": float(np.std(returns))}
            curve.append(point)
            print(f"  {env_step:6d} env steps | {train_seconds:6.1f} s | return {point['mean_return']:7.1f} "
                  f"+- {point['std_return']:5.1f}", flush=True)
            if reached is None and point["mean_return"] >= TARGET_RETURN:
                reached = point
                if not args.full_curve:
                    break
            started = time.perf_counter()
    return {"seed": seed, "reached": reached, "curve": curve}


def _frozen_copy(module: nn.Module) -> nn.Module:
    import copy

    clone = copy.deepcopy(module)
    clone.requires_grad_(False)
    return clone


# -- the library: examples/d4pg.py as a job ------------------------------------------------------

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "d4pg.py")


def train_d4pg_library(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of examples/d4pg.py (1 learner + 2 actors + the evaluator) to -200; its curve and counters."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, EXAMPLE, "--actors", "2", "--learners", "1", "--seed", str(seed), "--out", out,
                   "--eval-every", str(args.eval_every), "--eval-episodes", str(args.eval_episodes),
                   *([] if args.full_curve else ["--stop-at-target"]), *args.d4pg_args.split()]
        environment = dict(os.environ, REPLICATOR_PROGRESS="0")
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=environment)
        launched = time.perf_counter() - started
        if result.returncode:
            raise RuntimeError(f"examples/d4pg.py failed ({' '.join(command)}):\n{result.stdout}{result.stderr}")
        with open(os.path.join(out, "curve.json")) as handle:
            curve = json.load(handle)
    for line in result.stdout.splitlines():
        if line.startswith((" ", "learners:")) or line[:1].isdigit():
            print(f"  {line}", flush=True)
    figures = curve["actor_learner"]
    interval = figures["pull_interval_learner_steps"]
    lag_p95 = figures["policy_lag"]["p95"]
    points = [{"env_steps": p["env_steps"], "seconds": p["seconds"], "mean_return": p["mean_return"],
               "std_return": p["std_return"], "learner_steps": p["learner_steps"]} for p in curve["points"]]
    reached = curve["reached"]
    return {"seed": seed, "reached": None if reached is None else {k: reached[k] for k in points[0]},
            "curve": points, "launch_seconds": launched, "samples_per_insert": figures["samples_per_insert"],
            "target_samples_per_insert": figures["target_samples_per_insert"], "policy_lag": figures["policy_lag"],
            "pull_interval_learner_steps": interval,
            "policy_lag_p95_intervals": None if lag_p95 is None or not interval else lag_p95 / interval,
            "learner_steps": figures["learner_steps"], "env_steps": figures["env_steps"]}


# -- replay throughput --------------------------------------------------------------------------


class Replay(Protocol):
    def add(self, observation: np.ndarray, action: np.ndarray, reward: float, next_observation: np.ndarray,
            terminated: bool) -> None: ...

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]: ...


def replay_throughput(make: Callable[[], Replay], inserts: int, batches: int, batch_size: int = 256,
                      observation_size: int = 3, action_size: int = 1) -> dict[str, float]:
    """Single-transition inserts per second, then sampled transitions per second, into/from a fresh replay."""
    rng = np.random.default_rng(0)
    observations = rng.standard_normal((inserts, observation_size), dtype=np.float32)
    actions = rng.uniform(-1, 1, (inserts, action_size)).astype(np.float32)
    replay = make()
    started = time.perf_counter()
    for i in range(inserts - 1):
        replay.add(observations[i], actions[i], -1.0, observations[i + 1], False)
    insert_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(batches):
        replay.sample(batch_size)
    sample_seconds = time.perf_counter() - started
    return {"inserts_per_s": (inserts - 1) / insert_seconds, "samples_per_s": batches * batch_size / sample_seconds}


def replay_job(inserts: int, batches: int, capacity: int, limited: bool = False) -> dict[str, float]:
    """rp.Replay in a job of 1 learner + 1 actor: the actor's add() calls per second (and CPU microseconds of its
    main thread per call), the learner's sampled transitions per second through repl.run with a step_fn that does
    nothing. Limiter off: the learner draws once every insert is in. `limited`: samples_per_insert 1 (min_size
    1,000, tolerance 0.1): learner and actor run together, held to the ratio by the limiter's credits."""
    torch.set_num_threads(1)
    repl = rp.Replicator(mode=rp.ActorLearner(actors=1))
    min_size = min(1_000, inserts - 1) if limited else inserts - 1
    replay = rp.Replay(capacity=capacity, batch_size=256, samples_per_insert=1.0 if limited else None,
                       tolerance=0.1, min_size=min_size, n_step=1, seed=0)
    with repl.scope():
        nn.Linear(3, 1)  # the weights actors pull: a token model
    rng = np.random.default_rng(0)
    observations = rng.standard_normal((inserts, 3), dtype=np.float32)
    actions = rng.uniform(-1, 1, (inserts, 1)).astype(np.float32)
    figures: dict[str, float] = {}

    def actor_fn(actor: rp.ActorContext) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        done = 0
        while (actor.running if limited else done < inserts - 1):  # limited: until the learners finish
            i = done % (inserts - 1)
            actor.add(observation=observations[i], action=actions[i], reward=-1.0,
                      next_observation=observations[i + 1])
            done += 1
        figures["inserts_per_s"] = done / (time.perf_counter() - started)
        figures["add_cpu_us"] = (time.thread_time() - cpu) / max(done, 1) * 1e6
        figures["wait_seconds"] = actor.figures["wait_seconds"]
        while actor.running:
            time.sleep(0.01)

    stamps: list[float] = []

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        stamps.append(time.perf_counter())

    steps = max(1, (inserts - 1 - min_size) // 256) if limited else batches
    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=steps, actor_fn=actor_fn, update_period=10**9):
        pass
    if len(stamps) > 1:
        figures["samples_per_s"] = (len(stamps) - 1) * 256 / (stamps[-1] - stamps[0])
    if repl.role == "learner":
        run = repl.last_run["actor_learner"]
        figures |= {"samples_per_insert": run["samples_per_insert"] or 0.0, "outside_band": run["outside_band"]}
    return figures


def socket_stream(inserts: int, rows: int = 1024) -> dict[str, float]:
    """The transport alone: the same chunks (Pendulum-sized transitions, 36 bytes, `rows` a chunk) from one process
    to another over a Unix socket pair, received with recv_into and copied into a preallocated numpy ring."""
    row_bytes = 2 * 3 * 4 + 1 * 4 + 8
    chunk = np.random.default_rng(0).integers(0, 255, rows * row_bytes, dtype=np.uint8)
    chunks = max(inserts // rows, 1)
    sender, receiver = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the sending process
        receiver.close()
        try:
            for _ in range(chunks):
                sender.sendall(chunk)
        finally:
            os._exit(0)
    sender.close()
    ring = np.empty((capacity_rows := max(rows * 64, inserts), row_bytes), dtype=np.uint8)
    buffer = np.empty(rows * row_bytes, dtype=np.uint8)
    view = memoryview(buffer)
    started, position = time.perf_counter(), 0
    for _ in range(chunks):
        filled = 0
        while filled < buffer.nbytes:
            filled += receiver.recv_into(view[filled:])
        stop = position + rows
        if stop > capacity_rows:
            position, stop = 0, rows
        ring[position:stop] = buffer.reshape(rows, row_bytes)
        position = stop
    seconds = time.perf_counter() - started
    os.waitpid(pid, 0)
    receiver.close()
    return {"inserts_per_s": chunks * rows / seconds}


def torchrl_extend(inserts: int, rows: int = 1024) -> dict[str, float] | None:
    """torchrl's ReplayBuffer.extend in one process, chunks of `rows` Pendulum-sized transitions (None: no torchrl)."""
    try:
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer
    except ImportError:
        return None
    buffer = ReplayBuffer(storage=LazyTensorStorage(max(inserts, rows)))
    data = TensorDict({"observation": torch.randn(rows, 3), "action": torch.rand(rows, 1),
                       "reward": torch.randn(rows), "discount": torch.ones(rows),
                       "next_observation": torch.randn(rows, 3)}, batch_size=[rows])
    chunks = max(inserts // rows, 1)
    started = time.perf_counter()
    for _ in range(chunks):
        buffer.extend(data)
    return {"inserts_per_s": chunks * rows / (time.perf_counter() - started)}


def pulls_model(parameters: int) -> nn.Module:
    """An MLP 8 -> H -> H -> 1 with about `parameters` parameters."""
    hidden = int((-(8 + 3) + ((8 + 3) ** 2 + 4 * max(parameters - 1, 1)) ** 0.5) / 2)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def pull_steps(parameters: int, seconds: float) -> int:
    """Learner steps that take about `seconds` for this model size, timed here on three steps."""
    torch.set_num_threads(1)
    model = pulls_model(parameters)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch = torch.zeros(64, 8)
    started = time.perf_counter()
    for _ in range(3):
        loss = model(batch).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return max(10, int(seconds / ((time.perf_counter() - started) / 3)))


def pulls_job(parameters: int, pulling: bool, steps: int) -> dict[str, Any]:
    """1 learner + 2 actors: the learner takes `steps` SGD steps (batch 64) on the model; each actor adds a
    transition every millisecond and, when `pulling`, pulls the weights every 10 env steps (in the background). The
    learner's steps per second; the actors' pull latencies (request to reply)."""
    torch.set_num_threads(1)
    repl = rp.Replicator(mode=rp.ActorLearner(actors=2))
    replay = rp.Replay(capacity=10_000, batch_size=64, samples_per_insert=None, min_size=64, seed=0)
    with repl.scope():
        model = pulls_model(parameters)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
    figures: dict[str, Any] = {}

    def actor_fn(actor: rp.ActorContext) -> None:
        observation = np.zeros(8, dtype=np.float32)
        action = np.zeros(1, dtype=np.float32)
        while actor.running:
            actor.add(observation=observation, action=action, reward=0.0, next_observation=observation)
            time.sleep(0.001)
        figures["pull_latencies"] = actor.pull_latencies()[1:]  # the first, at start, is not one of the pulls
        figures["pull_seconds"] = actor.figures["pull_seconds"]

    stamps: list[float] = []

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> None:
        loss = model(batch.observation).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stamps.append(time.perf_counter())

    cpu = time.process_time()
    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=steps, actor_fn=actor_fn,
                      update_period=10 if pulling else 10**9):
        pass
    figures["cpu_s"] = time.process_time() - cpu  # this process's, every thread's
    if repl.role == "learner":
        skip = min(5, len(stamps) // 4)  # the first steps overlap the actors' start
        figures["steps_per_s"] = (len(stamps) - 1 - skip) / (stamps[-1] - stamps[skip])
        figures["weight_copies"] = repl.last_run["actor_learner"]["weight_copies"]
    return figures


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core each, as examples/d4pg.py's learner
    header = machine()
    print(machine_line(header))
    report: dict[str, Any] = {"env": ENV, "target_return": TARGET_RETURN, "env_steps": args.env_steps,
                              "eval_every": args.eval_every, "eval_episodes": args.eval_episodes}

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.algorithms}
    for seed in args.seeds:  # seed by seed, the algorithms in turns: slow drifts of the load hit them alike
        for name in args.algorithms:
            print(f"{name} seed {seed}", flush=True)
            if name == "d4pg":
                runs[name].append(train_d4pg_library(seed, args))
                continue
            recipe = RECIPES[name]
            if args.learning_starts is not None:
                recipe = dataclasses.replace(recipe, learning_starts=args.learning_starts)
            runs[name].append(train(recipe, seed, args))
    for name, results in runs.items():
        reached = [r["reached"] for r in results]
        summary: dict[str, Any] = {"runs": results, "reached": sum(r is not None for r in reached)}
        if name in RECIPES:
            summary["recipe"] = asdict(RECIPES[name]) | {"learning_starts": args.learning_starts
                                                         or RECIPES[name].learning_starts}
        if all(r is not None for r in reached):
            summary["median_env_steps"] = statistics.median(r["env_steps"] for r in reached)
            summary["median_seconds"] = statistics.median(r["seconds"] for r in reached)
        report[name] = summary
        steps = ", ".join("-" if r is None else f"{r['env_steps']}" for r in reached)
        seconds = ", ".join("-" if r is None else f"{r['seconds']:.1f}" for r in reached)
        print(f"{name}: env steps to {TARGET_RETURN:g} per seed [{steps}], training seconds [{seconds}]"
              + (f"; median {summary['median_env_steps']:g} steps, {summary['median_seconds']:.1f} s"
                 if "median_seconds" in summary else ""))

    if "d4pg" in runs:
        report["d4pg_targets"] = library_targets(runs, report)

    if args.replay_repeats:
        figures = [replay_throughput(lambda: RingBuffer(args.replay_capacity, 3, 1), args.replay_inserts,
                                     args.replay_batches) for _ in range(args.replay_repeats)]
        inserts = Spread.of([f["inserts_per_s"] for f in figures])
        samples = Spread.of([f["samples_per_s"] for f in figures])
        report["replay"] = {"ring_buffer": {"inserts_per_s": asdict(inserts), "samples_per_s": asdict(samples)},
                            "capacity": args.replay_capacity, "batch_size": 256}
        print(f"ring buffer (numpy, SB3's design), capacity {args.replay_capacity:,}: "
              f"{inserts.median:,.0f} inserts/s ({inserts.min:,.0f}-{inserts.max:,.0f}), "
              f"{samples.median:,.0f} sampled transitions/s ({samples.min:,.0f}-{samples.max:,.0f})")
        arms: dict[str, list[dict[str, float]]] = {"rp_replay": [], "rp_replay_limited": [], "socket_stream": [],
                                                   "torchrl_extend": []}
        for _ in range(args.replay_repeats):  # the arms in turns
            for limited, name in ((False, "rp_replay"), (True, "rp_replay_limited")):
                learner, actor = run_replicas(replay_job, 2, args.job_replay_inserts, args.replay_batches,
                                              args.replay_capacity, limited, timeout_s=600,
                                              env={"REPLICATOR_PROGRESS": "0"})
                arms[name].append(actor | learner)
            arms["socket_stream"].append(socket_stream(args.job_replay_inserts))
            ceiling = torchrl_extend(args.job_replay_inserts)
            if ceiling is not None:
                arms["torchrl_extend"].append(ceiling)
        measured = {"rp_replay": "actor.add() across processes, streamed in chunks over the peer link, limiter off; "
                                 "the learner's batches through repl.run once every insert is in",
                    "rp_replay_limited": "the same with samples_per_insert=1: actor and learner together, held to "
                                         "the ratio by the limiter's credits",
                    "socket_stream": "the same chunks over a Unix socket pair into a numpy ring (transport alone)",
                    "torchrl_extend": "torchrl ReplayBuffer.extend, chunks of 1024, one process (a ceiling)"}
        for name, runs in arms.items():
            if not runs:
                print(f"{name}: skipped (torchrl is not installed)" if name == "torchrl_extend" else f"{name}: none")
                continue
            entry: dict[str, Any] = {"measured": measured[name]}
            for key in ("inserts_per_s", "samples_per_s", "add_cpu_us", "samples_per_insert", "outside_band"):
                if all(key in run for run in runs):
                    entry[key] = asdict(Spread.of([float(run[key]) for run in runs]))
            report["replay"][name] = entry
            line = ", ".join(f"{key} {entry[key]['median']:,.2f} ({entry[key]['min']:,.2f}-{entry[key]['max']:,.2f})"
                             for key in entry if key != "measured")
            label = ("rp.Replay (1 learner + 1 actor; inserts through actor.add() streamed over the peer link, "
                     "samples through repl.run)" if name == "rp_replay" else name)
            print(f"{label}: {line}", flush=True)
    if args.pulls:
        report["pulls"] = pulls_part(args)
    write_json(args.json, report, header)


def pulls_part(args: argparse.Namespace) -> dict[str, Any]:
    """Learner steps/s with 2 actors pulling every 10 env steps against none, per model size, arms in turns."""
    part: dict[str, Any] = {}
    for parameters in args.pulls:
        steps = pull_steps(parameters, args.pull_seconds)
        rates: dict[bool, list[float]] = {False: [], True: []}
        cpu_ms: dict[bool, list[float]] = {False: [], True: []}  # per learner step, the 3 processes together
        latencies: list[float] = []
        copies: list[int] = []
        repeats = args.pull_repeats if args.pull_repeats is not None else max(args.replay_repeats, 1)
        for _ in range(repeats):
            for pulling in (False, True):
                learner, *actors = run_replicas(pulls_job, 3, parameters, pulling, steps, timeout_s=600,
                                                env={"REPLICATOR_PROGRESS": "0"})
                rates[pulling].append(learner["steps_per_s"])
                cpu_ms[pulling].append(1e3 * sum(f["cpu_s"] for f in (learner, *actors)) / steps)
                if pulling:
                    latencies += [x for actor in actors for x in actor["pull_latencies"]]
                    copies.append(learner["weight_copies"])
        ratios = [p / n for p, n in zip(rates[True], rates[False], strict=True)]
        p95 = float(np.percentile(latencies, 95)) if latencies else None
        part[str(parameters)] = {"steps": steps, "steps_per_s_without": rates[False], "steps_per_s_with": rates[True],
                                 "paired_ratio": statistics.median(ratios), "pull_latency_p95_s": p95,
                                 "pulls": len(latencies), "weight_copies": copies,
                                 "cpu_ms_per_step_without": cpu_ms[False], "cpu_ms_per_step_with": cpu_ms[True]}
        print(f"pulls, {parameters:,} parameters: learner steps/s with 2 actors pulling every 10 env steps / none = "
              f"{statistics.median(ratios):.3f} (per repetition {', '.join(f'{r:.3f}' for r in ratios)}); "
              f"{statistics.median(rates[True]):.1f} against {statistics.median(rates[False]):.1f} steps/s; "
              f"p95 pull latency {p95 * 1e3 if p95 is not None else float('nan'):.2f} ms over {len(latencies)} "
              f"pulls; weight copies {copies}; CPU ms per learner step, 3 processes: "
              f"{statistics.median(cpu_ms[True]):.2f} against {statistics.median(cpu_ms[False]):.2f}", flush=True)
    return part


def library_targets(runs: dict[str, list[dict[str, Any]]], report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for the library's arm, each with its figure and whether it is met."""
    library = runs["d4pg"]
    targets: dict[str, Any] = {}
    steps = report["d4pg"].get("median_env_steps")
    targets["env_steps_to_target"] = {"median": steps, "limit": 20_000, "met": steps is not None and steps <= 20_000}
    if "td3" in runs:
        ratios = [mine["reached"]["seconds"] / peer["reached"]["seconds"]
                  for mine, peer in zip(library, runs["td3"], strict=True) if mine["reached"] and peer["reached"]]
        ratio = statistics.median(ratios) if len(ratios) == len(library) else None
        targets["wall_ratio_to_td3"] = {"per_seed": ratios, "median": ratio, "limit": 0.8,
                                        "met": ratio is not None and ratio <= 0.8}
    deviations = [abs(r["samples_per_insert"] / r["target_samples_per_insert"] - 1) for r in library
                  if r["samples_per_insert"] and r["target_samples_per_insert"]]
    targets["samples_per_insert"] = {"realised": [r["samples_per_insert"] for r in library],
                                     "target": library[0]["target_samples_per_insert"], "limit": "within 10%",
                                     "met": len(deviations) == len(library) and max(deviations) <= 0.1}
    lags = [r["policy_lag_p95_intervals"] for r in library]
    targets["policy_lag_p95"] = {"learner_steps": [r["policy_lag"]["p95"] for r in library], "pull_intervals": lags,
                                 "limit": "2 pull intervals", "met": all(v is not None and v <= 2 for v in lags)}
    for name, target in targets.items():
        figure = {key: value for key, value in target.items() if key not in ("met",)}
        print(f"d4pg target {name}: {'met' if target['met'] else 'NOT met'} {figure}", flush=True)
    return targets


if __name__ == "__main__":
    main()
