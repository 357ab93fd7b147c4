"""Replicas agree before they communicate, so divergence fails fast and names the culprit.

Before a collective whose partners could differ (a user's collective, the first gradient
bucket of a step, the start of a step), every replica announces what it is about to do, on
the control group or, among the processes of one node, over a LocalLink. Every announcement
has the same size, so mismatched replicas still complete the exchange, see that they
differ, then swap full intents (operation and call site) and raise the same clear error
together, instead of hanging or feeding wrong-sized buffers to Gloo.

Checks on one channel are settled in the order they were made: a replica makes a new check
only once its previous one has arrived from everyone and matched. So the first position
where replicas differ is where every one of them finds out, whatever it does next. Where a
process checks on two channels (a pipeline: the job's and its stage's replicas'), a wait
that outlasts a short grace also looks for a peer waiting for it on the other channel
(replicator.comm.stalls).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from replicator.comm.heartbeat import waiting
from replicator.comm.local_link import LocalLink
from replicator.comm.stalls import LOOK_EVERY_S, Channel, StallWatch, Waiting
from replicator.comm.store import job_store
from replicator.errors import ReplicaMismatchError, ReplicatorError

__all__ = ["Agreement", "PendingAgreement", "Verdict", "Intent", "call_site"]

_SIGNATURE_BYTES = 256
_SITE_BYTES = 128
_VALUE_SLOTS = 16
_CHECK_VALUES = 4  # numbers one agreement check carries beside the signature's hash
# A check's row as it travels over a link: the signature's hash, then the values (this machine's byte order:
# a link joins processes of one node).
_ROW = struct.Struct(f"={1 + _CHECK_VALUES}q")
_MESSAGE_BYTES = _SIGNATURE_BYTES + _SITE_BYTES + 8 * _VALUE_SLOTS
_STRAGGLER_GRACE_S = 5.0
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # replicator/, not comm/
# A check made from an autograd hook is the user's backward() call, not torch's engine.
_SKIPPED_DIRS = (_PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)))


def call_site() -> str:
    """'file.py:42 in step_fn' for the innermost frame outside replicator and torch."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


@dataclass(frozen=True)
class Intent:
    """What one replica announced: an operation signature, its call site and a few numbers."""

    replica: int
    signature: str
    site: str
    values: tuple[float, ...]


def _encode(text: str, size: int) -> bytes:
    raw = text.encode("utf-8")[:size]
    return raw + b"\0" * (size - len(raw))


def _decode(raw: np.ndarray) -> str:
    return bytes(raw).rstrip(b"\0").decode("utf-8", errors="replace")


class Agreement:
    """Exchanges intents on a control group; a no-op for a single replica.

    With a `link` (the group's processes share a node) checks travel over it instead of the
    group's backend, at a fifth to a tenth of the latency. With `trail` (debug mode) every check also
    leaves this process's latest intent and call site in the job's store, so that a timeout
    can say where each straggler was. With a `watch` (a process that checks on two channels),
    this channel is registered under `name` and long waits look for deadlocks across them.
    """

    def __init__(self, group: dist.ProcessGroup | None, trail: bool = False, link: LocalLink | None = None,
                 *, watch: StallWatch | None = None, name: str = "the whole job", label: str = "replica") -> None:
        self.group = group
        self.link = link
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.trail = trail and group is not None
        self.name = name
        self.label = label  # what a member is called in messages: "replica", or "rank" beside pipeline stages
        self.posted = 0  # checks started on this channel, the n-th being check number n - 1
        self.broken = False  # a check failed: the members' counts may no longer match
        self._unsettled: PendingAgreement | None = None  # the latest check, if not yet matched
        self.watch = watch
        if watch is not None and group is not None:
            watch.add(Channel(name, tuple(dist.get_process_group_ranks(group)), lambda: self.posted,
                              self.settle_arrived))

    def exchange(self, signature: str, site: str = "", values: Sequence[float] = ()) -> list[Intent]:
        """Every replica's intent, in replica order. Raises nothing; see `require_same`."""
        if len(values) > _VALUE_SLOTS:
            raise ValueError(f"at most {_VALUE_SLOTS} values fit in an agreement message, got {len(values)}")
        padded = np.zeros(_VALUE_SLOTS, dtype=np.float64)
        padded[: len(values)] = values
        if self.group is None:
            return [Intent(0, signature, site, tuple(padded[: len(values)]))]
        message = np.frombuffer(
            _encode(signature, _SIGNATURE_BYTES) + _encode(site, _SITE_BYTES) + padded.tobytes(), dtype=np.uint8
        )
        mine = torch.from_numpy(message.copy())
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self.group)
        intents = []
        for replica, tensor in enumerate(everyone):
            raw = tensor.numpy()
            received = np.frombuffer(raw[_SIGNATURE_BYTES + _SITE_BYTES :].tobytes(), dtype=np.float64)
            intents.append(
                Intent(
                    replica,
                    _decode(raw[:_SIGNATURE_BYTES]),
                    _decode(raw[_SIGNATURE_BYTES : _SIGNATURE_BYTES + _SITE_BYTES]),
                    tuple(received[: len(values)]),
                )
            )
        return intents

    def require_same(self, signature: str, site: str = "", values: Sequence[int] = ()) -> Verdict:
        """Check that every replica announces `signature`; raise ReplicaMismatchError everywhere if not."""
        return self.start(signature, site, values).wait()

    def start(self, signature: str, site: str = "", values: Sequence[int] = ()) -> PendingAgreement:
        """Begin the check without waiting, so its latency hides under other work.

        The common case costs one all-gather (one message to each peer over a link) of a few
        integers, a signature hash and the values, from which every replica takes their
        extremes. Only when the hashes differ do replicas exchange full intents (all of them
        see the same rows, so all of them take that path together). An all-gather rather than
        an all-reduce of maxima and minima: a ring gathers in N - 1 steps where it reduces in
        2(N - 1), and these messages are all latency.

        The previous check is settled first (it has usually arrived by then): a replica that
        diverged is caught at the first check where it differs, on every replica alike.
        """
        self.settle()
        if self.trail:
            where = f" at {site}" if site else ""
            trail = f"check #{self.posted + 1} on the channel of {self.name}: {signature}{where}"
            job_store().set(f"{_TRAIL_KEY}{dist.get_rank()}", trail)
        pending = PendingAgreement(self, signature, site, [int(v) for v in values])
        if self.group is not None:
            self._unsettled = pending
        return pending

    def settle(self) -> None:
        """Wait for the latest check made on this channel, raising there if the replicas differ."""
        if self._unsettled is not None:
            self._unsettled.wait()

    def settle_arrived(self) -> None:
        """Judge the latest check if every member has made it by now; never waits for one."""
        if self._unsettled is not None and self._unsettled.arrived_within(0.01):
            self._unsettled.wait()

    def mismatch_intents(self, pending: PendingAgreement) -> list[Intent]:
        """Every member's intent at `pending`, a check whose hashes differ: through the store when a
        member may be waiting on another channel (stalls.StallWatch.intents), else one all-gather."""
        values = [float(v) for v in pending.values]
        if self.watch is None:
            return self.exchange(pending.signature, pending.site, values)
        mine = {"signature": pending.signature, "site": pending.site, "values": values}
        silent: dict[str, Any] = {"signature": "(no answer: it waits elsewhere, see its own error)", "site": "",
                                  "values": []}
        found = self.watch.intents(self.name, pending.number, mine)
        return [Intent(replica, (note or silent)["signature"], (note or silent)["site"],
                       tuple((note or silent)["values"])) for replica, note in enumerate(found)]


@dataclass(frozen=True)
class Verdict:
    """The replicas' extremes of each announced value, and its sum over them."""

    maxima: tuple[int, ...]
    minima: tuple[int, ...]
    sums: tuple[int, ...] = ()

    @property
    def unanimous(self) -> bool:
        return self.maxima == self.minima


class PendingAgreement:
    """An agreement check in flight; `wait()` returns the Verdict or raises on divergence."""

    def __init__(self, agreement: Agreement, signature: str, site: str, values: list[int]) -> None:
        self.agreement, self.signature, self.site, self.values = agreement, signature, site, values
        if len(values) > _CHECK_VALUES:
            raise ValueError(f"at most {_CHECK_VALUES} values fit in an agreement check, got {len(values)}")
        # One size for every check, so that replicas at different checks still complete the
        # gather and see the hashes differ, instead of handing the backend mismatched sizes.
        padding = (0,) * (_CHECK_VALUES - len(values))
        mine = (zlib.crc32(signature.encode("utf-8")), *values, *padding)
        self.number = agreement.posted
        # Every member's row, as Python ints: a check is made every step, and a few ints judged in
        # Python cost a fraction of the tensor operations (stack, amax, amin, sum) that did it before.
        self._rows: list[tuple[int, ...]] = [mine]
        self._gathered: list[torch.Tensor] = []  # the backend's rows, without a link
        self._work: Any = None
        self._ticket: int | None = None
        self._receiving = threading.Lock()  # the reducer's thread and the caller's may both wait
        if agreement.link is not None:
            self._ticket = agreement.link.post(_ROW.pack(*mine))
            agreement.posted += 1
        elif agreement.group is not None:
            row = torch.tensor(mine, dtype=torch.int64)
            self._gathered = [torch.empty_like(row) for _ in range(agreement.size)]
            self._work = dist.all_gather(self._gathered, row, group=agreement.group, async_op=True)
            agreement.posted += 1
        self._verdict: Verdict | None = None

    def __str__(self) -> str:
        """How a heartbeat names this check while a replica waits at it."""
        return f"'{self.signature}'" + (f" ({self.site})" if self.site else "")

    def _receive(self) -> None:
        with self._receiving, waiting(self):
            if self._work is not None:
                self._wait_for_backend()
                self._work = None
                self._rows = [tuple(row.tolist()) for row in self._gathered]
            if self._ticket is None:
                return
            link = self.agreement.link
            assert link is not None
            self._store_rows(link.position, self._collect(link, self._ticket))

    def arrived_within(self, seconds: float) -> bool:
        """True once every replica has made this check (then `wait()` judges it), False if `seconds` pass first."""
        with self._receiving:
            if self._work is not None:
                try:
                    self._work.wait(timedelta(seconds=seconds))
                except RuntimeError:
                    if not self._work.is_completed():
                        return False
                    raise
            if self._ticket is not None:
                assert self.agreement.link is not None
                payloads = self.agreement.link.collect_within(self._ticket, seconds)
                if payloads is None:
                    return False
                self._store_rows(self.agreement.link.position, payloads)
            return True

    def _store_rows(self, position: int, payloads: list[bytes]) -> None:
        mine = self._rows[0]
        self._rows = [mine if at == position else _ROW.unpack(payload) for at, payload in enumerate(payloads)]
        self._ticket = None

    def _collect(self, link: LocalLink, ticket: int) -> list[bytes]:
        watch = self.agreement.watch
        if watch is None:
            return link.collect(ticket)
        deadline = time.monotonic() + link.timeout_s
        waiting: Waiting | None = None
        within = watch.grace_s
        while deadline - time.monotonic() > within:
            payloads = link.collect_within(ticket, within)
            if payloads is not None:
                if waiting is not None:
                    waiting.done()
                return payloads
            waiting = waiting or watch.waiting(self.agreement.name, self.number, self.signature, self.site)
            self._look(waiting)
            within = LOOK_EVERY_S
        return link.collect(ticket, max(deadline - time.monotonic(), 1e-3))

    def _wait_for_backend(self) -> None:
        watch = self.agreement.watch
        if watch is None:
            self._work.wait()
            return
        waiting: Waiting | None = None
        within = watch.grace_s
        while True:
            try:
                self._work.wait(timedelta(seconds=within))
            except RuntimeError:
                if self._work.is_completed():  # the collective itself failed
                    raise
                waiting = waiting or watch.waiting(self.agreement.name, self.number, self.signature, self.site)
                self._look(waiting)
                within = LOOK_EVERY_S
                continue
            if waiting is not None:
                waiting.done()
            return

    def _look(self, waiting: Waiting) -> None:
        assert self.agreement.watch is not None
        self.agreement.watch.settle_others(self.agreement.name)
        theirs = waiting.look()
        if theirs is not None:
            self.agreement.broken = True
            raise ReplicaMismatchError(describe_deadlock(waiting.note, theirs))

    def arrived(self) -> bool:
        """Block until every replica has made this check; True if all made the same one.

        Safe from another thread than the one that started the check (it raises nothing about
        a mismatch: `wait()` does that, with the full intents). A reducer uses it as a barrier.
        """
        self._receive()
        return all(row[0] == self._rows[0][0] for row in self._rows)

    def wait(self) -> Verdict:
        if self._verdict is not None:
            return self._verdict
        agreement = self.agreement
        if agreement._unsettled is self:
            agreement._unsettled = None
        try:
            self._receive()
        except ReplicaMismatchError:
            raise
        except RuntimeError as error:
            agreement.broken = True
            raise_with_stragglers(agreement.group, self.signature, error, debug=agreement.trail)
        columns = list(zip(*self._rows))[: len(self.values) + 1]
        if min(columns[0]) != max(columns[0]):
            agreement.broken = True
            intents = agreement.mismatch_intents(self)
            raise ReplicaMismatchError(describe_mismatch(intents, agreement.rank, agreement.label))
        values = columns[1:]
        self._verdict = Verdict(tuple(map(max, values)), tuple(map(min, values)), tuple(map(sum, values)))
        return self._verdict


_TRAIL_KEY = "replicator/trail/"


def raise_with_stragglers(group: dist.ProcessGroup | None, where: str, error: BaseException, *,
                          debug: bool = False) -> None:
    """Re-raise a failed or timed-out collective naming the replicas that never arrived.

    Costs nothing until something fails: only then does each replica leave a note in the
    job's key-value store saying where it was stuck, wait briefly for the others' notes, and
    report the replicas without one (still computing, stuck elsewhere, or dead). In debug
    mode, the stragglers' trails are read first, before a straggler that wakes up meanwhile
    can move them on.
    """
    me = dist.get_rank()
    try:
        store = job_store()
        ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        trails = {r: store.get(f"{_TRAIL_KEY}{r}").decode()
                  for r in ranks if r != me and store.check([f"{_TRAIL_KEY}{r}"])}
        store.set(f"replicator/stuck/{me}", where)
        deadline = time.monotonic() + _STRAGGLER_GRACE_S
        while time.monotonic() < deadline and not store.check([f"replicator/stuck/{r}" for r in ranks]):
            time.sleep(0.1)
        notes = {r: store.get(f"replicator/stuck/{r}").decode()
                 for r in ranks if store.check([f"replicator/stuck/{r}"])}
        missing = [r for r in ranks if r not in notes]
    except Exception:  # the store itself may be gone with a dead master
        raise ReplicatorError(
            f"a collective failed or timed out while rank {me} waited at '{where}': {error}\n"
            "The job's key-value store is unreachable too: the process that holds it (rank 0, or the launcher) "
            "has probably failed first; its own error says why."
        ) from error
    elsewhere = {r: note for r, note in notes.items() if note != where}
    lines = [f"a collective failed or timed out while rank {me} waited at '{where}': {error}".strip()]
    if missing:
        lines.append(f"  rank(s) {missing} never arrived (still computing, blocked outside a collective, or dead)")
        for rank in missing:
            if rank in trails:
                lines.append(f"  rank {rank}'s last collective (debug trail): {trails[rank]}")
    for rank, note in sorted(elsewhere.items()):
        lines.append(f"  rank {rank} was stuck at '{note}' instead")
    if debug:
        lines.append("Raise REPLICATOR_TIMEOUT if a step legitimately takes longer (debug mode is on: the trails above "
                     "are each straggler's last check).")
    else:
        lines.append("Raise REPLICATOR_TIMEOUT if a step legitimately takes longer; REPLICATOR_DEBUG=1 fingerprints "
                     "every collective and shows where each straggler last was.")
    raise ReplicatorError("\n".join(lines)) from error


_ADVICE = ("Every replica must issue the same collectives in the same order, from the same lines: look for a "
           "collective inside a branch on replica_id or on data that differs between replicas.")


def _headline(signatures: Sequence[str], me: str) -> str:
    """The first line of a mismatch: a facade verb that some replicas skipped is named as such."""
    verbs = sorted({signature.split("(")[0] for signature in signatures if signature.startswith("repl.")})
    if verbs:
        return (f"{verbs[0]}() must be called on every replica, at the same point (raised on {me}); only printing "
                "and logging are safe on one process (`if repl.is_main:`).")
    return f"replicas diverged (raised on {me}): they reached different collectives at the same point."


def describe_mismatch(intents: list[Intent], me: int, label: str = "replica") -> str:
    """A message that groups replicas (or ranks) by what they were doing, most common first."""
    groups: dict[str, list[Intent]] = {}
    for intent in intents:
        groups.setdefault(intent.signature, []).append(intent)
    lines = [_headline(list(groups), f"{label} {me}")]
    for signature, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        replicas = ", ".join(str(m.replica) for m in members)
        sites = sorted({m.site for m in members if m.site})
        where = f" at {'; '.join(sites)}" if sites else ""
        lines.append(f"  {label}(s) {replicas}: {signature}{where}")
    lines.append(_ADVICE)
    return "\n".join(lines)


def describe_deadlock(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Two processes that wait for each other at checks on different channels (notes from stalls.Waiting)."""
    lines = [_headline([mine["check"], theirs["check"]], mine["who"])]
    for note in (mine, theirs):
        where = f" at {note['site']}" if note["site"] else ""
        lines.append(f"  {note['who']} (rank {note['rank']}) waits at {note['check']}{where}, on the channel of "
                     f"{note['channel']}")
    lines.append("Each waits for the other, so neither can go on. " + _ADVICE)
    return "\n".join(lines)
