"""The actor–learner regime as the facade sees it: learners train on the replay, actors and the evaluator run actor_fn.

See docs/concepts/asynchronous.md. On a learner, `repl.run(step_fn, repl.prepare_input(replay), steps=N)`
is the synchronous loop over the learners, fed by this learner's replay shard; a service thread
meanwhile receives the actors' transitions and answers their weight pulls. On an actor or the
evaluator, run() calls `actor_fn(actor)` once with an rp.ActorContext and yields nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from replicator import checkpoint
from replicator.asynchronous.actor_learner import exchange, heartbeats
from replicator.asynchronous.actor_learner.actor import ActorContext, ActorLearnerError
from replicator.asynchronous.actor_learner.carrier import Carrier
from replicator.asynchronous.actor_learner.replay import Replay, ReplaySample
from replicator.asynchronous.actor_learner.roles import Roles
from replicator.asynchronous.actor_learner.service import LearnerService
from replicator.asynchronous.actor_learner.variables import VariableSink, VariableSource
from replicator.asynchronous.regime import Regime
from replicator.comm.gloo_peer import use_sockets
from replicator.comm.peer_link import PeerLinkError
from replicator.context import InputContext
from replicator.epochs import InputPosition
from replicator.errors import ReplicatorUsageError
from replicator.job import Job
from replicator.scope import ModelScope
from replicator.sync.optimizer import SyncedOptimizers
from replicator.telemetry import StepTimes
from replicator.timeline import recorder as timeline

__all__ = ["ActorLearnerRegime", "ActorFn", "Roles", "serves_this_run"]

ActorFn = Callable[[ActorContext], Any]


class ActorLearnerRegime(Regime):
    """Learners, actors and an optional evaluator over one job (Roles)."""

    def __init__(self, roles: Roles, job: Job, optimizers: SyncedOptimizers, models: ModelScope,
                 position: InputPosition) -> None:
        self.roles, self.job, self.optimizers, self.models, self.position = roles, job, optimizers, models, position
        self.role = roles.role
        self.serves = self.role != "learner"  # actors and the evaluator run actor_fn instead of steps
        self.restores = not self.serves  # actors take the learners' weights, never a checkpoint
        self.replay: Replay | None = None
        self.actor_fn: ActorFn | None = None
        self.update_period = 1
        self.runs = 0
        self.variables: VariableSource | None = None
        self.service: LearnerService | None = None
        self.stopped: str | None = None  # why this learner's replay stopped giving batches
        self.drawn = 0  # batches this learner's sampler gave in this run
        self.end_at: int | None = None  # the batch count where the run ends early (ActorContext.end_run)
        self.ended: str | None = None  # who asked for that, and why
        self.steps: int | None = None
        self.sample_wait_s = 0.0
        self._heartbeat: heartbeats.Heartbeat | None = None
        if self.serves:  # from the start, so learners can tell an actor still building its model from a dead one
            self._heartbeat = heartbeats.Heartbeat(roles.index)
            self._heartbeat.start()
        # Sockets or Gloo, decided by the whole job together (collective: every process makes its regime here).
        self.carrier = Carrier(roles, use_sockets(self.everyone), job.timeout_s)
        if roles.rank == 0:  # for rp.join_actor, which needs sockets
            exchange.store().set(exchange.Keys.transport, self.carrier.transport)
        job.close_with(self)

    @property
    def everyone(self) -> dist.ProcessGroup:
        everyone = self.job.groups.everyone
        assert everyone is not None  # Roles.of refuses a job of one process
        return everyone

    def input_fn(self, input_fn: Callable[[InputContext], Iterable[Any]]) -> Callable[[InputContext], Iterable[Any]]:
        """`repl.prepare_input(replay)`: learners read their replay shard; actors and the evaluator read nothing."""
        if not isinstance(input_fn, Replay):
            raise ReplicatorUsageError(
                f"mode='actor_learner' learns from a replay (raised on {self.roles.describe()}): build "
                "replay = rp.Replay(...) on every process and pass repl.prepare_input(replay) to run()")
        self.replay = input_fn
        input_fn.shard_shape(self.roles.learners)  # a batch that does not split raises here, on every process
        if self.serves:
            return lambda context: []
        input_fn.bind(self.roles.learners, self.roles.index)
        return lambda context: _Batches(self)

    def configure(self, actor_fn: ActorFn | None, update_period: int, steps: int | None) -> None:
        if actor_fn is None or not callable(actor_fn):
            raise ReplicatorUsageError(
                f"mode='actor_learner' needs run(..., actor_fn=fn) on every process (raised on "
                f"{self.roles.describe()}): actors and the evaluator call fn(actor) to step their environments")
        if update_period < 1:
            raise ReplicatorUsageError(f"run(update_period={update_period}) must be at least 1 (env steps between "
                                       "an actor's weight pulls)")
        if steps is None:
            raise ReplicatorUsageError("mode='actor_learner' needs run(steps=N): the learners' steps end the run "
                                       "(a replay has no epochs)")
        self.actor_fn, self.update_period, self.steps = actor_fn, update_period, steps

    # -- actors and the evaluator ------------------------------------------------------------------
    def serve(self) -> dict[str, Any]:
        """An actor's (or the evaluator's) whole run(): pull the weights, call actor_fn, say goodbye."""
        self.runs += 1
        if self.replay is None:
            raise ReplicatorUsageError(f"{self.roles.describe()}: run() got no replay; pass "
                                       "repl.prepare_input(replay) to run() on every process, actors included")
        sink = VariableSink(self.models.modules)
        try:
            actor = ActorContext(self.roles, self.replay, sink, self.update_period, self.runs, self.job.timeout_s,
                                 self.carrier)
        except PeerLinkError as error:
            message = exchange.read_abort()
            raise ActorLearnerError(f"{self.roles.describe()} stops: {message}" if message else
                                    f"{self.roles.describe()} could not reach the learners: {error}") from error
        torch.manual_seed(actor.seed)  # exploration noise differs between actors, however the script seeded
        try:
            assert self.actor_fn is not None
            with timeline.span("actor", "actor"):  # its first weight pull, then actor_fn
                actor.update_weights()
                self.actor_fn(actor)
        except ActorLearnerError:
            actor.close()
            raise  # another process's failure, relayed: its own message says what happened
        except BaseException as error:
            exchange.post_abort(f"{type(error).__name__} on {actor.who}: {error}")
            actor.close()
            raise
        actor.say_goodbye()
        return {"actor_learner": {"role": self.role, "actor": actor.actor_id, "env_steps": actor.env_steps,
                                  "transport": actor.transport,
                                  "version": actor.version, "seconds": time.monotonic() - actor.started,
                                  **actor.figures}}

    # -- learners ------------------------------------------------------------------------------------
    def begin(self, on_wait: Callable[[float], None]) -> None:
        """Before a learner's first step: publish the weights and start answering the actors."""
        self.runs += 1
        replay = self.replay
        if replay is None or replay.shard is None:
            raise ReplicatorUsageError(f"{self.roles.describe()}: mode='actor_learner' trains on "
                                       "repl.prepare_input(replay); pass that to run()")
        self.position.pending = None  # a replay has no place to resume in: a restored run refills it
        if self.variables is None:
            self.variables = VariableSource(self.models.modules)
            if self.roles.index == 0:
                exchange.store().set(exchange.Keys.layout, "\n".join(self.variables.layout.described))
        with timeline.span("publish weights", "learner", step=self.optimizers.state.step):
            self.variables.publish(self.optimizers.state.step, force=True)  # the actors' first pull takes it at once
        self.stopped, self.sample_wait_s = None, 0.0
        self.drawn, self.end_at, self.ended = 0, None, None
        self.service = LearnerService(self.roles, self.runs, replay.shard, self.variables, self.job.timeout_s,
                                      self.carrier)
        self.service.start()
        if self.roles.index == 0:
            # For an actor that joins the running job (asynchronous.joining): the shape, then the run to join.
            roles = self.roles
            exchange.store().set(exchange.Keys.shape, f"{roles.learners} {roles.actors} {int(roles.evaluator)}")
            exchange.store().set(exchange.Keys.run, str(self.runs))
        self.started, self.first_step = time.monotonic(), self.optimizers.state.step

    def batches(self) -> Iterator[ReplaySample]:
        """This learner's batches: publish the weights of the step just done, then sample when the limiter allows."""
        replay, service, variables = self.replay, self.service, self.variables
        assert replay is not None and replay.shard is not None and service is not None and variables is not None
        shard = replay.shard
        while True:
            step = self.optimizers.state.step
            if variables.wanted:  # a copy only when an actor's pull waits for it
                with timeline.span("publish weights", "learner", step=step):
                    variables.publish(step)
            else:
                variables.step = step
            if self._ending():
                return
            gone = service.all_gone(deaths_only=True)  # else, without a limiter, they would train on old items forever
            if gone is not None:
                self._stop(gone)
                return
            with shard.lock:
                waited = time.monotonic()
                while not shard.limiter.can_sample(shard.batch_size) or service.abort or service.error:
                    reason = service.stop_reason()
                    if reason is not None:
                        self._stop(reason)
                        return
                    if self._ending():
                        return
                    shard.lock.wait(0.05)
                    if variables.wanted:  # a pull may wait while this learner waits for experience
                        with timeline.span("publish weights", "learner", step=step):
                            variables.publish(step)
                self.sample_wait_s += time.monotonic() - waited
                batch = shard.sample()
                service.sampled()
            self.drawn += 1
            yield batch

    def _ending(self) -> bool:
        """True once this learner has drawn the batches the run was cut to after an actor's end_run().

        The first learner to see the request fixes the cut a few batches past its own count in the
        store; the learners stay within one batch of each other (the step loop agrees one step
        ahead) and each looks before every draw, so all of them see the cut before reaching it and
        end at the same step, as when `steps` is reached. A single learner has nobody to agree with:
        it reads the request from its service, which looks in the store every 50 ms, and spares
        its step a store round trip.
        """
        if self.end_at is None:
            service = self.service
            if self.roles.learners == 1 and service is not None and not service.end_requested.is_set():
                return False
            store = exchange.store()
            request = exchange.Keys.end_request(self.runs)
            if not store.check([request]):
                return False
            cut = store.compare_set(exchange.Keys.end_at(self.runs), "", str(self.drawn + 3))
            self.end_at, self.ended = int(cut.decode("ascii")), store.get(request).decode("utf-8", "replace")
        return self.drawn >= self.end_at  # the step loop says why the run stopped (_Batches.end_reason)

    def _stop(self, reason: str) -> None:
        """No more batches: every process will raise the reason (the job's first failure wins)."""
        self.stopped = reason
        exchange.post_abort(f"{self.roles.describe()} stopped at step {self.optimizers.state.step}: {reason}")

    def finish(self, times: StepTimes, show: bool) -> dict[str, Any]:
        """After a learner's last step: release the actors, wait for them, gather the job's figures."""
        service = self.service
        assert service is not None
        try:
            exchange.store().set(exchange.Keys.done(self.runs), "1")
        except RuntimeError:
            pass  # the store left with its host; the actors see the learners leave
        service.finish()
        figures = self._figures(service)  # every learner, before any raises: none is left in the collective
        abort = exchange.read_abort()
        if abort is not None or self.stopped is not None:
            raise ActorLearnerError(f"{self.roles.describe()} stops: {abort or self.stopped}")
        if self.roles.index == 0 and figures["departed"]:
            listing = "; ".join(f"{self.roles.name(a)} {d['how']} after {d['env_steps']} env steps"
                                for a, d in figures["departed"].items())
            print(f"replicator: the run finished without {listing}", file=sys.stderr, flush=True)
        return {"actor_learner": figures}

    def _figures(self, service: LearnerService) -> dict[str, Any]:
        roles, limiter = self.roles, service.shard.limiter
        codes = {"died": 1, "hung": 2}
        sums = torch.tensor([limiter.inserts, limiter.samples, max(limiter.inserts - limiter.min_size, 0),
                             *service.histogram.tolist(), limiter.outside, *service.inserted], dtype=torch.int64)
        maxima = torch.tensor([*service.env_steps, *(codes.get(str(service.departed.get(a, {}).get("how")), 0)
                                                     for a in range(roles.others))], dtype=torch.int64)
        group = self.job.groups.replica_control
        if roles.learners > 1 and group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        inserts, samples, past_min = (int(v) for v in sums[:3])
        env_steps = maxima[:roles.others].tolist()
        how = {1: "died", 2: "hung"}
        departed = {a: {"how": how[code], "rank": roles.actor_rank(a), **service.departed.get(a, {}),
                        "env_steps": env_steps[a]} for a, code in enumerate(maxima[roles.others:].tolist()) if code}
        seconds = time.monotonic() - self.started
        steps = self.optimizers.state.step - self.first_step
        actors_env = sum(env_steps[:roles.actors])
        replay = self.replay
        assert replay is not None
        assert self.variables is not None
        return {"role": "learner", "learners": roles.learners, "actors": roles.actors, "evaluator": roles.evaluator,
                "outside_band": int(sums[3 + len(service.histogram)]), "weight_copies": self.variables.copies,
                "inserts_by_actor": sums[4 + len(service.histogram):].tolist(), "rejoined": service.rejoined,
                "learner_steps": steps, "learner_steps_per_second": steps / max(seconds, 1e-9),
                "env_steps": actors_env, "env_steps_per_second": actors_env / max(seconds, 1e-9),
                "inserts": inserts, "samples": samples, "samples_per_insert": samples / past_min if past_min else None,
                "target_samples_per_insert": replay.samples_per_insert,
                "policy_lag": exchange.lag_summary(sums[3:3 + len(service.histogram)]),
                "sample_wait_seconds": self.sample_wait_s,
                "seconds": seconds, "departed": departed, "ended": self.ended, "transport": self.carrier.transport}

    def save(self, path: str | os.PathLike[str], objects: dict[str, Any], step: int, input_state: dict[str, Any],
             extra: dict[str, Any] | None, keep: int | None) -> Path:
        self._refuse_checkpoints()
        return super().save(path, objects, step, input_state, extra, keep)

    def restore(self, path: str | os.PathLike[str], objects: dict[str, Any]) -> checkpoint.Restored:
        self._refuse_checkpoints()
        return super().restore(path, objects)

    def _refuse_checkpoints(self) -> None:
        if self.serves:
            raise ReplicatorUsageError(
                f"{self.roles.describe()}: only learners hold the training state that checkpoints save (actors' "
                "weights are copies of it); call repl.save()/repl.restore() under `if repl.role == 'learner':`")

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.service is not None and self.service.done.is_set() is False and self.job.failing:
            # This learner fails mid-run: the actors hear why at once rather than when a request breaks.
            exchange.post_abort(f"{self.roles.describe()} failed; see its error")
        if self.service is not None:
            self.service.close()


class _Batches:
    """The learners' input: each pass over it is the regime's sampler (a replay has no end of its own)."""

    def __init__(self, regime: ActorLearnerRegime) -> None:
        self.regime = regime

    def __iter__(self) -> Iterator[ReplaySample]:
        return self.regime.batches()

    def end_reason(self) -> str | None:
        """Why the batches ended before run()'s steps, for the step loop's message: an actor's end_run()."""
        if self.regime.ended is None:
            return None
        return f"{self.regime.ended} (every learner stopped at this step)"


def serves_this_run(regime: Regime, actor_fn: ActorFn | None, update_period: int, steps: int | None) -> bool:
    """Hand run()'s actor arguments to the actor–learner regime (other regimes refuse them); True where this process
    serves (a parameter server, an actor, the evaluator) instead of stepping."""
    if isinstance(regime, ActorLearnerRegime):
        regime.configure(actor_fn, update_period, steps)
    elif actor_fn is not None:
        raise ReplicatorUsageError("run(actor_fn=...) belongs to rp.Replicator(mode='actor_learner', actors=A)")
    return regime.serves
