"""Internal: the actor–learner protocol: the frames actors and learners send over the peer link, and the job-store
keys both sides read.

Each learner serves two links (comm.peer_server.PeerServer), each from its own thread: the
*insert* link, on which an actor streams chunks of transitions without waiting for a reply and
the learner answers with credits (how many items the actor may have sent in all, Reverb's way
of carrying back pressure), and the *weights* link, on which an actor asks for the newest
weights. Frames carry int64 tensors and the transitions' own columns; store values are decimal
numbers or plain text (errors, the transition format), never pickled objects.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from replicator.comm.frames import FIRST_USER_KIND
from replicator.comm.store import job_store

__all__ = ["store", "join_store", "adopt", "JOIN", "CHUNK", "BYE", "CREDIT", "PULL", "WEIGHTS", "UNCHANGED", "LAYOUT",
           "CREDIT_FIXED",
           "Keys", "lag_summary", "LAG_BINS", "post_abort", "read_abort"]

# Actor to learner, on the insert link.
JOIN = FIRST_USER_KIND  # int64 [actor index, run, env steps]: who this connection is, sent once
CHUNK = FIRST_USER_KIND + 1  # int64 [count, weights version, env steps], then the columns of `count` transitions
BYE = FIRST_USER_KIND + 2  # int64 [env steps] (none on the weights link): actor_fn returned; nothing more comes
# Learner to actor, on the insert link: int64 [items granted in all, learner step, done, aborted, then each
# actor's liveness (1 alive)]. Sent when the grant grows, at the end of the run, and every second besides.
CREDIT = FIRST_USER_KIND + 3
CREDIT_FIXED = 4

# Actor to learner, on the weights link: int64 [actor index, weights version held, layout checksum].
PULL = FIRST_USER_KIND + 4
# Learner to actor, on the weights link; the frame's request field holds the version.
WEIGHTS = FIRST_USER_KIND + 5  # the flat per-dtype buffers of that version
UNCHANGED = FIRST_USER_KIND + 6  # the actor holds the newest version already
LAYOUT = FIRST_USER_KIND + 7  # the actor's modules differ from the learners' (the description is in the store)

LAG_BINS = 1024  # policy lags counted exactly up to here; larger ones land in the last bin


class Keys:
    """Where the actor–learner job keeps its shared notes in the job's store."""

    prefix = "replicator/al/"
    abort = prefix + "abort"  # the first failure's text: every process raises it
    abort_count = prefix + "abort-count"  # who failed first
    spec = prefix + "spec"  # the transition format, fixed by the first transition of the job
    layout = prefix + "layout"  # the learners' modules, described line by line (for an actor whose differ)

    run = prefix + "run"  # the learners' current run() number, for an actor that joins a running job
    shape = prefix + "shape"  # "learners actors evaluator", for the same
    transport = prefix + "transport"  # "socket" or "gloo" (REPLICATOR_PEER_LINK=0): a joiner needs sockets

    @classmethod
    def insert_link(cls, run: int, learner: int) -> str:
        """The name a learner's insert link is published under (comm.peer_link)."""
        return f"al/run{run}/insert{learner}"

    @classmethod
    def weights_link(cls, run: int, learner: int) -> str:
        return f"al/run{run}/weights{learner}"

    @classmethod
    def done(cls, run: int) -> str:
        return f"{cls.prefix}run{run}/done"

    @classmethod
    def end_request(cls, run: int) -> str:
        """Who asked the learners to end run `run` early, and why (ActorContext.end_run)."""
        return f"{cls.prefix}run{run}/end-request"

    @classmethod
    def end_at(cls, run: int) -> str:
        """The number of batches after which every learner's sampler ends, fixed by the first learner to see the
        request."""
        return f"{cls.prefix}run{run}/end-at"

    @classmethod
    def env_steps(cls, actor: int) -> str:
        return f"{cls.prefix}env{actor}"

    @classmethod
    def learner(cls, index: int) -> str:
        return f"{cls.prefix}learner{index}"


_stores: dict[int, dist.Store] = {}  # the actor–learner store of each job store met (a process may run jobs in turn)
LATEST = "replicator/al/latest"  # in the job's root store: the id of the newest actor–learner job, for joiners


def store() -> dist.Store:
    """Where the actor–learner job keeps its notes and the peer links their addresses and token: a namespace of the
    store's root (the launcher's TCPStore) under an id the job draws once, so that an actor outside the
    torch.distributed world can reach it with the root's address alone (`join_store`)."""
    base = _joined if _joined is not None else job_store()
    found = _stores.get(id(base))
    if found is None:
        if _joined is not None:
            return _joined
        ident = base.compare_set(Keys.prefix + "id", "", secrets.token_hex(8)).decode("ascii")
        root = base
        while isinstance(root, dist.PrefixStore):
            root = root.underlying_store
        root.set(LATEST, ident)
        found = _stores[id(base)] = dist.PrefixStore(f"{Keys.prefix}{ident}/", root)
    return found


_joined: dist.Store | None = None


def join_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """The actor–learner store of a job reached from outside its world: the root store at host:port (the job's
    MASTER_ADDR and MASTER_PORT), the newest actor–learner job in it. `adopt` it to make it this process's."""
    root = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    root.wait([LATEST], timedelta(seconds=timeout_s))
    ident = root.get(LATEST).decode("ascii")
    return dist.PrefixStore(f"{Keys.prefix}{ident}/", root)


def adopt(joined: dist.Store) -> None:
    """From now on `store()` is `joined` (a joining actor's, once it is sure it can join)."""
    global _joined
    _joined = joined


def post_abort(message: str) -> None:
    """Record the job's first failure for every process to raise; later ones keep theirs."""
    try:
        handle = store()
        if handle.add(Keys.abort_count, 1) == 1:
            handle.set(Keys.abort, message)
    except RuntimeError:
        pass  # the store is gone: the job is ending around us and its peers see that


def read_abort() -> str | None:
    try:
        handle = store()
        return handle.get(Keys.abort).decode("utf-8", "replace") if handle.check([Keys.abort]) else None
    except RuntimeError:
        return None


def lag_summary(histogram: torch.Tensor) -> dict[str, float | int | None]:
    """min, median, p95 and max of the policy lags counted in `histogram` (bin k: lag k, the last: k or more)."""
    counts = histogram.to(torch.int64).numpy()
    total = int(counts.sum())
    if total == 0:
        return {"count": 0, "min": None, "median": None, "p95": None, "max": None}
    cumulative = np.cumsum(counts)
    nonzero = np.nonzero(counts)[0]

    def quantile(q: float) -> int:
        return int(np.searchsorted(cumulative, q * total, side="left"))

    return {"count": total, "min": int(nonzero[0]), "median": quantile(0.5), "p95": quantile(0.95),
            "max": int(nonzero[-1])}
