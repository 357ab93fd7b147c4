"""Automatic recovery: rerun the whole job, each attempt a fresh rendezvous, until it succeeds or runs out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from replicator import _env

__all__ = ["Outcome", "current_attempt", "run_attempts"]


@dataclass
class Outcome:
    """How one attempt ended: success, failed ranks with their exit codes, or stopped by a signal."""

    ok: bool
    failures: dict[int, int] = field(default_factory=dict)  # global rank -> exit code (negative: signal)
    interrupted: bool = False  # the launcher itself was told to stop: never restart then


def current_attempt() -> int:
    """The attempt this process belongs to: 0 on the first run, k after the k-th restart.

    Counts replicator's restarts and, for a job started by plain torchrun, torchrun's own
    (under `replicator launch` torchrun never restarts, so its count stays 0).
    """
    return _env.attempt()


def _say(line: str) -> None:
    print(line, flush=True)  # interleaves in order with the replicas' own output


def run_attempts(run_once: Callable[[int], Outcome], max_restarts: int, log: Callable[[str], None] = _say) -> int:
    """Call `run_once(attempt)` until an attempt succeeds or `max_restarts` restarts are spent.

    Each attempt starts every process anew (the job's code resumes from its last complete
    checkpoint). Restarting the whole group, rather than torchrun's in-place restart of
    workers, means every attempt gets a new rendezvous: no process can dial an earlier
    attempt's dead peers. Returns the exit code: 0, 1 (failed), or 130 (interrupted).
    """
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    for attempt in range(max_restarts + 1):
        outcome = run_once(attempt)
        if outcome.ok:
            if attempt:
                log(f"replicator: the job succeeded on attempt {attempt + 1} of at most {max_restarts + 1}")
            return 0
        lines = [f"replicator: {len(outcome.failures)} replica process(es) failed:"]
        for rank, code in sorted(outcome.failures.items()):
            lines.append(f"  rank {rank}: exit code {code}" + (f" (signal {-code})" if code < 0 else ""))
        log("\n".join(lines))
        if outcome.interrupted:
            log("replicator: the launcher was interrupted; not restarting")
            return 130
        if attempt < max_restarts:
            log(
                f"replicator: restarting the whole job (attempt {attempt + 2} of at most {max_restarts + 1}) with a "
                "fresh rendezvous; it resumes from its last complete checkpoint"
            )
    if max_restarts:
        log(f"replicator: giving up after {max_restarts + 1} attempts")
    return 1
