"""How the replicas of a pipeline end a training step together: all go on, or all drop it with one PipelineError."""

from __future__ import annotations

import re
from dataclasses import dataclass

from replicator.comm.agreement import Agreement
from replicator.pipeline.step import PipelineError

__all__ = ["Outcome", "gather_outcomes", "replicas_failed"]

_SIGNATURE = "pipeline train_step outcome"
_RANK = re.compile(r" \(rank \d+\)")


@dataclass(frozen=True)
class Outcome:
    """How one process's training step went: its failure as its pipeline described it, or None."""

    replica: int
    stage: int
    failure: str | None


def gather_outcomes(agreement: Agreement, replica: int, stage: int, failure: str | None) -> list[Outcome]:
    """Every process's outcome, on every process of `agreement`'s group; [] when every step succeeded.

    A success costs one agreement check of a flag. Only when some process failed do all of
    them swap their failure texts, so that every one can raise the same error.
    """
    verdict = agreement.require_same(_SIGNATURE, values=[int(failure is not None)])
    if not verdict.maxima[0]:
        return []
    intents = agreement.exchange(failure or "", values=[replica, stage, int(failure is not None)])
    return [Outcome(int(i.values[0]), int(i.values[1]), i.signature if i.values[2] else None) for i in intents]


def replicas_failed(own: PipelineError | None, outcomes: list[Outcome]) -> PipelineError:
    """The error every process raises after a step that failed on some replica (`own`: this process's, if any).

    Each replica's failure is named once, without the rank that reported it, so that the
    same failure on every replica reads as such.
    """
    failures: dict[int, str] = {}
    replicas: set[int] = set()
    for outcome in outcomes:
        replicas.add(outcome.replica)
        if outcome.failure is not None:
            failures.setdefault(outcome.replica, _RANK.sub("", outcome.failure))
    succeeded = sorted(replicas - set(failures))
    kinds: dict[str, list[int]] = {}
    for replica, reason in sorted(failures.items()):
        kinds.setdefault(reason, []).append(replica)
    if not succeeded and len(kinds) == 1:
        (reason,) = kinds
        text = (f"pipeline step failed on every replica alike: {reason}. Every replica dropped this step's gradient "
                "averaging; zero the gradients before the next step")
    else:
        named = "; ".join(f"on replica(s) {_listed(group)}: {reason}" for reason, group in kinds.items())
        went_on = f"; it succeeded on replica(s) {_listed(succeeded)}" if succeeded else ""
        text = (f"pipeline step failed {named}{went_on}. Every replica dropped this step's gradient averaging, so "
                "the replicas stay identical; zero the gradients before the next step")
    return PipelineError(text, reason=own.reason if own is not None else next(iter(kinds)))


def _listed(replicas: list[int]) -> str:
    return ", ".join(str(r) for r in replicas)
