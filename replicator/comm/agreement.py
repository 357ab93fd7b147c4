"""Replicas agree before they communicate, so divergence fails fast and names the culprit.

Before a collective whose partners could differ (a user's collective, the first gradient
bucket of a step, the start of a step), every replica announces what it is about to do, on
the control group or, among the processes of one node, over a LocalLink. Every announcement
has the same size, so mismatched replicas still complete the exchange, see that they
differ, then swap full intents (operation and call site) and raise the same clear error
together, instead of hanging or feeding wrong-sized buffers to Gloo.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

import numpy as np
import torch
import torch.distributed as dist

from replicator.comm.local_link import LocalLink
from replicator.errors import ReplicaMismatchError

__all__ = ["Agreement", "PendingAgreement", "Verdict", "Intent", "call_site"]

_SIGNATURE_BYTES = 256
_SITE_BYTES = 128
_VALUE_SLOTS = 16
_CHECK_VALUES = 4  # numbers one agreement check carries beside the signature's hash
_MESSAGE_BYTES = _SIGNATURE_BYTES + _SITE_BYTES + 8 * _VALUE_SLOTS
_STRAGGLER_GRACE_S = 5.0
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # replicator/, not comm/


def call_site() -> str:
    """'file.py:42 in step_fn' for the innermost frame outside replicator itself."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
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
    can say where each straggler was.
    """

    def __init__(self, group: dist.ProcessGroup | None, trail: bool = False, link: LocalLink | None = None) -> None:
        self.group = group
        self.link = link
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.trail = trail and group is not None
        self._checks = 0

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
        """
        if self.trail:
            self._checks += 1
            where = f" at {site}" if site else ""
            _store().set(f"{_TRAIL_KEY}{dist.get_rank()}", f"check #{self._checks} of its group: {signature}{where}")
        return PendingAgreement(self, signature, site, [int(v) for v in values])


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
        padding = [0] * (_CHECK_VALUES - len(values))
        mine = torch.tensor([zlib.crc32(signature.encode("utf-8")), *values, *padding], dtype=torch.int64)
        self._rows = [mine]
        self._work = None
        self._ticket: int | None = None
        self._receiving = threading.Lock()  # the reducer's thread and the caller's may both wait
        if agreement.link is not None:
            self._ticket = agreement.link.post(mine.numpy().tobytes())
        elif agreement.group is not None:
            self._rows = [torch.empty_like(mine) for _ in range(agreement.size)]
            self._work = dist.all_gather(self._rows, mine, group=agreement.group, async_op=True)
        self._verdict: Verdict | None = None

    def _receive(self) -> None:
        if self._work is not None:
            self._work.wait()
            return
        with self._receiving:
            if self._ticket is None:
                return
            link = self.agreement.link
            assert link is not None
            payloads = link.collect(self._ticket)
            mine = self._rows[0]
            self._rows = [mine if at == link.position else torch.frombuffer(bytearray(payload), dtype=torch.int64)
                          for at, payload in enumerate(payloads)]
            self._ticket = None

    def arrived(self) -> bool:
        """Block until every replica has made this check; True if all made the same one.

        Safe from another thread than the one that started the check (it raises nothing about
        a mismatch: `wait()` does that, with the full intents). A reducer uses it as a barrier.
        """
        self._receive()
        return all(int(row[0]) == int(self._rows[0][0]) for row in self._rows)

    def wait(self) -> Verdict:
        if self._verdict is not None:
            return self._verdict
        try:
            self._receive()
        except RuntimeError as error:
            raise_with_stragglers(self.agreement.group, self.signature, error)
        rows = torch.stack(self._rows)
        maxima, minima = rows.amax(dim=0).tolist(), rows.amin(dim=0).tolist()
        if maxima[0] != minima[0]:
            intents = self.agreement.exchange(self.signature, self.site, [float(v) for v in self.values])
            raise ReplicaMismatchError(describe_mismatch(intents, self.agreement.rank))
        count = len(self.values) + 1
        sums = rows[:, 1:count].sum(dim=0).tolist()
        self._verdict = Verdict(tuple(maxima[1:count]), tuple(minima[1:count]), tuple(sums))
        return self._verdict


_TRAIL_KEY = "replicator/trail/"


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def raise_with_stragglers(group: dist.ProcessGroup | None, where: str, error: BaseException) -> None:
    """Re-raise a failed or timed-out collective naming the replicas that never arrived.

    Costs nothing until something fails: only then does each replica leave a note in the
    job's key-value store saying where it was stuck, wait briefly for the others' notes, and
    report the replicas without one (still computing, stuck elsewhere, or dead).
    """
    from replicator.errors import ReplicatorError

    try:
        store = _store()
        ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        me = dist.get_rank()
        store.set(f"replicator/stuck/{me}", where)
        deadline = time.monotonic() + _STRAGGLER_GRACE_S
        while time.monotonic() < deadline and not store.check([f"replicator/stuck/{r}" for r in ranks]):
            time.sleep(0.1)
        notes = {r: store.get(f"replicator/stuck/{r}").decode()
                 for r in ranks if store.check([f"replicator/stuck/{r}"])}
        missing = [r for r in ranks if r not in notes]
        trails = {r: store.get(f"{_TRAIL_KEY}{r}").decode() for r in missing if store.check([f"{_TRAIL_KEY}{r}"])}
    except Exception:  # the store itself may be gone with a dead master: keep the original error
        raise error from None
    elsewhere = {r: note for r, note in notes.items() if note != where}
    lines = [f"a collective failed or timed out while rank {me} waited at '{where}': {error}".strip()]
    if missing:
        lines.append(f"  rank(s) {missing} never arrived (still computing, blocked outside a collective, or dead)")
        for rank, trail in sorted(trails.items()):
            lines.append(f"  rank {rank}'s last collective (debug trail): {trail}")
    for rank, note in sorted(elsewhere.items()):
        lines.append(f"  rank {rank} was stuck at '{note}' instead")
    lines.append("Raise REPLICATOR_TIMEOUT if a step legitimately takes longer; REPLICATOR_DEBUG=1 fingerprints every "
                 "collective and shows where each straggler last was.")
    raise ReplicatorError("\n".join(lines)) from error


def describe_mismatch(intents: list[Intent], me: int) -> str:
    """A message that groups replicas by what they were doing, most common first."""
    groups: dict[str, list[Intent]] = {}
    for intent in intents:
        groups.setdefault(intent.signature, []).append(intent)
    lines = [f"replicas diverged (raised on replica {me}): they reached different collectives at the same point."]
    for signature, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        replicas = ", ".join(str(m.replica) for m in members)
        sites = sorted({m.site for m in members if m.site})
        where = f" at {'; '.join(sites)}" if sites else ""
        lines.append(f"  replica(s) {replicas}: {signature}{where}")
    lines.append(
        "Every replica must issue the same collectives in the same order: look for a collective "
        "inside a branch on replica_id or on data that differs between replicas."
    )
    return "\n".join(lines)
