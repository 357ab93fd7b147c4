"""D4PG (arXiv 1804.08617) on gymnasium's Pendulum-v1: a deterministic actor, a distributional critic, N-step returns.

    python examples/d4pg.py                         # 1 learner, 2 actors, the evaluator: 4 processes
    replicator launch -n 4 examples/d4pg.py         # the same job, started by the launcher (or torchrun)
    python examples/d4pg.py --learners 2 --seed 3 --out runs/d4pg-3   # 2 learners, a synchronous replica group
    python examples/d4pg.py --prioritized           # replay sampled by |TD error|
    python examples/d4pg.py --env dmc:cartpole-swingup --v-min -150 --v-max 150   # pip install -e '.[dmc]' first

D4PG is DDPG with four changes: the critic predicts a *distribution* of returns (51 atoms
on a fixed support, trained with a cross-entropy against the projected Bellman target),
N-step returns, many actors feeding one replay, and (optionally) prioritized replay. It runs
on replicator's actor-learner regime (docs/concepts/asynchronous.md), one process per role: actors
step an environment with the policy plus Gaussian noise and `actor.add()` each step (the
library assembles N-step transitions, sends them to a learner's replay shard, holds the
actors back when they run ahead of the samples-per-insert rate limiter, and pulls the
learners' newest weights every --update-period steps); the learners sample batches from
their shards and update the critic, then the policy along the critic's slope in the action,
their gradients averaged as in any synchronous replica group; the evaluator runs
deterministic episodes of the newest policy every --eval-every env steps. The evaluator
prints the learning curve and writes it, as JSON and as a PNG against env steps and
wall-clock seconds, to --out; learner 0 adds the run's counters (realised samples per insert,
policy lag) to the JSON. Run plainly, the script starts its own job on this machine.

Hyperparameters, and why (Pendulum-v1: 200-step episodes, rewards in [-16.3, 0], a 1-d torque;
the target is a mean evaluation return of -200 within 20,000 env steps; figures below are env
steps to -200 with seeds 0, 1, 2 and the held-out seed 3, 10 deterministic evaluation episodes
every 1,000 env steps; tuned with one actor taking turns with the learner in one process, before the
library's regime existed):
- samples per insert 128 with batch 256, after 1,000 warm-up transitions: a learner step per
  2 env steps. It got there at 3,000 / 3,000 / 4,000 env steps (1,000-1,500 learner steps), and 3,000
  for seed 3. Acme's 32 (a step per 8 env steps) needs fewer learner steps when it works
  (7,000 / 8,000 / 6,000 env steps, 625-875 learner steps), but seed 3 hovered at -205 from 8,000 to
  18,000 env steps: with 2,400 learner steps in 20,000 env steps it has no margin. SB3's recipe
  takes a step per env step (256); half of that is plenty for N-step distributional targets.
- learning rate 1e-3 for both networks, Adam (Acme's 1e-4 suits the Control Suite's million-step runs).
- a penalty of 1e-3 x the policy's squared pre-tanh output: tanh's gradient vanishes when it
  saturates, and without the penalty seed 0 pushed full torque everywhere by 1,000 learner steps
  and stayed so (-361 for the rest of the 20,000 steps; seed 2 too, at a policy lr of 1e-4).
- N = 5 step returns, discount 0.99; the support [-1000, 0]: a reward is never positive, and
  100 steps (1 / (1 - 0.99)) of the worst hanging-down cost (about -10 a step) is -1000;
  returns beyond it are clipped onto the last atom, which only matters early in training.
- target networks by Polyak averaging (tau 0.005); exploration noise sigma 0.2 (actions in [-1, 1];
  0.3, Acme's, saturated the policy of seed 0 within 500 learner steps before the penalty existed).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import replicator as rp

# -- arguments ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--actors", type=int, default=2, help="actor processes")
    parser.add_argument("--learners", type=int, default=None,
                        help="learner processes, a synchronous replica group (default: 1 when run plainly; under a "
                             "launcher, the processes that are not actors or the evaluator)")
    parser.add_argument("--env", default="Pendulum-v1", help="a gymnasium id, or dmc:DOMAIN-TASK (dm-control)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=9_500,
                        help="learner steps; env steps = min-replay + steps * batch-size / samples-per-insert")
    parser.add_argument("--out", default="runs/d4pg", help="directory for the learning curve (JSON and PNG)")
    # the learner
    parser.add_argument("--batch-size", type=int, default=256, help="global: split across the learners")
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    parser.add_argument("--policy-lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=256, help="width of both networks' two hidden layers")
    parser.add_argument("--atoms", type=int, default=51)
    parser.add_argument("--v-min", type=float, default=-1000.0)
    parser.add_argument("--v-max", type=float, default=0.0)
    parser.add_argument("--discount", type=float, default=0.99)
    parser.add_argument("--n-step", type=int, default=5)
    parser.add_argument("--preactivation-penalty", type=float, default=1e-3,
                        help="weight of the policy's squared pre-tanh output in its loss: keeps tanh unsaturated")
    parser.add_argument("--tau", type=float, default=0.005, help="Polyak averaging rate of the target networks")
    # the replay
    parser.add_argument("--replay-capacity", type=int, default=1_000_000)
    parser.add_argument("--min-replay", type=int, default=1_000, help="transitions in before learning starts")
    parser.add_argument("--samples-per-insert", type=float, default=128.0)
    parser.add_argument("--prioritized", action="store_true", help="sample in proportion to |TD error| ** 0.6")
    parser.add_argument("--priority-exponent", type=float, default=0.6)
    parser.add_argument("--importance-exponent", type=float, default=0.4)
    # the actors and the evaluator
    parser.add_argument("--sigma", type=float, default=0.2, help="exploration noise, in units of half the action range")
    parser.add_argument("--update-period", type=int, default=100,
                        help="actors pull the learners' weights every this many of their env steps")
    parser.add_argument("--eval-every", type=int, default=1_000, help="env steps (all actors') between evaluations")
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--target-return", type=float, default=-200.0, help="the curve reports when it gets there")
    parser.add_argument("--stop-at-target", action="store_true",
                        help="the evaluator ends the run at the first evaluation there")
    return parser.parse_args(argv)


# -- environments -------------------------------------------------------------------------------


def make_env(name: str) -> gymnasium.Env:
    """`name`'s environment with actions rescaled to [-1, 1], so the policy's tanh covers them whatever the task."""
    if name.startswith("dmc:"):
        env: gymnasium.Env = ControlSuiteEnv(name)
    else:
        env = gymnasium.make(name)
    if not isinstance(env.action_space, gymnasium.spaces.Box) or len(env.action_space.shape) != 1:
        raise ValueError(f"--env {name}: D4PG needs continuous actions (a 1-d Box), got {env.action_space}")
    bound = np.ones(env.action_space.shape, np.float32)  # float32, as the spaces: no precision warning
    return gymnasium.wrappers.RescaleAction(env, -bound, bound)


class ControlSuiteEnv(gymnasium.Env):
    """A DeepMind Control Suite task (`dmc:cartpole-swingup`) from states, seen through gymnasium's interface."""

    def __init__(self, name: str) -> None:
        try:
            from dm_control import suite
        except ImportError as error:
            raise ImportError(
                f"--env {name} needs DeepMind's Control Suite, which is not installed: pip install -e '.[dmc]' "
                f"(dm-control with a mujoco below 4, whose bindings it reads). gymnasium's tasks, such as --env "
                f"Pendulum-v1, "
                f"need nothing more."
            ) from error
        domain, _, task = name.removeprefix("dmc:").partition("-")
        if (domain, task) not in suite.ALL_TASKS:
            known = ", ".join(f"dmc:{d}-{t}" for d, t in suite.ALL_TASKS[:8])
            raise ValueError(f"--env {name}: no Control Suite task {domain!r}/{task!r} (for example {known}, ...)")
        self._suite, self._domain, self._task = suite, domain, task
        self._env = suite.load(domain, task)
        spec = self._env.action_spec()
        size = sum(int(np.prod(s.shape)) for s in self._env.observation_spec().values())
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (size,), np.float32)
        self.action_space = gymnasium.spaces.Box(spec.minimum.astype(np.float32), spec.maximum.astype(np.float32))

    @staticmethod
    def _flat(observation: dict[str, Any]) -> np.ndarray:
        return np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in observation.values()])

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:  # the suite seeds a task when it is loaded
            self._env = self._suite.load(self._domain, self._task, task_kwargs={"random": seed})
        return self._flat(self._env.reset().observation), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        time_step = self._env.step(action)
        # The suite ends episodes by a time limit (discount 1: keep bootstrapping) or by failure (discount 0).
        ended = time_step.last()
        terminated = ended and time_step.discount == 0.0
        return self._flat(time_step.observation), float(time_step.reward), terminated, ended and not terminated, {}


# -- networks -----------------------------------------------------------------------------------


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, outputs))


class Policy(nn.Module):
    """The deterministic actor: observation -> action in [-1, 1]."""

    def __init__(self, observation_size: int, action_size: int, hidden: int) -> None:
        super().__init__()
        self.net = mlp(observation_size, hidden, action_size)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.preactivation(observation))

    def preactivation(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation)


class DistributionalCritic(nn.Module):
    """(observation, action) -> logits of the return's distribution over the fixed support `atoms`."""

    atoms: torch.Tensor

    def __init__(self, observation_size: int, action_size: int, hidden: int, atoms: torch.Tensor) -> None:
        super().__init__()
        self.net = mlp(observation_size + action_size, hidden, len(atoms))
        self.register_buffer("atoms", atoms)

    def forward(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([observation, action], dim=-1))

    def mean(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """The expected return: Q(s, a), what the policy climbs."""
        return (F.softmax(self(observation, action), dim=-1) * self.atoms).sum(-1)


def categorical_projection(probs: torch.Tensor, atoms: torch.Tensor, reward: torch.Tensor,
                           discount: torch.Tensor) -> torch.Tensor:
    """The distribution of reward + discount * Z, Z having `probs` on `atoms`, put back on `atoms`.

    The Bellman update moves atom z_j to reward + discount * z_j, which lies between two of
    the support's atoms (or beyond its ends, where it is clipped to them). The critic's
    cross-entropy needs the target on the critic's own support, so each moved atom's
    probability is split between its two neighbours on the support in proportion to
    closeness (linear interpolation): this keeps the mean of every target inside
    [v_min, v_max], and it is the projection onto the support that is closest in Cramer
    distance (Rowland et al. 2018). probs: (B, atoms); reward, discount: (B,).
    Returns (B, atoms), rows summing to 1.
    """
    size = len(atoms)
    moved = (reward[:, None] + discount[:, None] * atoms[None, :]).clamp(atoms[0], atoms[-1])
    position = (moved - atoms[0]) / (atoms[1] - atoms[0])  # fractional index on the support, in [0, size - 1]
    # A moved atom exactly on atom k gets lower = k and a zero share above: no special case for
    # lower == upper. At v_max the upper neighbour is the column past the end, which is dropped.
    lower = position.floor().clamp(max=size - 1)
    above = position - lower  # the upper neighbour's share
    projected = torch.zeros(probs.shape[0], size + 1, dtype=probs.dtype, device=probs.device)
    projected.scatter_add_(1, lower.long(), probs * (1.0 - above))
    projected.scatter_add_(1, lower.long() + 1, probs * above)
    return projected[:, :size]


# -- the learning curve -------------------------------------------------------------------------


@torch.no_grad()
def evaluate(policy: nn.Module, env_name: str, episodes: int, seed: int) -> list[float]:
    """Returns of `episodes` episodes of the deterministic policy (no noise), their envs stepped side by side."""
    envs = [make_env(env_name) for _ in range(episodes)]
    observations = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    returns = [0.0] * episodes
    running = list(range(episodes))
    while running:
        device = next(policy.parameters()).device  # the replica's: a GPU where there is one
        actions = policy(torch.as_tensor(np.stack([observations[i] for i in running]), dtype=torch.float32,
                                         device=device))
        still = []
        for i, action in zip(running, actions.cpu().numpy()):
            observations[i], reward, terminated, truncated, _ = envs[i].step(action)
            returns[i] += float(reward)
            if not (terminated or truncated):
                still.append(i)
        running = still
    return returns



@dataclass
class CurvePoint:
    env_steps: int  # all actors', as of their latest weight pulls
    learner_steps: int  # the version of the weights evaluated
    seconds: float  # wall-clock since the evaluator started (it evaluates beside the training, in its own process)
    mean_return: float
    std_return: float
    samples_per_insert: float  # realised so far, job-wide
    policy_lag_p95: float  # learner steps between the weights that acted and the learner's, at insert


@dataclass
class LearningCurve:
    target: float
    points: list[CurvePoint] = field(default_factory=list)

    def add(self, point: CurvePoint) -> None:
        if not self.points:
            print(" env steps | learner steps | wall s | eval return      | samples/insert | lag p95", flush=True)
        self.points.append(point)
        print(f"{point.env_steps:10d} | {point.learner_steps:13d} | {point.seconds:6.1f} | "
              f"{point.mean_return:7.1f} +- {point.std_return:5.1f} | {point.samples_per_insert:14.1f} | "
              f"{point.policy_lag_p95:7.0f}", flush=True)

    def reached(self) -> CurvePoint | None:
        """The first evaluation at or above the target return."""
        return next((p for p in self.points if p.mean_return >= self.target), None)

    def save(self, directory: str, title: str, settings: dict[str, Any]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(directory, exist_ok=True)
        first = self.reached()
        with open(os.path.join(directory, "curve.json"), "w") as handle:
            json.dump({"target": self.target, "reached": asdict(first) if first else None,
                       "points": [asdict(p) for p in self.points], "settings": settings}, handle, indent=1)
        figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for axis, x, label in ((axes[0], "env_steps", "env steps"), (axes[1], "seconds", "wall-clock seconds")):
            values = [getattr(p, x) for p in self.points]
            means = np.array([p.mean_return for p in self.points])
            stds = np.array([p.std_return for p in self.points])
            axis.plot(values, means, marker=".")
            axis.fill_between(values, means - stds, means + stds, alpha=0.2)
            axis.axhline(self.target, color="grey", linestyle="--", linewidth=1)
            axis.set_xlabel(label)
            axis.grid(alpha=0.3)
        axes[0].set_ylabel("evaluation return (mean +- std)")
        figure.suptitle(title)
        figure.tight_layout()
        figure.savefig(os.path.join(directory, "curve.png"), dpi=100)
        plt.close(figure)


# -- training -----------------------------------------------------------------------------------


class EnvironmentUnavailable(RuntimeError):
    """--env names an environment this process cannot make (not installed, or no such id)."""


def probe_env(name: str, who: str) -> tuple[int, int]:
    """(observation size, action size) of `name`; every process builds the networks from them, so every process
    fails here, saying which it is, when the environment is missing."""
    try:
        probe = make_env(name)
    except ImportError as error:  # its message says what to install
        raise EnvironmentUnavailable(f"{who}: {error}") from error
    except gymnasium.error.Error as error:
        raise EnvironmentUnavailable(
            f"{who}: --env {name}: {str(error).rstrip('.')}: check the id (python -c 'import gymnasium; "
            "gymnasium.pprint_registry()' lists them) and install the package that registers it") from error
    return gymnasium.spaces.flatdim(probe.observation_space), gymnasium.spaces.flatdim(probe.action_space)


def launch_job(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """Run plainly (no launcher): start the job of learners, actors and the evaluator on this machine."""
    from replicator.launch import LaunchSpec, launch

    processes = (args.learners or 1) + args.actors + 1
    print(f"d4pg: starting {processes} processes: {args.learners or 1} learner(s), {args.actors} actor(s) and the "
          "evaluator (replicator launch does the same)", flush=True)
    script_args = list(sys.argv[1:] if argv is None else argv)
    return launch(LaunchSpec(os.path.abspath(__file__), script_args, nproc_per_node=processes, threads_per_process=1))


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:  # not started by a launcher: become one
        raise SystemExit(launch_job(args, argv))
    torch.set_num_threads(1)  # small networks: more threads only add synchronisation

    repl = rp.Replicator(mode=rp.ActorLearner(actors=args.actors, evaluator=True))
    who = f"{repl.role} (rank {repl.topology.rank})"
    learners = repl.topology.world_size - args.actors - 1
    if args.learners is not None and args.learners != learners:
        raise SystemExit(f"d4pg: {who}: --learners {args.learners} --actors {args.actors} and the evaluator make "
                         f"{args.learners + args.actors + 1} processes, but {repl.topology.world_size} were "
                         f"launched: launch -n {args.learners + args.actors + 1}, or leave --learners out")
    observation_size, action_size = probe_env(args.env, who)
    replay = rp.Replay(capacity=args.replay_capacity, batch_size=args.batch_size,
                       samples_per_insert=args.samples_per_insert, tolerance=0.1, min_size=args.min_replay,
                       n_step=args.n_step, discount=args.discount, prioritized=args.prioritized,
                       priority_exponent=args.priority_exponent, importance_exponent=args.importance_exponent,
                       seed=args.seed)
    with repl.scope():  # every role builds the same modules: actors and the evaluator load the learners' weights
        torch.manual_seed(args.seed)
        atoms = torch.linspace(args.v_min, args.v_max, args.atoms)
        policy = Policy(observation_size, action_size, args.hidden)
        critic = DistributionalCritic(observation_size, action_size, args.hidden, atoms)
        target_policy, target_critic = copy.deepcopy(policy), copy.deepcopy(critic)
        policy_opt = repl.wrap_optimizer(torch.optim.Adam(policy.parameters(), lr=args.policy_lr))
        critic_opt = repl.wrap_optimizer(torch.optim.Adam(critic.parameters(), lr=args.critic_lr))

    def step_fn(ctx: rp.ReplicaContext, batch: rp.ReplaySample) -> dict[str, torch.Tensor]:
        # The critic: cross-entropy between its distribution at (s, a) and the projected target.
        with torch.no_grad():
            next_action = target_policy(batch.next_observation)
            next_probs = F.softmax(target_critic(batch.next_observation, next_action), dim=-1)
            target = categorical_projection(next_probs, atoms, batch.reward, batch.discount)
        log_probs = F.log_softmax(critic(batch.observation, batch.action), dim=-1)
        cross_entropy = -(target * log_probs).sum(-1)
        critic_loss = (batch.weight * cross_entropy).mean()
        critic_opt.zero_grad()
        critic_loss.backward()  # the learners' critic gradients are averaged here
        critic_opt.step()
        if args.prioritized:  # this learner's own shard: the keys of its own batch
            td_error = (target * atoms).sum(-1) - (log_probs.detach().exp() * atoms).sum(-1)
            replay.update_priorities(batch.key, td_error.abs() + 1e-6)

        # The policy: the deterministic policy gradient. dQ/da is taken with autograd.grad, which
        # leaves the critic's .grad alone (no critic gradients to average), and pushed back through
        # the policy as the gradient of -Q.
        preactivation = policy.preactivation(batch.observation)
        action = torch.tanh(preactivation)
        q = critic.mean(batch.observation, action)
        (dq_da,) = torch.autograd.grad(q.sum(), action)
        # Where tanh saturates its gradient vanishes, and a policy pushed to full torque early stays
        # there (the pendulum rocks at the bottom under a constant push): without this small penalty
        # on the pre-activation, seed 0 stalled so for the whole run (and seed 2 at a policy lr of 1e-4).
        penalty = args.preactivation_penalty * preactivation.square().sum(-1).mean()
        policy_loss = -(dq_da * action).sum(-1).mean() + penalty
        policy_opt.zero_grad()
        policy_loss.backward()
        policy_opt.step()

        with torch.no_grad():  # the targets trail the networks slowly, which steadies the bootstrap
            for online, slow in ((policy, target_policy), (critic, target_critic)):
                for p, p_target in zip(online.parameters(), slow.parameters()):
                    p_target.lerp_(p, args.tau)
        return {"critic_loss": ctx.all_mean(critic_loss.detach()), "q": ctx.all_mean(q.detach().mean())}

    def actor_fn(actor: rp.ActorContext) -> None:
        if actor.is_evaluator:
            return evaluator_fn(actor)
        env = make_env(args.env)
        observation, _ = env.reset(seed=actor.seed)
        while actor.running:
            with torch.no_grad():  # torch's generator is seeded with actor.seed: each actor explores its own way
                action = policy(torch.as_tensor(observation, dtype=torch.float32, device=repl.device)).cpu()
                action = (action + args.sigma * torch.randn(action.shape)).clamp(-1.0, 1.0)
            next_observation, reward, terminated, truncated, _ = env.step(action.numpy())
            # N-step assembly, the send to a learner's shard, the rate limiter and the weight pulls happen here.
            actor.add(observation=observation, action=action, reward=reward, next_observation=next_observation,
                      terminated=terminated, truncated=truncated)
            observation = env.reset()[0] if terminated or truncated else next_observation

    def evaluator_fn(actor: rp.ActorContext) -> None:
        """Every eval_every env steps (job-wide), the learners' newest policy without noise; the curve to --out."""
        curve, due = LearningCurve(args.target_return), args.eval_every
        while actor.running:
            counters = actor.counters()
            if counters["env_steps"] < due:
                time.sleep(0.05)
                continue
            actor.update_weights()
            returns = evaluate(policy, args.env, args.eval_episodes, seed=10_000 + args.seed * 100)
            curve.add(CurvePoint(counters["env_steps"], actor.version, counters["seconds"], float(np.mean(returns)),
                                 float(np.std(returns)), counters["samples_per_insert"] or 0.0,
                                 counters["policy_lag"]["p95"] or 0))
            due = (counters["env_steps"] // args.eval_every + 1) * args.eval_every
            if args.stop_at_target and curve.reached():
                actor.end_run(f"mean evaluation return {curve.points[-1].mean_return:.1f} >= {args.target_return:g}")
                break
        first = curve.reached()
        print(f"{args.env}, seed {args.seed}: " + (
            f"mean evaluation return >= {args.target_return:g} after {first.env_steps} env steps, "
            f"{first.seconds:.1f} s" if first else f"never reached {args.target_return:g}"), flush=True)
        if args.out:
            curve.save(args.out, f"D4PG on {args.env}, {learners} learner(s) + {args.actors} actor(s), seed "
                       f"{args.seed}", vars(args) | {"learners": learners})
            print(f"learning curve written to {args.out}/curve.png and curve.json", flush=True)

    for _ in repl.run(step_fn, repl.prepare_input(replay), steps=args.steps, actor_fn=actor_fn,
                      update_period=args.update_period):
        pass
    figures = repl.last_run["actor_learner"]
    if repl.role == "learner" and repl.replica_id == 0:
        report(args, figures, learners)
    return figures


def report(args: argparse.Namespace, figures: dict[str, Any], learners: int) -> None:
    """Learner 0: the job's counters, against the issue's targets, printed and added to curve.json."""
    # An actor pulls every update_period of its env steps, while all actors make update_period x actors,
    # which the limiter turns into this many learner steps: the lag a policy reaches just before a pull.
    interval = args.update_period * args.actors * (args.samples_per_insert or 0) / args.batch_size
    lag = figures["policy_lag"]
    realised = figures["samples_per_insert"]
    print(f"learners: {figures['learner_steps']} steps ({figures['learner_steps_per_second']:.0f}/s), "
          f"{figures['env_steps']} env steps ({figures['env_steps_per_second']:.0f}/s); samples per insert "
          f"{realised if realised is None else round(realised, 1)} (target {args.samples_per_insert:g}); policy "
          f"lag median {lag['median']}, p95 {lag['p95']} learner steps (an actor's pull interval: {interval:g})",
          flush=True)
    if args.out and os.path.exists(os.path.join(args.out, "curve.json")):  # the evaluator wrote it before leaving
        path = os.path.join(args.out, "curve.json")
        with open(path) as handle:
            curve = json.load(handle)
        curve["actor_learner"] = figures | {"pull_interval_learner_steps": interval}
        with open(path, "w") as handle:
            json.dump(curve, handle, indent=1)


if __name__ == "__main__":
    main()
