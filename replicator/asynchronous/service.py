"""Internal: a learner's service thread: it receives actors' transitions into the learner's replay shard, answers
weight pulls from the newest published copy, holds back actors that run ahead, and notices actors that die.

It talks over the job-wide Gloo group `everyone`, which no other thread of a learner uses (a Gloo
group must not be driven from two threads); the learner's main thread trains over the learners'
own groups meanwhile. Requests arrive in ticket order (asynchronous.wire.Tickets), each from a
known actor, so a receive never waits on "whoever comes next" and an actor's death shows as an
error on its own receive, or as its heartbeat stopping.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from replicator.asynchronous import exchange, wire
from replicator.asynchronous.replay import ReplayShard
from replicator.asynchronous.roles import Roles
from replicator.asynchronous.transitions import TransitionSpec
from replicator.asynchronous.variables import VariableSource
from replicator.comm.store import job_store
from replicator.timeline import recorder as timeline

__all__ = ["LearnerService"]


class LearnerService:
    """One learner's side of one run(): start() with the run, finish() after its last step."""

    def __init__(self, roles: Roles, everyone: dist.ProcessGroup, tickets: wire.Tickets, shard: ReplayShard,
                 variables: VariableSource, timeout_s: float) -> None:
        self.roles, self.everyone, self.tickets = roles, everyone, tickets
        self.shard, self.variables, self.timeout_s = shard, variables, timeout_s
        self.hold_s = min(1.0, timeout_s / 4)  # the longest an answer to a waiting actor is held back
        others = roles.others
        # Who is alive, finished or gone: the thread changes it, the main thread reads it (stop_reason, finish).
        self.roster = threading.Lock()
        self.alive = set(range(others))
        self.finished: set[int] = set()  # said BYE: their actor_fn returned
        self.departed: dict[int, dict[str, Any]] = {}
        self.env_steps = [0] * others
        self.inserted = [0] * others
        self.histogram = torch.zeros(exchange.LAG_BINS + 1, dtype=torch.int64)
        self.held: dict[int, tuple[int, float]] = {}  # actor -> (request kind, answer by)
        self.done = threading.Event()  # the learners finished their steps
        self.abort: str | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the main thread's side ------------------------------------------------------------------------
    def start(self) -> None:
        self.started = self.last_insert = time.monotonic()
        self.heartbeats = wire.HeartbeatWatch(range(self.roles.others), self.timeout_s)
        self._thread = threading.Thread(target=self._run, name="replicator-learner-service", daemon=True)
        self._thread.start()

    def stop_reason(self) -> str | None:
        """Why this learner cannot expect more experience (its sampler then ends), or None."""
        if self.error is not None:
            return f"its service thread failed: {type(self.error).__name__}: {self.error}"
        if self.abort is not None:
            return self.abort
        with self.roster:
            feeders = [a for a in range(self.roles.actors) if a in self.alive and a not in self.finished]
        if not feeders:
            gone = ", ".join(f"{self.roles.name(a)} {self._how(a)}" for a in range(self.roles.actors))
            return (f"every actor has stopped ({gone}), so no experience can reach the replay: see the actors' "
                    "errors or exit codes (an actor_fn must keep calling actor.add() while actor.running)")
        waited = time.monotonic() - self.last_insert
        if waited > self.timeout_s:
            return (f"no transition reached its replay shard for {waited:.0f} s (REPLICATOR_TIMEOUT="
                    f"{self.timeout_s:g}) although actor(s) {feeders} are alive: is actor_fn stuck?")
        return None

    def finish(self) -> None:
        """After the last step: release every actor, wait (at most REPLICATOR_TIMEOUT) for each to say goodbye
        or die, then stop the thread."""
        self.done.set()
        if self.abort is not None or exchange.read_abort() is not None:
            self.close()  # the job failed: every actor raises on its own, none will say goodbye
            return
        deadline = time.monotonic() + self.timeout_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            with self.roster:
                if not (self.alive - self.finished):
                    break
            time.sleep(0.01)
        self.close()
        for actor in sorted(self.alive - self.finished):
            self._depart(actor, "hung", f"it did not stop within REPLICATOR_TIMEOUT={self.timeout_s:g} s of the "
                                        "learners' last step (actor_fn must return once actor.running is False)")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _how(self, actor: int) -> str:
        if actor in self.departed:
            return str(self.departed[actor]["how"])
        return "finished" if actor in self.finished else "running"

    # -- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as error:  # the main thread raises it from its sampler
            self.error = error
        finally:
            with self.shard.lock:
                self.shard.lock.notify_all()

    def _serve(self) -> None:
        idle_since = checked = time.monotonic()
        while not self._stop.is_set():
            actor = self.tickets.take()
            now = time.monotonic()
            if now - checked > wire.Heartbeat.PERIOD_S:
                checked = now
                self._check(now)
            self._release(now)
            if actor is None:
                wire.idle_sleep(idle_since)
                continue
            idle_since = now
            with timeline.span("serve actor", "service", timeline.SERVICE, actor=actor):
                self._handle(actor, now)

    def _handle(self, actor: int, now: float) -> None:
        rank = self.roles.actor_rank(actor)
        header = torch.empty(exchange.REQUEST, dtype=torch.int64)
        payload = None
        try:
            dist.recv(header, src=rank, group=self.everyone, tag=wire.TAG_REQUEST)
            kind, _, version, env_steps, count, checksum = header.tolist()
            if kind == exchange.INSERT:
                spec = self._spec()
                payload = torch.empty(count * spec.nbytes, dtype=torch.uint8)
                dist.recv(payload, src=rank, group=self.everyone, tag=wire.TAG_REQUEST)
        except RuntimeError as error:
            self._depart(actor, "died", f"it failed mid-request: {error}")
            return
        with self.roster:
            if actor in self.departed:  # taken for dead (a stalled heartbeat), yet here: it is back
                del self.departed[actor]
                self.alive.add(actor)
            if kind == exchange.BYE:
                self.finished.add(actor)
        self.heartbeats.heard(actor, now)
        self.env_steps[actor] = max(self.env_steps[actor], env_steps)
        if kind == exchange.BYE:
            return
        if kind == exchange.PULL:
            if checksum != self.variables.layout.checksum:
                self._reply(actor, exchange.LAYOUT, self.variables.layout.checksum, False)
            else:
                self.held[actor] = (kind, now + self.timeout_s / 2)
            return
        if kind == exchange.INSERT:  # answered at once: an actor that may not go on says WAIT, which is held
            if payload is not None and not self.done.is_set():
                self._insert(actor, version, payload, count)
            self._reply(actor, exchange.OK, self.variables.version, self._may_go_on())
        else:  # WAIT: held until this actor may go on, if it asked to be (count 1), else answered at once
            self.held[actor] = (kind, now + (self.hold_s if count else 0.0))

    def _spec(self) -> TransitionSpec:
        if self.shard.spec is not None:
            return self.shard.spec
        return TransitionSpec.decode(job_store().get(exchange.Keys.spec).decode("ascii"))

    def _insert(self, actor: int, version: int, payload: torch.Tensor, count: int) -> None:
        spec = self._spec()
        fields = spec.unpack(payload, count)
        with self.shard.lock:
            self.shard.insert(spec, fields, count)
        self.histogram[min(max(self.variables.version - version, 0), exchange.LAG_BINS)] += count
        self.inserted[actor] += count
        self.last_insert = time.monotonic()

    def _may_go_on(self) -> bool:
        if self.done.is_set() or self.abort is not None:
            return True
        with self.shard.lock:
            return self.shard.limiter.can_insert()

    def _release(self, now: float) -> None:
        """Answer the held requests that can be answered: pulls once weights are published, actors once the
        limiter lets them go on (or, at the latest, after `hold_s`: they ask again)."""
        if not self.held:
            return
        go_on = self._may_go_on()
        for actor, (kind, deadline) in list(self.held.items()):
            if kind == exchange.PULL:
                taken = self.variables.take() if self.abort is None else None
                if taken is not None:
                    del self.held[actor]
                    self._reply(actor, exchange.OK, taken[0], True, taken[1])
                elif self.abort is not None or now > deadline:
                    del self.held[actor]
                    self._reply(actor, exchange.OK, -1, False)  # nothing yet: it asks again
            elif go_on or now >= deadline:
                del self.held[actor]
                self._reply(actor, exchange.OK, self.variables.version, go_on)

    def _reply(self, actor: int, status: int, version: int, go_on: bool,
               flats: list[torch.Tensor] | None = None) -> None:
        if self.abort is not None:
            status = exchange.ABORTED
        live = [int(a in self.alive) for a in range(self.roles.others)]
        header = torch.tensor([status, version, int(self.done.is_set()), int(go_on), *live], dtype=torch.int64)
        rank = self.roles.actor_rank(actor)
        try:
            dist.send(header, dst=rank, group=self.everyone, tag=wire.TAG_REPLY)
            if status == exchange.OK:
                for flat in flats or []:
                    dist.send(flat, dst=rank, group=self.everyone, tag=wire.TAG_REPLY)
        except RuntimeError as error:
            self._depart(actor, "died", f"it could not be reached: {error}")

    # -- every half second -------------------------------------------------------------------------------
    def _check(self, now: float) -> None:
        if self.abort is None:
            self.abort = exchange.read_abort()
        for actor in sorted(self.alive - self.finished):
            stopped = self.heartbeats.stopped_for(actor, now)
            if stopped is not None:
                self._depart(actor, "died", f"its heartbeat stopped {stopped:.0f} s ago")
        self._publish_figures(now)

    def _publish_figures(self, now: float) -> None:
        """This shard's figures in the store, for actor.counters() (an evaluator's learning curve)."""
        limiter = self.shard.limiter
        lags = ",".join(f"{lag}:{count}" for lag, count in enumerate(self.histogram.tolist()) if count)
        text = (f"{max(self.variables.version, 0)} {limiter.inserts} {limiter.samples} "
                f"{max(limiter.inserts - limiter.min_size, 0)} {now - self.started:.3f}|{lags}")
        job_store().set(exchange.Keys.learner(self.roles.index), text)

    def _depart(self, actor: int, how: str, why: str) -> None:
        if actor in self.departed:
            return
        seconds = time.monotonic() - self.started
        with self.roster:
            self.departed[actor] = {"how": how, "rank": self.roles.actor_rank(actor),
                                    "env_steps": self.env_steps[actor], "seconds": round(seconds, 3), "why": why}
            self.alive.discard(actor)
        self.held.pop(actor, None)
        if self.roles.index == 0:
            left = sorted(a for a in self.alive if a < self.roles.actors)
            print(f"replicator: learner 0: {self.roles.name(actor)} {how} {seconds:.1f} s into the run ({why}); "
                  f"going on with actor(s) {left}", file=sys.stderr, flush=True)
