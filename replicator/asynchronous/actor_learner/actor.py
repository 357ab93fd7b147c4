"""rp.ActorContext: what an actor's (or the evaluator's) `actor_fn` gets: add() experience, pull weights, counters."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from replicator.asynchronous.actor_learner import exchange
from replicator.asynchronous.actor_learner.carrier import INSERTS, WEIGHTS, Carrier
from replicator.asynchronous.actor_learner.links import InsertLink, WeightsLink
from replicator.asynchronous.actor_learner.nstep import NStepAdder
from replicator.asynchronous.actor_learner.replay import Replay
from replicator.asynchronous.actor_learner.roles import Roles, shards_fed_by
from replicator.asynchronous.actor_learner.staging import Columns, chunk_rows
from replicator.asynchronous.actor_learner.transitions import TransitionSpec, as_tensor
from replicator.asynchronous.actor_learner.variables import VariableSink
from replicator.comm.peer_link import PeerLinkError
from replicator.errors import ReplicatorError, ReplicatorUsageError
from replicator.timeline import recorder as timeline

__all__ = ["ActorContext", "ActorLearnerError"]

FLUSH_S = 0.001  # staged transitions wait at most this long for more before they are sent (checked at each add)
STORE_EVERY_S = 0.2  # how often an actor looks at the job's store (abort, end of run)
STEPS_EVERY_S = 0.02  # how often, at most, a pull writes the actor's env steps there (for actor.counters())


class ActorLearnerError(ReplicatorError):
    """Another process of an actor–learner job failed (or every actor stopped): raised on every process, with the
    first failure's own message."""


class ActorContext:
    """Handed to `actor_fn` on actors and on the evaluator.

    `actor_id` (0 .. num_actors - 1; the evaluator's is num_actors), `num_actors`, `is_evaluator`,
    `seed` (distinct per actor, from Replay.seed; torch's generator is seeded with it too),
    `version` (the learner step of the weights in this process's modules), `env_steps` (this
    actor's environment steps: add() calls, and rows of add_batch()) and `running` (False once
    the learners have finished: return then).

    Transitions are staged in preallocated columns and streamed to the learners in chunks, without
    a reply per chunk: the learners grant credits as their rate limiters allow, and add() waits
    only when this actor has used them up. Weight pulls go over their own link and are asked for
    one env step before each update point, so their replies arrive while the actor steps.
    """

    def __init__(self, roles: Roles, replay: Replay, sink: VariableSink, update_period: int, run: int,
                 timeout_s: float, carrier: Carrier | None = None) -> None:
        self.roles, self.replay, self.sink = roles, replay, sink
        self.actor_id, self.num_actors = roles.index, roles.actors
        self.is_evaluator = roles.role == "evaluator"
        self.seed = replay.seed * 10_000 + 1 + self.actor_id
        self.update_period, self.run, self.timeout_s = update_period, run, timeout_s
        self.version = -1
        self.env_steps = 0
        self.who = roles.describe()
        self._done = False
        self._checked = self._stored = time.monotonic()
        self._live = list(range(roles.actors))
        self._fed = shards_fed_by(self.actor_id, self._live, roles.learners)
        self._gamma = replay.discount
        self._adder = NStepAdder(replay.n_step, replay.discount) if replay.n_step > 1 else None
        self._adders: list[NStepAdder] = []  # one per environment of add_batch(), for N-step transitions
        self._spec: TransitionSpec | None = None
        self._turn = 0
        self.started = time.monotonic()
        self._acting_since = timeline.clock()  # the end of this actor's last add() or weight pull (its timeline)
        self.figures: dict[str, Any] = {"transitions_sent": 0, "pulls": 0, "pull_seconds": 0.0, "wait_seconds": 0.0}
        rank, role = roles.rank, roles.describe()
        self._credit = threading.Condition()
        carrier = carrier or Carrier(timeout_s=timeout_s)
        self._links = [InsertLink(learner, carrier.connect(run, learner, INSERTS, rank=rank, role=role), self._credit)
                       for learner in range(roles.learners)]
        self._columns: list[Columns] = []
        for link in self._links:
            link.connection.send(exchange.JOIN, [torch.tensor([self.actor_id, run, 0], dtype=torch.int64)])
        self._weights = WeightsLink(carrier.connect(run, self.actor_id % roles.learners, WEIGHTS, rank=rank,
                                                    role=role), sink.flats, timeout_s)
        self.transport = self._links[0].connection.transport  # unix, tcp or gloo

    # -- what actor_fn calls -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True until the learners finish their steps; raises ActorLearnerError when another process failed.
        Sends what this actor has staged, if it waited long enough."""
        if self._done:
            return False
        now = time.monotonic()
        for link, columns in zip(self._links, self._columns, strict=False):
            if columns.count and now - link.last_flush >= FLUSH_S:
                self._flush(link, columns)
        self._look(now)
        return not self._done

    def add(self, observation: Any, action: Any, reward: Any, next_observation: Any, terminated: Any = False,
            truncated: Any = False) -> None:
        """One environment step. Completed N-step transitions are staged and streamed to a learner's replay shard;
        this waits while the actors run ahead of the rate limiter, and every `update_period` steps it loads the
        newest weights into this process's modules. After the run (running False) it does nothing."""
        if self.is_evaluator:
            raise ReplicatorUsageError(f"{self.who}: the evaluator does not add() experience; it runs episodes "
                                       "with actor.update_weights() and reads actor.counters()")
        if self._done:
            return
        recording = timeline.active()
        if recording is not None:  # what actor_fn did since its last call here: act, and step the environment
            recording.add("env step", "actor", self._acting_since, timeline.clock(), args={"env_step": self.env_steps})
        reward_value = reward if type(reward) is float else self._scalar(reward, "reward")
        ended = terminated if type(terminated) is bool else bool(self._scalar(terminated, "terminated"))
        cut = truncated if type(truncated) is bool else bool(self._scalar(truncated, "truncated"))
        if self._spec is None:
            self._first(observation, action, next_observation)
        if self._adder is None:  # one-step transitions go straight into the columns
            self._stage(observation, action, reward_value, 0.0 if ended else self._gamma, next_observation)
        else:
            obs, act, next_obs = (self._checked_tensor(v, f) for v, f in ((observation, "observation"),
                                  (action, "action"), (next_observation, "next_observation")))
            for transition in self._adder.add(obs, act, reward_value, next_obs, ended, cut):
                self._stage(transition.observation, transition.action, transition.reward, transition.discount,
                            transition.next_observation)
        self.env_steps += 1
        self._after_steps(1)
        if recording is not None:
            self._acting_since = timeline.clock()

    def add_batch(self, observation: Any, action: Any, reward: Any, next_observation: Any, terminated: Any = False,
                  truncated: Any = False) -> None:
        """One step of a vectorized environment: row i of every argument is environment i's step (as `add()` takes
        them, with a leading dimension B; `terminated` and `truncated` are B flags or one for all). Counts B env
        steps; N-step transitions are assembled per environment, so B must stay the same throughout."""
        if self.is_evaluator:
            raise ReplicatorUsageError(f"{self.who}: the evaluator does not add_batch() experience")
        if self._done:
            return
        obs = as_tensor(observation, "observation", self.who)
        if obs.dim() == 0:
            raise ReplicatorUsageError(f"{self.who}: actor.add_batch(observation=...) needs a leading dimension (one "
                                       "row per environment); use actor.add() for a single environment")
        count = obs.shape[0]
        act = as_tensor(action, "action", self.who)
        next_obs = as_tensor(next_observation, "next_observation", self.who)
        rewards = self._rows(reward, "reward", count).to(torch.float32)
        ended = self._rows(terminated, "terminated", count).to(torch.bool)
        cut = self._rows(truncated, "truncated", count).to(torch.bool)
        for field, tensor in (("action", act), ("next_observation", next_obs)):
            if tensor.dim() == 0 or tensor.shape[0] != count:
                raise ReplicatorUsageError(f"{self.who}: actor.add_batch({field}=...) has shape {tuple(tensor.shape)}; "
                                           f"it needs {count} rows, one per environment, as the observation has")
        if self._spec is None:
            self._first(obs[0], act[0], next_obs[0])
        assert self._spec is not None
        for field, tensor in (("observation", obs), ("action", act), ("next_observation", next_obs)):
            self._spec.check(field, tensor[0], self.who, self._source)
            if tuple(tensor.shape[1:]) != tuple(tensor[0].shape):
                raise ReplicatorUsageError(f"{self.who}: actor.add_batch({field}=...) rows differ in shape")
        if self._adder is None:
            discount = torch.where(ended, 0.0, self._gamma).to(torch.float32)
            start = 0
            while start < count:  # into the columns as free rows allow, waiting for credit between pieces
                link, columns = self._target()
                take = min(count - start, columns.free)
                columns.put_rows(obs[start:start + take], act[start:start + take], rewards[start:start + take],
                                 discount[start:start + take], next_obs[start:start + take])
                start += take
                self._staged(link, columns)
        else:
            if not self._adders:
                self._adders = [NStepAdder(self.replay.n_step, self._gamma) for _ in range(count)]
            if len(self._adders) != count:
                raise ReplicatorUsageError(f"{self.who}: actor.add_batch() got {count} environments after "
                                           f"{len(self._adders)}: with n_step > 1 their number must stay the same")
            for row, adder in enumerate(self._adders):
                for transition in adder.add(obs[row], act[row], float(rewards[row]), next_obs[row], bool(ended[row]),
                                            bool(cut[row])):
                    self._stage(transition.observation, transition.action, transition.reward, transition.discount,
                                transition.next_observation)
        self.env_steps += count
        self._after_steps(count)

    def update_weights(self) -> None:
        """Pull the learners' newest weights into this process's modules now (at most one learner step old)."""
        with timeline.span("weight pull", "actor", env_step=self.env_steps):
            started = time.monotonic()
            if self._weights.asked is not None:  # a pull already in flight: take it, then ask afresh
                self._load(self._weights_reply())
            self._weights.ask(self.actor_id, self.version, self.sink.layout.checksum)
            self._load(self._weights_reply())
            self.figures["pull_seconds"] += time.monotonic() - started
        self._acting_since = timeline.clock()

    def end_run(self, reason: str = "") -> None:
        """Ask the learners to end this run early, as if its `steps` were reached (e.g. the evaluator saw the
        target return): they stop within a few steps, all at the same one, and `running` turns False everywhere.
        `reason` goes into the learners' `repl.last_run["actor_learner"]["ended"]` and their log line."""
        text = f"{self.who} asked to end the run" + (f": {reason}" if reason else "")
        try:
            exchange.store().compare_set(exchange.Keys.end_request(self.run), "", text)  # the first request wins
        except RuntimeError as error:
            raise ActorLearnerError(f"{self.who}: the job's store is gone ({error}): the learners ended") from error

    def counters(self) -> dict[str, Any]:
        """The job's figures as the learners last published them (twice a second): env steps (all actors, as of
        their last pulls), learner steps, realised samples per insert and the policy lag at insert."""
        store = exchange.store()
        env_steps = 0
        for actor in range(self.roles.actors):
            key = exchange.Keys.env_steps(actor)
            if actor == self.actor_id:
                env_steps += self.env_steps
            elif store.check([key]):
                env_steps += int(store.get(key).decode("ascii"))
        steps, inserts, samples, past_min = 0, 0, 0, 0
        histogram = torch.zeros(exchange.LAG_BINS + 1, dtype=torch.int64)
        for learner in range(self.roles.learners):
            key = exchange.Keys.learner(learner)
            if not store.check([key]):
                continue
            numbers, _, lags = store.get(key).decode("ascii").partition("|")
            fields = numbers.split()
            steps = max(steps, int(fields[0]))
            inserts, samples, past_min = inserts + int(fields[1]), samples + int(fields[2]), past_min + int(fields[3])
            for pair in filter(None, lags.split(",")):
                lag, _, count = pair.partition(":")
                histogram[int(lag)] += int(count)
        return {"env_steps": env_steps, "learner_steps": steps, "inserts": inserts, "samples": samples,
                "samples_per_insert": samples / past_min if past_min else None,
                "policy_lag": exchange.lag_summary(histogram), "seconds": time.monotonic() - self.started}

    # -- inside --------------------------------------------------------------------------------------
    def _after_steps(self, count: int) -> None:
        """Pulls: the one due at an update point is loaded there (asked for one env step before)."""
        period, steps = self.update_period, self.env_steps
        if self._done:
            return
        if steps // period > (steps - count) // period:
            started = time.monotonic()
            for link, columns in zip(self._links, self._columns, strict=False):
                if columns.count:  # a chunk carries one weights version: what was staged with the old weights
                    self._flush(link, columns)
            with timeline.span("weight pull", "actor", env_step=steps):
                if self._weights.asked is None:
                    self._weights.ask(self.actor_id, self.version, self.sink.layout.checksum)
                self._load(self._weights_reply())
            self.figures["pull_seconds"] += time.monotonic() - started
        if (steps + 1) // period > steps // period and self._weights.asked is None:
            self._weights.ask(self.actor_id, self.version, self.sink.layout.checksum)  # due at the next step

    def _weights_reply(self) -> Any:
        try:
            return self._weights.reply()
        except PeerLinkError as error:
            raise self._gone(self.actor_id % self.roles.learners, error) from error

    def _load(self, reply: Any) -> None:
        if reply.kind == exchange.LAYOUT:
            raise ReplicatorUsageError(self._layout_difference())
        if reply.kind == exchange.WEIGHTS:
            self.sink.load()
            self.version = int(reply.request)
        self.figures["pulls"] += 1
        now = time.monotonic()
        if now - self._stored > STEPS_EVERY_S or self.figures["pulls"] == 1:
            self._stored = now
            try:
                exchange.store().set(exchange.Keys.env_steps(self.actor_id), str(self.env_steps))
            except RuntimeError:
                pass  # only the counters miss it

    def _first(self, observation: Any, action: Any, next_observation: Any) -> None:
        """The first transition: agree the job's format in the store and make the columns."""
        obs = as_tensor(observation, "observation", self.who)
        act = as_tensor(action, "action", self.who)
        mine = TransitionSpec.of(obs, act, self.who)
        mine.check("next_observation", as_tensor(next_observation, "next_observation", self.who), self.who,
                   "this actor's first observation")
        # The first transition of the job fixes the format for every actor and shard.
        winner = exchange.store().compare_set(exchange.Keys.spec, "", mine.encode()).decode("ascii")
        self._spec = TransitionSpec.decode(winner)
        self._source = "the job's first transition" if winner != mine.encode() else "this actor's first transition"
        for field, tensor in (("observation", obs), ("action", act)):
            self._spec.check(field, tensor, self.who, self._source)
        rows = chunk_rows(self._spec)
        self._columns = [Columns(self._spec, rows, self.who, self._source) for _ in self._links]

    def _checked_tensor(self, value: Any, field: str) -> torch.Tensor:
        tensor = as_tensor(value, field, self.who)
        assert self._spec is not None
        self._spec.check(field, tensor, self.who, self._source)
        return tensor

    def _scalar(self, value: Any, field: str) -> float:
        if type(value) in (int, bool, np.float32, np.float64, np.bool_):
            return float(value)
        tensor = as_tensor(value, field, self.who)
        if tensor.numel() != 1:
            raise ReplicatorUsageError(f"{self.who}: actor.add({field}=...) has shape {tuple(tensor.shape)}; it must "
                                       "be one number per environment step")
        return float(tensor.reshape(()).item())

    def _rows(self, value: Any, field: str, count: int) -> torch.Tensor:
        tensor = as_tensor(value, field, self.who).reshape(-1)
        if tensor.numel() == 1:
            return tensor.expand(count)
        if tensor.numel() != count:
            raise ReplicatorUsageError(f"{self.who}: actor.add_batch({field}=...) has {tensor.numel()} values for "
                                       f"{count} environments: pass one per environment (or one for all)")
        return tensor

    def _target(self) -> tuple[InsertLink, Columns]:
        """The learner whose columns take the next transition: the one this actor feeds, or, when it feeds several,
        the next in turn that has credit for it."""
        live = self._live_actors()
        if live != self._live:
            self._live, self._fed = live, shards_fed_by(self.actor_id, live, self.roles.learners)
        fed = self._fed
        if len(fed) == 1:
            return self._links[fed[0]], self._columns[fed[0]]
        for offset in range(len(fed)):
            shard = fed[(self._turn + offset) % len(fed)]
            if self._links[shard].credit > self._columns[shard].count:
                self._turn += offset + 1
                return self._links[shard], self._columns[shard]
        shard = fed[self._turn % len(fed)]
        self._turn += 1
        return self._links[shard], self._columns[shard]

    def _live_actors(self) -> list[int]:
        """The actors every learner still holds alive (as of their last credits)."""
        heard = [link.live for link in self._links if link.live is not None and link.error is None]
        if not heard:
            return self._live
        live = [a for a in range(self.roles.actors) if all(a in lives for lives in heard)]
        return live or self._live

    def _stage(self, observation: Any, action: Any, reward: float, discount: float, next_observation: Any) -> None:
        link, columns = self._target()
        columns.put(observation, action, reward, discount, next_observation)
        self._staged(link, columns)

    def _staged(self, link: InsertLink, columns: Columns) -> None:
        """Send when a chunk is full, when this actor is out of credit, or when the oldest staged row has waited
        FLUSH_S; wait for credit while rows are staged that it may not send (the limiter's back pressure)."""
        count = columns.count
        if count < columns.rows and count <= link.credit and time.monotonic() - link.last_flush < FLUSH_S:
            return
        self._flush(link, columns)
        if columns.count and (columns.free == 0 or columns.count > link.credit):
            self._wait_for_credit(link, columns)

    def _flush(self, link: InsertLink, columns: Columns) -> None:
        count = min(columns.count, link.credit)
        if count <= 0:
            link.last_flush = time.monotonic()
            return
        meta = torch.tensor([count, self.version, self.env_steps], dtype=torch.int64)
        with timeline.span("send transitions", "actor", transitions=count):
            try:
                link.send_chunk(meta, columns.chunk(count), count)
            except PeerLinkError as error:
                raise self._gone(link.learner, error) from error
        columns.drop(count)
        self.figures["transitions_sent"] += count

    def _wait_for_credit(self, link: InsertLink, columns: Columns) -> None:
        """Wait until some learner this actor feeds grants room for what is staged, and send it there (when actors
        die, an actor may come to feed several shards: rows staged for one go to whichever has room first)."""
        started = time.monotonic()
        with timeline.span("wait for credit", "actor"):
            while columns.count and not self._done:
                self._target()  # the shards this actor feeds, as of the learners' last word
                links = [self._links[shard] for shard in self._fed] or [link]
                with self._credit:
                    if all(x.credit <= 0 and x.error is None and not x.done and not x.aborted for x in links):
                        self._credit.wait(0.05)
                for candidate in links:
                    if candidate.error is not None:
                        raise self._gone(candidate.learner, candidate.error)
                self._look(time.monotonic())
                for candidate in links:
                    if columns.count and candidate.credit > 0:
                        self._flush(candidate, columns)
                if columns.count and time.monotonic() - started > self.timeout_s:
                    raise ActorLearnerError(
                        f"{self.who}: learner(s) {[x.learner for x in links]} granted no room in their replay for "
                        f"{self.timeout_s:.0f} s (REPLICATOR_TIMEOUT): is one stuck in a step?")
        self.figures["wait_seconds"] += time.monotonic() - started

    def _look(self, now: float) -> None:
        """The learners' word on the run (their credits), and the job's store every STORE_EVERY_S."""
        if any(link.aborted for link in self._links):
            self._raise_if_aborted()
        if any(link.done for link in self._links):
            self._done = True
        if now - self._checked > STORE_EVERY_S:
            self._checked = now
            self._raise_if_aborted()
            try:
                self._done = self._done or bool(exchange.store().check([exchange.Keys.done(self.run)]))
            except RuntimeError as error:
                raise ActorLearnerError(f"{self.who}: the job's store is gone ({error}): the learners ended") from error

    def say_goodbye(self) -> None:
        """Tell every learner that this actor_fn returned, so the learners' end of run does not wait for it."""
        for link in self._links:
            try:
                link.connection.send(exchange.BYE, [torch.tensor([self.env_steps], dtype=torch.int64)])
            except PeerLinkError:
                pass  # that learner is gone already
        self.close(goodbye=True)

    def close(self, goodbye: bool = False) -> None:
        for link in self._links:
            link.close()
        self._weights.close(goodbye)

    def pull_latencies(self) -> list[float]:
        """Seconds from each weight pull's request to its reply (for benchmarks)."""
        return list(self._weights.latencies)

    def _raise_if_aborted(self) -> None:
        message = exchange.read_abort()
        if message is not None:
            raise ActorLearnerError(f"{self.who} stops: {message}")

    def _gone(self, learner: int, error: BaseException) -> ActorLearnerError:
        message = exchange.read_abort()
        if message is not None:
            return ActorLearnerError(f"{self.who} stops: {message}")
        return ActorLearnerError(f"{self.who}: learner {learner} (rank {learner}) stopped answering ({error}); see "
                                 "that learner's error or exit status")

    def _layout_difference(self) -> str:
        mine = self.sink.layout.described
        try:
            theirs = exchange.store().get(exchange.Keys.layout).decode("utf-8").split("\n")
        except RuntimeError:
            theirs = []
        first = next((f"{m!r} here, {t!r} on the learners" for m, t in zip(mine, theirs, strict=False) if m != t),
                     f"{len(mine)} tensors here, {len(theirs)} on the learners")
        return (f"{self.who}: the modules built in repl.scope() differ from the learners' ({first}): every process "
                "must build the same modules, since actors load the learners' weights into theirs")
