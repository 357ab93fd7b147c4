"""Automatic recovery: rerun the whole job, each attempt a fresh rendezvous, until it succeeds or runs out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from replicator import _env
from replicator.launch.report import RankError, failure_lines, interrupted_line

__all__ = ["Outcome", "current_attempt", "run_attempts"]


@dataclass
class Outcome:
    """How one attempt ended: success, failed ranks with their exit codes, or stopped by a signal."""

    ok: bool
    failures: dict[int, int] = field(default_factory=dict)  # global rank -> exit code (negative: signal)
    interrupted: bool = False  # the launcher itself was told to stop: never restart then
    errors: dict[int, RankError] = field(default_factory=dict)  # what failed ranks recorded, where they did
    stopped: list[int] = field(default_factory=list)  # this node's ranks the launcher stopped while they ran


def current_attempt() -> int:
    """The attempt this process belongs to: 0 on the first run, k after the k-th restart.

    The launcher's messages number attempts the same way ("attempt 1 (restart 1 of at most 2)").

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
                log(f"replicator: the job succeeded on attempt {attempt} (restart {attempt} of at most {max_restarts})")
            return 0
        if outcome.interrupted:
            log(interrupted_line(outcome.stopped) + ("; not restarting" if max_restarts else ""))
            return 130
        where = f" on attempt {attempt}" if max_restarts else ""
        log("\n".join([f"replicator: the job failed{where}:",
                       *failure_lines(outcome.failures, outcome.errors, outcome.stopped)]))
        if attempt < max_restarts:
            log(
                f"replicator: restarting the whole job: attempt {attempt + 1} (restart {attempt + 1} of at most "
                f"{max_restarts}) with a fresh rendezvous; it resumes from its last complete checkpoint"
            )
    if max_restarts:
        log(f"replicator: giving up after {max_restarts} restart(s)")
    return 1
