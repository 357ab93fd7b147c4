"""The replay of an actor–learner job: its settings (rp.Replay), the batches learners get (rp.ReplaySample), and one
learner's shard: fixed-size storage with FIFO eviction, uniform or prioritized sampling, priority updates."""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import torch

from replicator.asynchronous.actor_learner.rate_limiter import RateLimiter
from replicator.asynchronous.actor_learner.transitions import TransitionSpec
from replicator.errors import ReplicatorUsageError

__all__ = ["Replay", "ReplaySample", "ReplayShard"]


class ReplaySample(NamedTuple):
    """A learner's batch: N-step transitions with their importance weights and keys (for priority updates)."""

    observation: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor  # float32: the N-step discounted sum of rewards
    discount: torch.Tensor  # float32: gamma^k to bootstrap with, 0 where the episode terminated within the N steps
    next_observation: torch.Tensor
    weight: torch.Tensor  # float32 importance weights, normalised to at most 1 (ones when sampling is uniform)
    key: torch.Tensor  # int64: which item each row is, for Replay.update_priorities


class Replay:
    """The experience replay of `mode="actor_learner"`; build it on every process with the same arguments.

    Args:
        capacity: items held job-wide (split evenly over the learners' shards); the oldest go first.
        batch_size: the global batch per learner step; each of L learners samples batch_size / L
            from its own shard.
        samples_per_insert: the rate limiter's ratio. Learners wait when sampling would run ahead
            of `samples_per_insert` × items inserted, actors wait when they run ahead of the learners.
            None: no ratio, only min_size.
        tolerance: the rate limiter's band: ± tolerance × samples_per_insert × min_size (Acme's D4PG recipe).
        min_size: learners sample only once this many items are in (job-wide).
        n_step: actors assemble N-step transitions (the learners' batches hold the discounted
            N-step reward and discount^k, or 0 after a terminal step).
        discount: the per-step discount of those transitions.
        prioritized: proportional prioritized replay (Schaul et al.) instead of uniform sampling: item i
            is drawn with probability p_i^a / sum p^a. New items take the largest priority seen;
            `update_priorities` sets others.
        priority_exponent: a in p_i^a.
        importance_exponent: b in the importance weight (N P(i))^-b / max over the batch.
        seed: seeds each shard's sampling and each actor's `actor.seed` (distinct per actor).
    """

    def __init__(self, capacity: int = 1_000_000, batch_size: int = 256, *, samples_per_insert: float | None = 32.0,
                 tolerance: float = 0.1, min_size: int = 1_000, n_step: int = 1, discount: float = 0.99,
                 prioritized: bool = False, priority_exponent: float = 0.6, importance_exponent: float = 0.4,
                 seed: int = 0) -> None:
        if capacity < 1 or batch_size < 1:
            raise ReplicatorUsageError(f"Replay needs capacity >= 1 and batch_size >= 1, got {capacity} and "
                                       f"{batch_size}")
        if batch_size > capacity:
            raise ReplicatorUsageError(
                f"Replay(batch_size={batch_size}) asks for more samples per step than the replay can hold "
                f"(capacity={capacity}): raise capacity or lower batch_size")
        if not 1 <= min_size <= capacity:
            raise ReplicatorUsageError(f"Replay(min_size={min_size}) must lie in [1, capacity={capacity}]: the "
                                       "learners sample once min_size items are in, which capacity must allow")
        if n_step < 1 or not 0.0 <= discount <= 1.0:
            raise ReplicatorUsageError(f"Replay needs n_step >= 1 and 0 <= discount <= 1, got n_step={n_step}, "
                                       f"discount={discount}")
        if samples_per_insert is not None and not samples_per_insert > 0:
            raise ReplicatorUsageError(f"Replay(samples_per_insert={samples_per_insert}) must be positive, or None "
                                       "for no rate limit")
        if tolerance < 0 or priority_exponent < 0 or importance_exponent < 0:
            raise ReplicatorUsageError("Replay's tolerance, priority_exponent and importance_exponent cannot be "
                                       "negative")
        self.capacity, self.batch_size, self.min_size = capacity, batch_size, min_size
        self.samples_per_insert, self.tolerance = samples_per_insert, tolerance
        self.n_step, self.discount = n_step, discount
        self.prioritized, self.priority_exponent, self.importance_exponent = (
            prioritized, priority_exponent, importance_exponent)
        self.seed = seed
        self.shard: ReplayShard | None = None  # this learner's, once the job bound it (repl.prepare_input)

    def __call__(self, context: Any) -> Any:
        raise ReplicatorUsageError("rp.Replay feeds the learners of rp.Replicator(mode='actor_learner'): pass it "
                                   "to repl.prepare_input(replay) of such a Replicator")

    def shard_shape(self, learners: int) -> tuple[int, int, int]:
        """(capacity, min_size, batch) of each of `learners` shards; raises unless the batch splits evenly."""
        if self.batch_size % learners:
            raise ReplicatorUsageError(
                f"Replay(batch_size={self.batch_size}) does not split over {learners} learners: each samples "
                f"batch_size / {learners} from its own shard, so use a multiple of {learners}")
        return math.ceil(self.capacity / learners), math.ceil(self.min_size / learners), self.batch_size // learners

    def bind(self, learners: int, shard_index: int) -> ReplayShard:
        """This learner's shard (the first call makes it; a Replay serves one job)."""
        if self.shard is None:
            capacity, min_size, batch = self.shard_shape(learners)
            limiter = RateLimiter.of(min_size, self.samples_per_insert, self.tolerance, batch)
            self.shard = ReplayShard(capacity, batch, limiter, self.prioritized, self.priority_exponent,
                                     self.importance_exponent, seed=self.seed * 7919 + shard_index)
        return self.shard

    def update_priorities(self, keys: torch.Tensor, priorities: torch.Tensor) -> None:
        """Set the priorities of the items `keys` (a batch's `key`) in this learner's shard; items evicted since
        sampling are skipped. Call it in step_fn with this learner's own batch (e.g. |TD error| + 1e-6)."""
        if not self.prioritized:
            raise ReplicatorUsageError("Replay.update_priorities() needs Replay(prioritized=True): a uniform replay "
                                       "has no priorities")
        if self.shard is None:
            raise ReplicatorUsageError("Replay.update_priorities() is for learners, inside step_fn: this process "
                                       "holds no replay shard")
        self.shard.update_priorities(keys, priorities)

    def __len__(self) -> int:
        """Items in this learner's shard (0 elsewhere)."""
        return 0 if self.shard is None else self.shard.size


class ReplayShard:
    """One learner's part of the replay. The learner's service thread inserts, its main thread samples: `lock`
    (a Condition, which the rate limiter's waits use too) guards every field."""

    def __init__(self, capacity: int, batch_size: int, limiter: RateLimiter, prioritized: bool, alpha: float,
                 beta: float, seed: int) -> None:
        self.capacity, self.batch_size, self.limiter = capacity, batch_size, limiter
        self.prioritized, self.alpha, self.beta = prioritized, alpha, beta
        self.lock = threading.Condition()
        self.generator = torch.Generator().manual_seed(seed)
        self.spec: TransitionSpec | None = None
        self.fields: dict[str, torch.Tensor] = {}
        self.keys = torch.full((capacity,), -1, dtype=torch.int64)
        self.priorities = torch.zeros(capacity, dtype=torch.float64)
        self.max_priority = 1.0
        self.size = 0
        self.next_key = 0

    def _allocate(self, spec: TransitionSpec) -> None:
        self.spec = spec
        obs, action = spec.observation, spec.action
        self.fields = {
            "observation": torch.empty((self.capacity, *obs.shape), dtype=obs.dtype),
            "action": torch.empty((self.capacity, *action.shape), dtype=action.dtype),
            "reward": torch.empty(self.capacity, dtype=torch.float32),
            "discount": torch.empty(self.capacity, dtype=torch.float32),
            "next_observation": torch.empty((self.capacity, *obs.shape), dtype=obs.dtype),
        }

    def insert(self, spec: TransitionSpec, fields: dict[str, torch.Tensor], count: int) -> None:
        """Add `count` transitions, evicting the oldest when full; the caller holds `lock`."""
        if self.spec is None:
            self._allocate(spec)
        if count > self.capacity:  # only the newest fit
            fields = {name: value[-self.capacity:] for name, value in fields.items()}
            self.next_key += count - self.capacity
            self.limiter.committed(count - self.capacity)
            count = self.capacity
        keys = torch.arange(self.next_key, self.next_key + count, dtype=torch.int64)
        slots = keys % self.capacity
        for name, storage in self.fields.items():
            storage[slots] = fields[name]
        self.keys[slots] = keys
        self.priorities[slots] = self.max_priority
        self.next_key += count
        self.size = min(self.size + count, self.capacity)
        self.limiter.committed(count)
        self.lock.notify_all()

    def sample(self) -> ReplaySample:
        """A batch drawn with replacement; the caller holds `lock` and has checked the rate limiter."""
        count = self.batch_size
        if self.prioritized:
            scaled = self.priorities[:self.size] ** self.alpha
            total = float(scaled.sum())
            if total > 0 and math.isfinite(total):
                cumulative = torch.cumsum(scaled, 0)
                draws = torch.rand(count, dtype=torch.float64, generator=self.generator) * total
                slots = torch.searchsorted(cumulative, draws, right=True).clamp_(max=self.size - 1)
                weight = (self.size * scaled[slots] / total) ** -self.beta
                weight = (weight / weight.max()).to(torch.float32)
            else:  # every priority 0: nothing to prefer
                slots = torch.randint(self.size, (count,), generator=self.generator)
                weight = torch.ones(count, dtype=torch.float32)
        else:
            slots = torch.randint(self.size, (count,), generator=self.generator)
            weight = torch.ones(count, dtype=torch.float32)
        self.limiter.sampled(count)
        fields = self.fields
        return ReplaySample(fields["observation"][slots], fields["action"][slots], fields["reward"][slots],
                            fields["discount"][slots], fields["next_observation"][slots], weight, self.keys[slots])

    def update_priorities(self, keys: torch.Tensor, priorities: torch.Tensor) -> None:
        keys = torch.as_tensor(keys).detach().to("cpu", torch.int64).reshape(-1)
        values = torch.as_tensor(priorities).detach().to("cpu", torch.float64).reshape(-1)
        if keys.numel() != values.numel():
            raise ReplicatorUsageError(f"Replay.update_priorities() got {keys.numel()} keys and {values.numel()} "
                                       "priorities: pass one priority per key (per row of the batch)")
        if values.numel() and (not bool(torch.isfinite(values).all()) or bool((values < 0).any())):
            raise ReplicatorUsageError("Replay.update_priorities() got a negative, NaN or infinite priority: "
                                       "priorities must be finite and >= 0 (e.g. |TD error| + 1e-6)")
        with self.lock:
            slots = keys % self.capacity
            current = (self.keys[slots] == keys) & (keys >= 0)  # items evicted since they were sampled keep out
            self.priorities[slots[current]] = values[current]
            if values.numel():
                self.max_priority = max(self.max_priority, float(values.max()))
