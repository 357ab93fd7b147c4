"""Internal: a learner's service: two threads that serve the actors over the peer link while the learner trains.

The *insert* thread owns a comm.peer_server.PeerServer on which every actor streams chunks of
transitions. It commits an item to the replay shard only while the rate limiter allows (so no
commit ever leaves the limiter's band), keeps what it may not commit yet, and grants each actor
credits: how many items it may have sent in all, never more than the limiter has room for
beside what is already granted or kept (Reverb's way: back pressure reaches the actor, which
waits in add() once its credit is spent). The learner's main thread wakes it after each batch
it samples, when the room it made can be granted.

The *weights* thread owns a second server on which actors pull weights, so that sending a
model never delays an insert. It answers a pull at once when the newest copy is of the
learner's current step, and otherwise asks the main thread for a copy at its next publish point
(asynchronous.variables: a learner copies its weights only when a pull waits and its step
moved): at most one learner step, which the actors' pulls, asked one env step ahead, mostly hide.

An actor's death is its connection's end of file, known at once; a hung actor is named when its
heartbeat in the job's store stops.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from typing import Any

import torch

from replicator.asynchronous.actor_learner import exchange, heartbeats
from replicator.asynchronous.actor_learner.carrier import INSERTS, WEIGHTS, Carrier
from replicator.asynchronous.actor_learner.replay import ReplayShard
from replicator.asynchronous.actor_learner.roles import Roles, shards_fed_by
from replicator.asynchronous.actor_learner.staging import chunk_rows
from replicator.asynchronous.actor_learner.transitions import TransitionSpec
from replicator.asynchronous.actor_learner.variables import VariableSource
from replicator.comm.frames import Frame
from replicator.comm.peer_link import Peer, PeerLinkError
from replicator.timeline import recorder as timeline

__all__ = ["LearnerService"]

WINDOW_CHUNKS = 4  # an actor may have this many chunks in flight when the limiter leaves room
GRACE_CAP_S = 30.0  # with every actor dead, learners wait for a restarted one REPLICATOR_TIMEOUT / 3, at most this
END_POLL_S = 0.05  # how often the insert thread looks for an end_run() request in the store
KEEPALIVE_S = 1.0  # credits go to every actor at least this often (the run's state, and a sign of life)


class LearnerService:
    """One learner's side of one run(): start() with the run, finish() after its last step."""

    def __init__(self, roles: Roles, run: int, shard: ReplayShard, variables: VariableSource,
                 timeout_s: float, carrier: Carrier) -> None:
        self.roles, self.run = roles, run
        self.shard, self.variables, self.timeout_s = shard, variables, timeout_s
        others = roles.others
        # Who is alive, finished or gone: the threads change it, the main thread reads it (stop_reason, finish).
        self.roster = threading.Lock()
        self.alive = set(range(others))
        self.finished: set[int] = set()  # said BYE: their actor_fn returned
        self.departed: dict[int, dict[str, Any]] = {}
        self.env_steps = [0] * others
        self.inserted = [0] * others
        self.rejoined: list[dict[str, Any]] = []  # actors taken for dead that joined again: when, first insert when
        self.histogram = torch.zeros(exchange.LAG_BINS + 1, dtype=torch.int64)
        self.done = threading.Event()  # the learners finished their steps
        self.end_requested = threading.Event()  # an actor asked to end the run early (polled every END_POLL_S)
        self._end_polled = 0.0
        self.abort: str | None = None
        # Every actor stopped since (None: some actor feeds the replay); the learners stop after the grace, which lets
        # a restarted actor take a slot over (rp.join_actor) first.
        self.none_since: float | None = None
        self.grace_s = min(GRACE_CAP_S, timeout_s / 3)
        self.error: BaseException | None = None
        # The insert thread's books: each actor's connection, its credits, and the items kept for the limiter.
        self.peers: dict[int, Peer] = {}
        self.actor_of: dict[Peer, int] = {}
        self.granted = [0] * others
        self.received = [0] * others
        self.kept: deque[tuple[int, int, list[torch.Tensor]]] = deque()  # (actor, version, columns) not yet in
        self.kept_items = 0
        self.window = 1
        self._announced = False  # the end of the run went out to every actor
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        index = roles.index
        self.inserts = carrier.serve(run, INSERTS, index, rank=roles.rank, role=f"learner {index}")
        self.weights = carrier.serve(run, WEIGHTS, index, rank=roles.rank, role=f"learner {index}")
        self.pulls: dict[Peer, tuple[int, float]] = {}  # pulls waiting for a copy: the version held, answer by
        # A pull waits for the copy of the learner's next publish point at most this long (a learner stuck in a
        # step), then takes the newest copy there is.
        self.hold_s = timeout_s / 4
        variables.on_copy = self.weights.wake

    # -- the main thread's side ------------------------------------------------------------------------
    def start(self) -> None:
        self.started = self.last_insert = time.monotonic()
        self.heartbeats = heartbeats.HeartbeatWatch(range(self.roles.others), self.timeout_s)
        for target, name in ((self._run_inserts, "replicator-learner-inserts"),
                             (self._run_weights, "replicator-learner-weights")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def sampled(self) -> None:
        """After the main thread drew a batch (holding the shard's lock): wake the insert thread if the room this
        made can go to an actor."""
        if self.kept_items or any(self.granted[a] - self.received[a] < self.window for a in tuple(self.peers)):
            self.inserts.wake()

    def stop_reason(self) -> str | None:
        """Why this learner cannot expect more experience (its sampler then ends), or None."""
        if self.error is not None:
            return f"its service thread failed: {type(self.error).__name__}: {self.error}"
        if self.abort is not None:
            return self.abort
        gone = self.all_gone()
        if gone is not None:
            return gone
        waited = time.monotonic() - self.last_insert
        if waited > self.timeout_s:
            feeders = [a for a in range(self.roles.actors) if a in self.alive and a not in self.finished]
            return (f"no transition reached its replay shard for {waited:.0f} s (REPLICATOR_TIMEOUT="
                    f"{self.timeout_s:g}) although actor(s) {feeders} are alive: is actor_fn stuck?")
        return None

    def all_gone(self, deaths_only: bool = False) -> str | None:
        """Why no actor can feed the replay any more (every actor stopped, and none of those that died was replaced
        within the grace), or None. `deaths_only`: None as well when no actor died (every actor_fn returned: a
        learner that samples without waiting for inserts may go on with what it holds). Cheap: the main thread
        asks before every batch."""
        with self.roster:
            if any(a in self.alive and a not in self.finished for a in range(self.roles.actors)):
                self.none_since = None
                return None
            died = any(self.departed.get(a, {}).get("how") == "died" for a in range(self.roles.actors))
        if deaths_only and not died:
            return None
        now = time.monotonic()
        if self.none_since is None:
            self.none_since = now
        if died and now - self.none_since < self.grace_s:
            return None  # a restarted actor may yet take a slot over (rp.join_actor)
        gone = "; ".join(f"{self.roles.name(a)} {self._how(a)}" for a in range(self.roles.actors))
        waited = (f" and none was restarted within {self.grace_s:g} s (the grace: REPLICATOR_TIMEOUT / 3, at most "
                  f"30 s)") if died else ""
        return (f"every actor has stopped ({gone}){waited}, so no experience can reach the replay: see the actors' "
                "errors or exit codes (an actor_fn must keep calling actor.add() while actor.running; a restarted "
                "actor rejoins with rp.join_actor)")

    def finish(self) -> None:
        """After the last step: release every actor, wait (at most REPLICATOR_TIMEOUT) for each to say goodbye
        or die, then stop the threads."""
        self.done.set()
        self.inserts.wake()
        self.weights.wake()
        if self.abort is not None or exchange.read_abort() is not None:
            self.close()  # the job failed: every actor raises on its own, none will say goodbye
            return
        deadline = time.monotonic() + self.timeout_s
        while any(t.is_alive() for t in self._threads) and time.monotonic() < deadline:
            with self.roster:
                if not (self.alive - self.finished):
                    break
            time.sleep(0.01)
        self.close()
        for actor in sorted(self.alive - self.finished):
            self._depart(actor, "hung", f"it did not stop within REPLICATOR_TIMEOUT={self.timeout_s:g} s of the "
                                        "learners' last step (actor_fn must return once actor.running is False)")

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.inserts.wake()
        self.weights.wake()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._threads = []
        self.inserts.close()
        self.weights.close()

    def _how(self, actor: int) -> str:
        """'died 3.2 s into the run (its link closed: ...)', 'finished' or 'running'."""
        if actor in self.departed:
            departed = self.departed[actor]
            return f"{departed['how']} {departed['seconds']:.1f} s into the run ({departed['why']})"
        return "finished (its actor_fn returned)" if actor in self.finished else "running"

    # -- the insert thread ------------------------------------------------------------------------------
    def _run_inserts(self) -> None:
        try:
            self._serve_inserts()
        except BaseException as error:  # the main thread raises it from its sampler
            self.error = error
        finally:
            with self.shard.lock:
                self.shard.lock.notify_all()

    def _serve_inserts(self) -> None:
        checked = time.monotonic()
        while not self._stop.is_set():
            try:
                event = self.inserts.receive(timeout_s=0.25)
            except PeerLinkError as error:  # PeerDied (end of file, a reset) or PeerDropped (it broke the protocol)
                self._lost(error)
                event = None
            if event is not None:
                with timeline.span("serve actor", "service", timeline.SERVICE):
                    self._handle(*event)
            now = time.monotonic()
            self._commit_kept()
            self._grant(force=now - checked > KEEPALIVE_S or (self.done.is_set() and not self._announced))
            if self.done.is_set():
                self._announced = True
            if now - checked > KEEPALIVE_S / 2:
                checked = now
                self._check(now)
            if not self.end_requested.is_set() and now - self._end_polled > END_POLL_S:
                self._end_polled = now
                self._poll_end_request()

    def _poll_end_request(self) -> None:
        """Whether an actor asked to end the run (ActorContext.end_run): the main thread reads the event instead of
        the store before every batch."""
        try:
            if exchange.store().check([exchange.Keys.end_request(self.run)]):
                self.end_requested.set()
        except RuntimeError:
            pass  # the store left with its host: the job is ending and the abort path tells

    def _handle(self, peer: Peer, frame: Frame) -> None:
        actor = self.actor_of.get(peer)
        numbers = frame.tensors[0].tolist() if frame.tensors and frame.tensors[0].dtype == torch.int64 else []
        if frame.kind == exchange.JOIN:
            if len(numbers) != 3 or not 0 <= numbers[0] < self.roles.others or numbers[1] != self.run:
                print(f"replicator: learner {self.roles.index}: {peer} sent a JOIN for {numbers}, which names no "
                      f"actor of run {self.run}; ignored", file=sys.stderr, flush=True)
                return
            self._join(peer, int(numbers[0]))
            return
        if actor is None:
            print(f"replicator: learner {self.roles.index}: {peer} sent a frame of kind {frame.kind} before joining; "
                  "ignored", file=sys.stderr, flush=True)
            return
        self.heartbeats.heard(actor, time.monotonic())
        if frame.kind == exchange.BYE:
            with self.roster:
                self.finished.add(actor)
            if numbers:
                self.env_steps[actor] = max(self.env_steps[actor], int(numbers[0]))
            self._release_grant(actor)
            self.actor_of.pop(peer, None)
            if self.peers.get(actor) == peer:
                del self.peers[actor]
            self.inserts.disconnect(peer)  # it leaves in peace: no log line for its end of file
        elif frame.kind == exchange.CHUNK:
            self._receive_chunk(actor, peer, numbers, frame.tensors[1:])

    def _join(self, peer: Peer, actor: int) -> None:
        old = self.peers.get(actor)
        if old is not None and old != peer:
            self.actor_of.pop(old, None)  # a restarted actor under the same index: its old link is dead
        self.peers[actor], self.actor_of[peer] = peer, actor
        self.granted[actor] = self.received[actor] = 0
        with self.roster:
            if actor in self.departed:  # taken for dead, yet here: it is back (a restarted actor)
                self.rejoined.append({"actor": actor, "joined_s": round(time.monotonic() - self.started, 3),
                                      "first_insert_s": None, "first_insert_at": None,
                                      "departed": self.departed.pop(actor)})
                if self.roles.index == 0:
                    print(f"replicator: learner 0: {self.roles.name(actor)} joined again "
                          f"{time.monotonic() - self.started:.1f} s into the run", file=sys.stderr, flush=True)
            self.alive.add(actor)
            self.finished.discard(actor)
        self.heartbeats.heard(actor, time.monotonic())

    def _receive_chunk(self, actor: int, peer: Peer, numbers: list[int], columns: list[torch.Tensor]) -> None:
        count = numbers[0] if len(numbers) == 3 else -1
        spec = self._spec()
        if count < 1 or len(columns) != 5 or count > self.granted[actor] - self.received[actor] or \
                not _fits(spec, columns, count):
            print(f"replicator: learner {self.roles.index}: {peer} sent a chunk that does not fit the job's "
                  f"transitions or its credit ({count} items, {self.granted[actor] - self.received[actor]} granted); "
                  "ignored", file=sys.stderr, flush=True)
            return
        self.received[actor] += count
        self.env_steps[actor] = max(self.env_steps[actor], int(numbers[2]))
        self.last_insert = time.monotonic()
        if self.done.is_set():
            return  # after the learners' last step nothing more goes in
        version = int(numbers[1])
        committed = 0
        if not self.kept:
            committed = self._commit(actor, version, columns, count)
        if committed < count:  # the limiter has no room for the rest yet: keep it, in order
            self.kept.append((actor, version, [column[committed:count].clone() for column in columns]))
            self.kept_items += count - committed

    def _commit(self, actor: int, version: int, columns: list[torch.Tensor], count: int) -> int:
        """Commit as many of `count` items as the limiter allows now; how many."""
        spec = self.shard.spec or self._spec()
        with self.shard.lock:
            room = min(self.shard.limiter.insert_room(), count)
            if room > 0:
                names = ("observation", "action", "next_observation", "reward", "discount")
                self.shard.insert(spec, {name: column[:room] for name, column in zip(names, columns, strict=True)},
                                  room)
        if room > 0:
            self.histogram[min(max(self.variables.step - version, 0), exchange.LAG_BINS)] += room
            self.inserted[actor] += room
            for rejoined in self.rejoined:
                if rejoined["actor"] == actor and rejoined["first_insert_s"] is None:
                    rejoined["first_insert_s"] = round(time.monotonic() - self.started, 3)
                    rejoined["first_insert_at"] = time.time()
        return room

    def _commit_kept(self) -> None:
        while self.kept:
            actor, version, columns = self.kept[0]
            count = len(columns[0])
            committed = self._commit(actor, version, columns, count)
            self.kept_items -= committed
            if committed < count:
                self.kept[0] = (actor, version, [column[committed:] for column in columns])
                return
            self.kept.popleft()

    def _grant(self, force: bool) -> None:
        """Top up the actors' credits from the limiter's room, beside what is granted and kept; send the new grants
        (and, when `force`, everyone's, as a sign of life and the run's state)."""
        live = sorted(a for a in self.alive if a < self.roles.actors)
        actors = [a for a in self.peers if a in live and a not in self.finished
                  and self.roles.index in shards_fed_by(a, live, self.roles.learners)]  # what others hold stays out
        if self.shard.spec is not None:  # until the first chunk, one item each: enough to start
            self.window = WINDOW_CHUNKS * chunk_rows(self.shard.spec)
        changed: set[int] = set()
        if actors and not self.done.is_set():
            limiter = self.shard.limiter
            with self.shard.lock:
                room = limiter.insert_room() - self.kept_items
            # Each feeder may have up to a share of the limiter's band in flight, whatever the others hold: a slow
            # actor's credit does not starve a fast one, and what arrives past the room (kept, committed as the room
            # opens, then counted as older experience) stays within about one band.
            share = self.window
            if limiter.samples_per_insert is not None:
                band = limiter.error_buffer / limiter.samples_per_insert
                share = min(self.window, max(1, math.ceil(band / len(actors))))
            target = min(room, share)
            for actor in actors:
                if self.received[actor] + target > self.granted[actor]:
                    self.granted[actor] = self.received[actor] + target
                    changed.add(actor)
        for actor, peer in list(self.peers.items()):
            if force or actor in changed:
                self._send_credit(actor, peer)

    def _send_credit(self, actor: int, peer: Peer) -> None:
        live = [int(a in self.alive) for a in range(self.roles.others)]
        numbers = [self.granted[actor], max(self.variables.step, 0), int(self.done.is_set()),
                   int(self.abort is not None), *live]
        try:
            self.inserts.send(peer, exchange.CREDIT, [torch.tensor(numbers, dtype=torch.int64)])
        except PeerLinkError as error:
            self._lost(error)

    def _release_grant(self, actor: int) -> None:
        self.granted[actor] = self.received[actor]  # what it will not send goes back to the others

    def _lost(self, error: PeerLinkError) -> None:
        """A connection ended: an actor's death, unless it said goodbye first."""
        peer = error.peer
        actor = self.actor_of.pop(peer, None) if peer is not None else None
        if actor is None or self.peers.get(actor) != peer:
            return  # an actor's old link, or a peer that never joined (the server logged it)
        del self.peers[actor]
        self._release_grant(actor)
        if actor in self.finished or self.done.is_set():
            return
        self._depart(actor, "died", f"its link closed: {error}")
        self._grant(force=True)  # the others hear at once, and feed the shards it fed

    def _spec(self) -> TransitionSpec:
        if self.shard.spec is not None:
            return self.shard.spec
        return TransitionSpec.decode(exchange.store().get(exchange.Keys.spec).decode("ascii"))

    # -- the weights thread ----------------------------------------------------------------------------
    def _run_weights(self) -> None:
        try:
            self._serve_weights()
        except BaseException as error:
            self.error = error
        finally:
            with self.shard.lock:
                self.shard.lock.notify_all()

    def _serve_weights(self) -> None:
        layout = self.variables.layout
        while not self._stop.is_set():
            now = time.monotonic()
            wait = min([0.25, *(max(deadline - now, 0.0) for _, deadline in self.pulls.values())])
            try:
                event = self.weights.receive(timeout_s=wait)
            except PeerLinkError as error:
                if error.peer is not None:
                    self.pulls.pop(error.peer, None)
                event = None
            if event is not None:
                peer, frame = event
                numbers = frame.tensors[0].tolist() if frame.tensors else []
                if frame.kind == exchange.BYE:
                    self.pulls.pop(peer, None)
                    self.weights.disconnect(peer)
                elif frame.kind != exchange.PULL or len(numbers) != 3:
                    print(f"replicator: learner {self.roles.index}: {peer} sent a frame of kind {frame.kind} on the "
                          "weights link; ignored", file=sys.stderr, flush=True)
                elif numbers[2] != layout.checksum:
                    self._answer(peer, exchange.LAYOUT, layout.checksum)
                else:
                    self.pulls[peer] = (int(numbers[1]), time.monotonic() + self.hold_s)
            if self.pulls:
                self._answer_pulls()

    def _answer_pulls(self) -> None:
        """Answer the waiting pulls from the newest copy if it is of the learner's step now (or the run is over), or
        once a pull has waited `hold_s`; meanwhile ask the main thread for a copy at its next publish point."""
        variables = self.variables
        now = time.monotonic()
        due = list(self.pulls)
        if not (variables.fresh or self.done.is_set() or self.abort is not None):
            if not variables.wanted:
                variables.wanted = True
                with self.shard.lock:  # a main thread waiting for a batch publishes on waking
                    self.shard.lock.notify_all()
            due = [peer for peer, (_, deadline) in self.pulls.items() if now >= deadline]
            if not due:
                return
        version, flats = variables.lend()
        try:
            for peer in due:
                held, _ = self.pulls.pop(peer)
                with timeline.span("send weights", "service", timeline.SERVICE):
                    if held == version:
                        self._answer(peer, exchange.UNCHANGED, version)
                    else:
                        self._answer(peer, exchange.WEIGHTS, version, flats)
        finally:
            variables.give_back()

    def _answer(self, peer: Peer, kind: int, version: int, flats: list[torch.Tensor] | None = None) -> None:
        try:
            self.weights.send(peer, kind, flats or [], request=max(version, 0))
        except PeerLinkError:
            pass  # the actor died: its insert link tells

    # -- every half second -------------------------------------------------------------------------------
    def _check(self, now: float) -> None:
        if self.abort is None:
            self.abort = exchange.read_abort()
        for actor in sorted(self.alive - self.finished):
            if actor in self.peers:
                continue  # connected: its end of file would have told, and a hung one is named by the timeout
            stopped = self.heartbeats.stopped_for(actor, now)
            if stopped is not None:
                self._depart(actor, "died", f"its heartbeat stopped {stopped:.0f} s ago")
        self._publish_figures(now)

    def _publish_figures(self, now: float) -> None:
        """This shard's figures in the store, for actor.counters() (an evaluator's learning curve)."""
        limiter = self.shard.limiter
        lags = ",".join(f"{lag}:{count}" for lag, count in enumerate(self.histogram.tolist()) if count)
        text = (f"{max(self.variables.step, 0)} {limiter.inserts} {limiter.samples} "
                f"{max(limiter.inserts - limiter.min_size, 0)} {now - self.started:.3f}|{lags}")
        exchange.store().set(exchange.Keys.learner(self.roles.index), text)

    def _depart(self, actor: int, how: str, why: str) -> None:
        if actor in self.departed:
            return
        seconds = time.monotonic() - self.started
        with self.roster:
            self.departed[actor] = {"how": how, "rank": self.roles.actor_rank(actor), "at": time.time(),
                                    "env_steps": self.env_steps[actor], "seconds": round(seconds, 3), "why": why}
            self.alive.discard(actor)
        if self.roles.index == 0:
            left = sorted(a for a in self.alive if a < self.roles.actors)
            print(f"replicator: learner 0: {self.roles.name(actor)} {how} {seconds:.1f} s into the run ({why}); "
                  f"going on with actor(s) {left}", file=sys.stderr, flush=True)


def _fits(spec: TransitionSpec, columns: list[torch.Tensor], count: int) -> bool:
    """The chunk's columns hold `count` transitions of the job's format."""
    expected = [(spec.observation.dtype, (count, *spec.observation.shape)),
                (spec.action.dtype, (count, *spec.action.shape)),
                (spec.observation.dtype, (count, *spec.observation.shape)),
                (torch.float32, (count,)), (torch.float32, (count,))]
    return [(c.dtype, tuple(c.shape)) for c in columns] == expected
