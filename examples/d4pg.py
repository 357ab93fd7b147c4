"""D4PG (arXiv 1804.08617) on gymnasium's Pendulum-v1: a deterministic actor, a distributional critic, N-step returns.

    python examples/d4pg.py --single-process                        # one process, a few minutes on one core
    python examples/d4pg.py --single-process --seed 3 --out runs/d4pg-3
    python examples/d4pg.py --single-process --prioritized          # replay sampled by |TD error|
    python examples/d4pg.py --single-process --env dmc:cartpole-swingup --v-min -150 --v-max 150  # dm-control

D4PG is DDPG with four changes: the critic predicts a *distribution* of returns (51 atoms
on a fixed support, trained with a cross-entropy against the projected Bellman target),
N-step returns, many actors feeding one replay, and (optionally) prioritized replay. Here
the actors step an environment with the current policy plus Gaussian noise and add their
transitions to the replay; the learner samples batches of N-step transitions from it and
updates the critic, then the policy along the critic's slope in the action. It prints a
learning curve (mean return of deterministic evaluation episodes) and writes it, as JSON and
as a PNG against env steps and against wall-clock seconds, to --out.

`--single-process` runs one actor, the learner and the evaluator in this process, taking turns
at the samples-per-insert ratio (`train_single_process`, at the bottom). `actor_fn` and
`step_fn` are written to the shape of replicator's actor-learner regime (issue 18), so that
when it lands the launch below replaces that driver with one `repl.run(...)` call:

    replicator launch -n 4 examples/d4pg.py --actors 2 --learners 1   # 1 learner, 2 actors, 1 evaluator

Hyperparameters, and why (Pendulum-v1: 200-step episodes, rewards in [-16.3, 0], a 1-d torque;
the target is a mean evaluation return of -200 within 20,000 env steps; figures below are env
steps to -200 with seeds 0, 1, 2 and the held-out seed 3, 10 deterministic evaluation episodes
every 1,000 env steps):
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
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
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
    parser.add_argument("--actors", type=int, default=2, help="actor processes (the launched job)")
    parser.add_argument("--learners", type=int, default=1,
                        help="learner processes, a synchronous replica group (the launched job)")
    parser.add_argument("--single-process", action="store_true",
                        help="one actor, the learner and the evaluator in this process, taking turns")
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
                        help="actors pull weights every this many env steps (the launched job)")
    parser.add_argument("--eval-every", type=int, default=1_000, help="env steps between evaluations")
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--target-return", type=float, default=-200.0, help="the curve reports when it gets there")
    parser.add_argument("--stop-at-target", action="store_true", help="end training at the first evaluation there")
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
                f"--env {name} needs DeepMind's Control Suite, which is not installed: pip install dm-control "
                f"(it brings the mujoco version it requires). gymnasium's tasks, such as --env Pendulum-v1, "
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
    projected = torch.zeros(probs.shape[0], size + 1, dtype=probs.dtype)
    projected.scatter_add_(1, lower.long(), probs * (1.0 - above))
    projected.scatter_add_(1, lower.long() + 1, probs * above)
    return projected[:, :size]


# -- N-step transitions and the replay ----------------------------------------------------------


@dataclass
class Transition:
    """One N-step transition: from `observation`, `action`, then `reward` (discounted sum over k <= N steps)
    until `next_observation`; `discount` is discount**k, or 0 when the episode terminated within them."""

    observation: np.ndarray
    action: np.ndarray
    reward: float
    discount: float
    next_observation: np.ndarray


class NStepAssembler:
    """Turns one actor's env steps into N-step transitions, one per env step.

    Full windows of N steps come out as they fill; when an episode ends, the steps still in
    the window come out with shorter horizons. After `terminated` the value beyond is 0
    (discount 0); after `truncated` (a time limit) the episode was cut, not ended, so the
    last observation's value is still bootstrapped (discount**k).
    """

    def __init__(self, n_step: int, discount: float) -> None:
        self.n_step = n_step
        self.discount = discount
        self.window: deque[tuple[np.ndarray, np.ndarray, float]] = deque()

    def add(self, observation: np.ndarray, action: np.ndarray, reward: float, next_observation: np.ndarray,
            terminated: bool, truncated: bool) -> list[Transition]:
        self.window.append((observation, action, float(reward)))
        ready = []
        if terminated or truncated:
            while self.window:
                ready.append(self._oldest(next_observation, terminated))
                self.window.popleft()
        elif len(self.window) == self.n_step:
            ready.append(self._oldest(next_observation, terminated=False))
            self.window.popleft()
        return ready

    def _oldest(self, next_observation: np.ndarray, terminated: bool) -> Transition:
        observation, action, _ = self.window[0]
        reward = sum(self.discount**k * r for k, (_, _, r) in enumerate(self.window))
        discount = 0.0 if terminated else self.discount ** len(self.window)
        return Transition(observation, action, reward, discount, next_observation)


@dataclass
class ReplaySample:
    """A batch, as the learner's step_fn receives it (rp.ReplaySample's fields)."""

    observation: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    discount: torch.Tensor
    next_observation: torch.Tensor
    weight: torch.Tensor  # importance weights; ones when sampling is uniform
    key: torch.Tensor  # which items, for update_priorities


class LocalReplay:
    """A minimal FIFO replay for the single-process driver: uniform, or prioritized (Schaul et al. 2015).

    Prioritized: item i is drawn with probability p_i**alpha / sum_k p_k**alpha, new items get
    the largest priority seen so far (each is learnt from at least once), and the loss of each
    draw is weighted by (size * P(i))**-beta / max, which undoes the bias of the skewed sampling.
    Sampling is O(size): fine for one process and Pendulum's 20,000 steps.
    """

    def __init__(self, capacity: int, observation_size: int, action_size: int, batch_size: int, *,
                 prioritized: bool, priority_exponent: float, importance_exponent: float, seed: int) -> None:
        self.capacity, self.batch_size, self.prioritized = capacity, batch_size, prioritized
        self.priority_exponent, self.importance_exponent = priority_exponent, importance_exponent
        self.observation = torch.zeros(capacity, observation_size)
        self.action = torch.zeros(capacity, action_size)
        self.reward = torch.zeros(capacity)
        self.discount = torch.zeros(capacity)
        self.next_observation = torch.zeros(capacity, observation_size)
        self.priority = torch.zeros(capacity, dtype=torch.float64)
        self.max_priority = 1.0
        self.size = self.position = self.inserts = self.samples = 0
        self.generator = torch.Generator().manual_seed(seed)

    def insert(self, transition: Transition) -> None:
        i = self.position
        self.observation[i] = torch.as_tensor(transition.observation)
        self.action[i] = torch.as_tensor(transition.action)
        self.reward[i] = transition.reward
        self.discount[i] = transition.discount
        self.next_observation[i] = torch.as_tensor(transition.next_observation)
        self.priority[i] = self.max_priority
        self.position = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        self.inserts += 1

    def sample(self) -> ReplaySample:
        if self.prioritized:
            probability = self.priority[: self.size] ** self.priority_exponent
            probability /= probability.sum()
            key = torch.multinomial(probability, self.batch_size, replacement=True, generator=self.generator)
            weight = (self.size * probability[key]) ** -self.importance_exponent
            weight = (weight / weight.max()).float()
        else:
            key = torch.randint(self.size, (self.batch_size,), generator=self.generator)
            weight = torch.ones(self.batch_size)
        self.samples += self.batch_size
        return ReplaySample(self.observation[key], self.action[key], self.reward[key], self.discount[key],
                            self.next_observation[key], weight, key)

    def update_priorities(self, key: torch.Tensor, priority: torch.Tensor) -> None:
        priority = priority.detach().double() + 1e-6  # never 0: every item keeps a chance
        self.priority[key] = priority
        self.max_priority = max(self.max_priority, float(priority.max()))


# -- the learning curve -------------------------------------------------------------------------


@torch.no_grad()
def evaluate(policy: nn.Module, env_name: str, episodes: int, seed: int) -> list[float]:
    """Returns of `episodes` episodes of the deterministic policy (no noise), their envs stepped side by side."""
    envs = [make_env(env_name) for _ in range(episodes)]
    observations = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    returns = [0.0] * episodes
    running = list(range(episodes))
    while running:
        actions = policy(torch.as_tensor(np.stack([observations[i] for i in running]), dtype=torch.float32))
        still = []
        for i, action in zip(running, actions.numpy()):
            observations[i], reward, terminated, truncated, _ = envs[i].step(action)
            returns[i] += float(reward)
            if not (terminated or truncated):
                still.append(i)
        running = still
    return returns


@dataclass
class CurvePoint:
    env_steps: int
    learner_steps: int
    seconds: float  # wall-clock of training, evaluation excluded (a separate process in the launched job)
    mean_return: float
    std_return: float
    critic_loss: float
    samples_per_insert: float


@dataclass
class LearningCurve:
    target: float
    points: list[CurvePoint] = field(default_factory=list)

    def add(self, point: CurvePoint) -> None:
        if not self.points:
            print(" env steps | learner steps | train s | eval return      | critic loss | samples/insert", flush=True)
        self.points.append(point)
        print(f"{point.env_steps:10d} | {point.learner_steps:13d} | {point.seconds:7.1f} | "
              f"{point.mean_return:7.1f} +- {point.std_return:5.1f} | {point.critic_loss:11.4f} | "
              f"{point.samples_per_insert:14.1f}", flush=True)

    def reached(self) -> CurvePoint | None:
        """The first evaluation at or above the target return."""
        return next((p for p in self.points if p.mean_return >= self.target), None)

    def save(self, directory: str, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(directory, exist_ok=True)
        first = self.reached()
        with open(os.path.join(directory, "curve.json"), "w") as handle:
            json.dump({"target": self.target, "reached": asdict(first) if first else None,
                       "points": [asdict(p) for p in self.points]}, handle, indent=1)
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


def main(argv: Sequence[str] | None = None) -> LearningCurve:
    args = parse_args(argv)
    if not args.single_process:
        raise SystemExit("the launched actor-learner job needs replicator's actor-learner regime (issue 18), "
                         "not in this version yet: run with --single-process meanwhile")
    probe = make_env(args.env)  # fails here, with what to install, when the environment is missing
    observation_size = gymnasium.spaces.flatdim(probe.observation_space)
    action_size = gymnasium.spaces.flatdim(probe.action_space)
    torch.set_num_threads(1)  # small networks: more threads only add synchronisation

    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(args.seed)
        atoms = torch.linspace(args.v_min, args.v_max, args.atoms)
        policy = Policy(observation_size, action_size, args.hidden)
        critic = DistributionalCritic(observation_size, action_size, args.hidden, atoms)
        target_policy, target_critic = copy.deepcopy(policy), copy.deepcopy(critic)
        policy_opt = repl.wrap_optimizer(torch.optim.Adam(policy.parameters(), lr=args.policy_lr))
        critic_opt = repl.wrap_optimizer(torch.optim.Adam(critic.parameters(), lr=args.critic_lr))
    replay = LocalReplay(args.replay_capacity, observation_size, action_size, args.batch_size,
                         prioritized=args.prioritized, priority_exponent=args.priority_exponent,
                         importance_exponent=args.importance_exponent, seed=args.seed)

    def step_fn(ctx: rp.ReplicaContext, batch: ReplaySample) -> dict[str, torch.Tensor]:
        # The critic: cross-entropy between its distribution at (s, a) and the projected target.
        with torch.no_grad():
            next_action = target_policy(batch.next_observation)
            next_probs = F.softmax(target_critic(batch.next_observation, next_action), dim=-1)
            target = categorical_projection(next_probs, atoms, batch.reward, batch.discount)
        log_probs = F.log_softmax(critic(batch.observation, batch.action), dim=-1)
        cross_entropy = -(target * log_probs).sum(-1)
        critic_loss = (batch.weight * cross_entropy).mean()
        critic_opt.zero_grad()
        critic_loss.backward()
        critic_opt.step()
        if args.prioritized:
            td_error = (target * atoms).sum(-1) - (log_probs.detach().exp() * atoms).sum(-1)
            replay.update_priorities(batch.key, td_error.abs())

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

    def actor_fn(actor: Any) -> None:  # rp.ActorContext once the regime lands
        env = make_env(args.env)
        noise = torch.Generator().manual_seed(actor.seed)
        observation, _ = env.reset(seed=actor.seed)
        while actor.running:
            with torch.no_grad():
                action = policy(torch.as_tensor(observation, dtype=torch.float32))
                action = (action + args.sigma * torch.randn(action.shape, generator=noise)).clamp(-1.0, 1.0)
            next_observation, reward, terminated, truncated, _ = env.step(action.numpy())
            actor.add(observation=observation, action=action, reward=reward, next_observation=next_observation,
                      terminated=terminated, truncated=truncated)
            observation = env.reset()[0] if terminated or truncated else next_observation

    curve = train_single_process(args, repl, step_fn, actor_fn, policy, replay)
    first = curve.reached()
    print(f"{args.env}, seed {args.seed}: " + (
        f"mean evaluation return >= {args.target_return:g} after {first.env_steps} env steps, "
        f"{first.seconds:.1f} s of training" if first else f"never reached {args.target_return:g}"))
    if args.out:
        curve.save(args.out, f"D4PG on {args.env}, seed {args.seed}")
        print(f"learning curve written to {args.out}/curve.png and curve.json")
    return curve


# -- the single-process driver (to be replaced by repl.run(..., actor_fn=actor_fn)) -------------


class LocalActor:
    """What actor_fn sees in one process (rp.ActorContext's verbs): `add` also runs the learner's due steps.

    After each env step the learner takes as many steps as keep samples (batch x steps) at
    samples-per-insert x (inserts - min_replay), as the launched job's rate limiter does; every
    eval_every env steps the clock stops and the evaluator runs. One actor only: its policy is
    the learner's own, so the policy lag is 0.
    """

    def __init__(self, args: argparse.Namespace, repl: rp.Replicator,
                 step_fn: Callable[[rp.ReplicaContext, ReplaySample], dict[str, torch.Tensor]],
                 policy: nn.Module, replay: LocalReplay) -> None:
        self.args, self.repl, self.step_fn, self.policy, self.replay = args, repl, step_fn, policy, replay
        self.actor_id, self.num_actors, self.is_evaluator = 0, 1, False
        self.seed = args.seed * 1_000 + 1  # apart from the evaluator's episodes
        self.version = self.env_steps = 0
        self.assembler = NStepAssembler(args.n_step, args.discount)
        self.curve = LearningCurve(args.target_return)
        self.critic_loss = math.nan
        self.train_seconds = 0.0
        self.started = time.perf_counter()

    @property
    def running(self) -> bool:
        if self.args.stop_at_target and self.curve.reached():
            return False
        return self.version < self.args.steps

    def add(self, *, observation: Any, action: Any, reward: float, next_observation: Any, terminated: bool,
            truncated: bool) -> None:
        for transition in self.assembler.add(np.asarray(observation), np.asarray(action), reward,
                                             np.asarray(next_observation), terminated, truncated):
            self.replay.insert(transition)
        self.env_steps += 1
        due = self.args.samples_per_insert * (self.replay.inserts - self.args.min_replay)
        while self.running and self.replay.samples + self.args.batch_size <= due:
            self.critic_loss = float(self.step_fn(self.repl.context, self.replay.sample())["critic_loss"])
            self.version += 1
        if self.env_steps % self.args.eval_every == 0 or not self.running:
            self.evaluate()

    def update_weights(self) -> None:
        pass  # one process: the actor acts with the learner's modules themselves

    def counters(self) -> dict[str, float]:
        learning = max(self.replay.inserts - self.args.min_replay, 1)
        return {"env_steps": self.env_steps, "learner_steps": self.version,
                "samples_per_insert": self.replay.samples / learning}

    def evaluate(self) -> None:
        self.train_seconds += time.perf_counter() - self.started
        returns = evaluate(self.policy, self.args.env, self.args.eval_episodes, seed=10_000 + self.args.seed * 100)
        self.curve.add(CurvePoint(self.env_steps, self.version, self.train_seconds, float(np.mean(returns)),
                                  float(np.std(returns)), self.critic_loss,
                                  self.counters()["samples_per_insert"]))
        self.started = time.perf_counter()


def train_single_process(args: argparse.Namespace, repl: rp.Replicator,
                         step_fn: Callable[[rp.ReplicaContext, ReplaySample], dict[str, torch.Tensor]],
                         actor_fn: Callable[[Any], None], policy: nn.Module, replay: LocalReplay) -> LearningCurve:
    actor = LocalActor(args, repl, step_fn, policy, replay)
    actor_fn(actor)
    return actor.curve


if __name__ == "__main__":
    main()
