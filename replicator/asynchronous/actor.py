"""rp.ActorContext: what an actor's (or the evaluator's) `actor_fn` gets: add() experience, pull weights, counters."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from replicator.asynchronous import exchange, wire
from replicator.asynchronous.nstep import NStepAdder
from replicator.asynchronous.replay import Replay
from replicator.asynchronous.roles import Roles, shards_fed_by
from replicator.asynchronous.transitions import Transition, TransitionSpec, as_tensor
from replicator.asynchronous.variables import VariableSink
from replicator.comm.store import job_store
from replicator.errors import ReplicatorError, ReplicatorUsageError
from replicator.timeline import recorder as timeline

__all__ = ["ActorContext", "ActorLearnerError"]


class ActorLearnerError(ReplicatorError):
    """Another process of an actor–learner job failed (or every actor stopped): raised on every process, with the
    first failure's own message."""


class ActorContext:
    """Handed to `actor_fn` on actors and on the evaluator.

    `actor_id` (0 .. num_actors - 1; the evaluator's is num_actors), `num_actors`, `is_evaluator`,
    `seed` (distinct per actor, from Replay.seed; torch's generator is seeded with it too),
    `version` (the learner step of the weights in this process's modules), `env_steps` (this
    actor's add() calls) and `running` (False once the learners have finished: return then).
    """

    def __init__(self, roles: Roles, everyone: dist.ProcessGroup, replay: Replay, sink: VariableSink,
                 update_period: int, run: int) -> None:
        self.roles, self.everyone, self.replay, self.sink = roles, everyone, replay, sink
        self.actor_id, self.num_actors = roles.index, roles.actors
        self.is_evaluator = roles.role == "evaluator"
        self.seed = replay.seed * 10_000 + 1 + self.actor_id
        self.update_period, self.run = update_period, run
        self.version = -1
        self.env_steps = 0
        self.who = roles.describe()
        self._done = False
        self._checked = time.monotonic()
        self._live = list(range(roles.actors))
        self._tickets = [wire.Tickets(learner) for learner in range(roles.learners)]
        self._adder = NStepAdder(replay.n_step, replay.discount)
        self._spec: TransitionSpec | None = None
        self._turn = 0
        self._blocked: set[int] = set()  # shards whose limiter last said this actor runs ahead
        self._polled = 0.0
        self.started = time.monotonic()
        self._acting_since = timeline.clock()  # the end of this actor's last add() or weight pull (its timeline)
        self.figures = {"transitions_sent": 0, "pulls": 0, "pull_seconds": 0.0, "wait_seconds": 0.0}

    # -- what actor_fn calls -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True until the learners finish their steps (checked through the job's store at most 5 times a second
        between requests); raises ActorLearnerError when another process failed."""
        now = time.monotonic()
        if not self._done and now - self._checked > 0.2:
            self._checked = now
            self._raise_if_aborted()
            try:
                self._done = bool(job_store().check([exchange.Keys.done(self.run)]))
            except RuntimeError as error:
                raise ActorLearnerError(f"{self.who}: the job's store is gone ({error}): the learners ended") from error
        return not self._done

    def add(self, observation: Any, action: Any, reward: Any, next_observation: Any, terminated: Any = False,
            truncated: Any = False) -> None:
        """One environment step. Completed N-step transitions go to a learner's replay shard; this waits while
        the actors run ahead of the rate limiter, and every `update_period` steps it pulls the newest weights
        into this process's modules. After the run (running False) it does nothing."""
        if self.is_evaluator:
            raise ReplicatorUsageError(f"{self.who}: the evaluator does not add() experience; it runs episodes "
                                       "with actor.update_weights() and reads actor.counters()")
        if self._done:
            return
        recording = timeline.active()
        if recording is not None:  # what actor_fn did since its last call here: act, and step the environment
            recording.add("env step", "actor", self._acting_since, timeline.clock(), args={"env_step": self.env_steps})
        obs = as_tensor(observation, "observation", self.who)
        act = as_tensor(action, "action", self.who)
        next_obs = as_tensor(next_observation, "next_observation", self.who)
        reward_value = self._scalar(reward, "reward")
        ended = [bool(self._scalar(flag, name)) for name, flag in (("terminated", terminated),
                                                                     ("truncated", truncated))]
        self._check_spec(obs, act, next_obs)
        transitions = self._adder.add(obs, act, reward_value, next_obs, *ended)
        self.env_steps += 1
        if transitions:
            with timeline.span("send transitions", "actor", transitions=len(transitions)):
                self._send(transitions)
        if self.env_steps % self.update_period == 0 and not self._done:
            self.update_weights()
        if recording is not None:
            self._acting_since = timeline.clock()

    def update_weights(self) -> None:
        """Pull the learners' newest weights into this process's modules now (never waits for a learner step)."""
        with timeline.span("weight pull", "actor", env_step=self.env_steps):
            self._pull_weights()
        self._acting_since = timeline.clock()

    def _pull_weights(self) -> None:
        started = time.monotonic()
        learner = self.actor_id % self.roles.learners
        while True:
            reply = self._request(learner, exchange.PULL)
            status, version = int(reply[0]), int(reply[1])
            if status == exchange.LAYOUT:
                raise ReplicatorUsageError(self._layout_difference())
            if version >= 0:
                try:
                    for flat in self.sink.flats:
                        dist.recv(flat, src=learner, group=self.everyone, tag=wire.TAG_REPLY)
                except RuntimeError as error:
                    raise self._gone(learner, error) from error
                self.sink.load()
                self.version = version
                break
        self.figures["pulls"] += 1
        self.figures["pull_seconds"] += time.monotonic() - started
        try:
            job_store().set(exchange.Keys.env_steps(self.actor_id), str(self.env_steps))
        except RuntimeError:
            pass  # only the counters miss it

    def end_run(self, reason: str = "") -> None:
        """Ask the learners to end this run early, as if its `steps` were reached (e.g. the evaluator saw the
        target return): they stop within a few steps, all at the same one, and `running` turns False everywhere.
        `reason` goes into the learners' `repl.last_run["actor_learner"]["ended"]` and their log line."""
        text = f"{self.who} asked to end the run" + (f": {reason}" if reason else "")
        try:
            job_store().compare_set(exchange.Keys.end_request(self.run), "", text)  # the first request wins
        except RuntimeError as error:
            raise ActorLearnerError(f"{self.who}: the job's store is gone ({error}): the learners ended") from error

    def counters(self) -> dict[str, Any]:
        """The job's figures as the learners last published them (twice a second): env steps (all actors, as of
        their last pulls), learner steps, realised samples per insert and the policy lag at insert."""
        store = job_store()
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
    def _scalar(self, value: Any, field: str) -> float:
        tensor = as_tensor(value, field, self.who)
        if tensor.numel() != 1:
            raise ReplicatorUsageError(f"{self.who}: actor.add({field}=...) has shape {tuple(tensor.shape)}; it must "
                                       "be one number per environment step")
        return float(tensor.reshape(()).item())

    def _check_spec(self, obs: torch.Tensor, act: torch.Tensor, next_obs: torch.Tensor) -> None:
        if self._spec is None:
            mine = TransitionSpec.of(obs, act, self.who)
            mine.check("next_observation", next_obs, self.who, "this actor's first observation")
            # The first transition of the job fixes the format for every actor and shard.
            winner = job_store().compare_set(exchange.Keys.spec, "", mine.encode()).decode("ascii")
            self._spec = TransitionSpec.decode(winner)
            self._source = "the job's first transition" if winner != mine.encode() else "this actor's first transition"
        for field, tensor in (("observation", obs), ("action", act), ("next_observation", next_obs)):
            self._spec.check(field, tensor, self.who, self._source)

    def _send(self, transitions: list[Transition]) -> None:
        """Send to the shards this actor feeds, preferring those whose limiter lets it go on; wait while none does."""
        assert self._spec is not None
        if self._blocked and time.monotonic() - self._polled > 0.02:
            self._poll(sorted(self._blocked))  # a shard that was ahead may have caught up since
        batches: dict[int, list[Transition]] = {}
        for transition in transitions:
            fed = self._fed()
            open_shards = [s for s in fed if s not in self._blocked] or fed
            batches.setdefault(open_shards[self._turn % len(open_shards)], []).append(transition)
            self._turn += 1
        for learner, items in batches.items():
            self._note(learner, self._request(learner, exchange.INSERT, self._spec.pack(items), len(items)))
            self.figures["transitions_sent"] += len(items)
        started = time.monotonic()
        while not self._done and self._blocked.issuperset(fed := self._fed()):
            if len(fed) == 1:  # the learner holds the answer until this actor may go on (or a second passed)
                self._note(fed[0], self._request(fed[0], exchange.WAIT, count=1))
            else:  # several shards: ask each without being held, so the first that catches up frees this actor
                self._poll(fed)
                time.sleep(0.002)
        self.figures["wait_seconds"] += time.monotonic() - started

    def _fed(self) -> list[int]:
        return shards_fed_by(self.actor_id, self._live, self.roles.learners)

    def _poll(self, shards: list[int]) -> None:
        for learner in shards:
            self._note(learner, self._request(learner, exchange.WAIT, count=0))
        self._polled = time.monotonic()

    def _note(self, learner: int, reply: torch.Tensor) -> None:
        if int(reply[3]):
            self._blocked.discard(learner)
        else:
            self._blocked.add(learner)

    def _request(self, learner: int, kind: int, payload: torch.Tensor | None = None,
                 count: int = 0) -> torch.Tensor:
        header = torch.tensor([kind, self.actor_id, self.version, self.env_steps, count,
                               self.sink.layout.checksum], dtype=torch.int64)
        reply = torch.empty(exchange.reply_size(self.roles.others), dtype=torch.int64)
        try:
            self._tickets[learner].post(self.actor_id)
            dist.send(header, dst=learner, group=self.everyone, tag=wire.TAG_REQUEST)
            if payload is not None:
                dist.send(payload, dst=learner, group=self.everyone, tag=wire.TAG_REQUEST)
            if kind == exchange.BYE:
                return reply
            dist.recv(reply, src=learner, group=self.everyone, tag=wire.TAG_REPLY)
        except RuntimeError as error:
            raise self._gone(learner, error) from error
        if int(reply[0]) == exchange.ABORTED:
            self._raise_if_aborted()
        self._done = self._done or bool(reply[2])
        live = [a for a in range(self.roles.actors) if int(reply[exchange.REPLY_FIXED + a])]
        self._live = live or self._live
        return reply

    def say_goodbye(self) -> None:
        """Tell every learner that this actor_fn returned, so the learners' end of run does not wait for it."""
        for learner in range(self.roles.learners):
            try:
                self._request(learner, exchange.BYE)
            except ActorLearnerError:
                pass  # that learner is gone already

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
            theirs = job_store().get(exchange.Keys.layout).decode("utf-8").split("\n")
        except RuntimeError:
            theirs = []
        first = next((f"{m!r} here, {t!r} on the learners" for m, t in zip(mine, theirs, strict=False) if m != t),
                     f"{len(mine)} tensors here, {len(theirs)} on the learners")
        return (f"{self.who}: the modules built in repl.scope() differ from the learners' ({first}): every process "
                "must build the same modules, since actors load the learners' weights into theirs")
