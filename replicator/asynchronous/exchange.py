"""Internal: the actor–learner protocol: request and reply headers, statuses, and the job-store keys both sides read.

An actor takes a ticket at a learner (asynchronous.wire.Tickets), then sends an int64 header
and, for an insert, one uint8 tensor of packed transitions; the learner's service thread
answers with an int64 header and, for a pull, the weights. Store values are decimal numbers
or plain text (errors, the transition format), never pickled objects.
"""

from __future__ import annotations

import numpy as np
import torch

from replicator.asynchronous import wire
from replicator.comm.store import job_store

__all__ = ["PULL", "INSERT", "WAIT", "BYE", "OK", "ABORTED", "LAYOUT", "REQUEST", "reply_size",
           "Keys", "lag_summary", "LAG_BINS", "post_abort", "read_abort"]

# Requests (the header's first number). PULL and BYE reuse the parameter servers' codes.
PULL = wire.PULL  # the newest weights, now
BYE = wire.DONE  # this actor's actor_fn returned: expect nothing more from it (no reply)
INSERT = 4  # these transitions; answer when this actor may go on
WAIT = 5  # nothing new: answer when this actor may go on (count 1: hold the answer until then; 0: answer now)

# Reply statuses.
OK = wire.OK
ABORTED = 2  # some process failed; the text is in the store (Keys.abort)
LAYOUT = 3  # the actor's modules differ from the learners' (the learner's description is in the store)

# A request: kind, sender index, its weights' version, its env steps, transitions that follow, its layout checksum.
REQUEST = 6
# A reply: status, version of the weights (sent or newest), done, may go on, then each actor's liveness (1 alive).
REPLY_FIXED = 4

LAG_BINS = 1024  # policy lags counted exactly up to here; larger ones land in the last bin


def reply_size(others: int) -> int:
    return REPLY_FIXED + others




class Keys:
    """Where the actor–learner job keeps its shared notes in the job's store."""

    prefix = "replicator/al/"
    abort = prefix + "abort"  # the first failure's text: every process raises it
    abort_count = prefix + "abort-count"  # who failed first
    spec = prefix + "spec"  # the transition format, fixed by the first transition of the job
    layout = prefix + "layout"  # the learners' modules, described line by line (for an actor whose differ)

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


def post_abort(message: str) -> None:
    """Record the job's first failure for every process to raise; later ones keep theirs."""
    try:
        handle = job_store()
        if handle.add(Keys.abort_count, 1) == 1:
            handle.set(Keys.abort, message)
    except RuntimeError:
        pass  # the store is gone: the job is ending around us and its peers see that


def read_abort() -> str | None:
    try:
        handle = job_store()
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
