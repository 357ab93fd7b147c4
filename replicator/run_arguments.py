"""What run() was asked to do, agreed by every replica before its first step, so a mismatch is named at once.

Replicas given different `steps=` (or `epochs=`, `checkpoint_every=`, `checkpoint_dir=`, or
accumulation counts) would run the same steps until the first of them stops, and the others
would then wait for it at their next step until REPLICATOR_TIMEOUT. One agreement check at the
start of run(), carrying a hash of the arguments, catches it: on a mismatch every replica
exchanges its values (all of them see the same verdict, so all take that path together) and
raises the same error, naming each replica's value and the fix.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Protocol

from replicator.asynchronous.regime import Regime
from replicator.comm.agreement import Intent, call_site
from replicator.errors import ReplicaMismatchError
from replicator.job import Job
from replicator.loop import check_run_arguments
from replicator.sync.optimizer import SyncedOptimizers

__all__ = ["agree_on_run_arguments", "Run"]

_TITLES = {"accumulation": "micro-steps per update (repl.accumulate)"}  # how an argument is named in messages
_UNSET = -1  # None, in the numbers an agreement carries: every agreed number is otherwise >= 0 (or a hash)


class Run(Protocol):
    """What the check needs of the Replicator: the job's channel, the optimizers (their accumulation), the regime."""

    job: Job
    optimizers: SyncedOptimizers
    regime: Regime


def agree_on_run_arguments(repl: Run, steps: int | None, epochs: int | None, checkpoint_every: int | None,
                           checkpoint_dir: str | os.PathLike[str] | None) -> None:
    """Raise on a run() request that cannot be honoured (on this replica), or that differs between the replicas.

    The agreement is made by the processes that step together (not by a parameter server, an
    actor or the evaluator), on the step loop's channel, before anything else run() does
    collectively (a resume from `checkpoint_dir` included): the agreement's order makes a
    replica that calls something else instead meet it and fail there too.
    """
    optimizers, agreement = repl.optimizers, repl.job.agreement
    check_run_arguments(steps, checkpoint_every, checkpoint_dir, optimizers.state.accumulation, epochs)
    if agreement.size == 1 or repl.regime.serves:
        return
    directory = "" if checkpoint_dir is None else os.fspath(checkpoint_dir)
    asked: dict[str, Any] = {"steps": steps, "epochs": epochs, "checkpoint_every": checkpoint_every,
                             "accumulation": optimizers.state.accumulation}
    canonical = ";".join(f"{name}={value!r}" for name, value in asked.items()) + f";checkpoint_dir={directory!r}"
    site = call_site()
    verdict = agreement.require_same("repl.run()", site, [zlib.crc32(canonical.encode("utf-8"))])
    if verdict.unanimous:
        return
    numbers = [float(_UNSET if value is None else value) for value in asked.values()]
    # The directory travels as text in the exchange's signature field (its first 256 bytes), its hash as a number.
    intents = agreement.exchange(directory, site, [*numbers, float(zlib.crc32(directory.encode("utf-8")))])
    raise ReplicaMismatchError(describe_run_mismatch(intents, list(asked), agreement.rank, agreement.label))


def describe_run_mismatch(intents: list[Intent], names: list[str], me: int, label: str = "replica") -> str:
    """Each argument whose value differs, with the replicas that were given each value, and what to do."""
    differing = []
    for index, name in enumerate([*names, "checkpoint_dir"]):
        by_value: dict[str, list[int]] = {}
        for intent in intents:
            by_value.setdefault(_shown(name, intent, index), []).append(intent.replica)
        if len(by_value) > 1:
            # The most common value first: with many replicas, the odd ones out stand out.
            listing = "; ".join(f"{value} on {label}(s) {', '.join(map(str, members))}"
                                for value, members in sorted(by_value.items(), key=lambda item: -len(item[1])))
            differing.append(f"  {_TITLES.get(name, name)}: {listing}")
    sites = sorted({intent.site for intent in intents if intent.site})
    where = f" at {'; '.join(sites)}" if sites else ""
    return "\n".join([
        f"run() was given different arguments on different {label}s{where} (raised on {label} {me}):",
        *differing,
        f"Every {label} must run the same steps: the ones that finished first would leave the others waiting for "
        "them until REPLICATOR_TIMEOUT. Pass every replica the same steps=, epochs=, checkpoint_every= and "
        "checkpoint_dir=, and call repl.accumulate() with the same count on each: derive them from the job's "
        "configuration, not from replica_id, the host or a file that only some replicas read.",
    ])


def _shown(name: str, intent: Intent, index: int) -> str:
    """One replica's value of argument `name` (its `index`-th number), as the user wrote it."""
    if name == "checkpoint_dir":
        return repr(intent.signature) if intent.signature else "None"
    if name == "accumulation":
        return str(int(intent.values[index]))
    value = intent.values[index]
    return "None" if value == _UNSET else str(int(value))
