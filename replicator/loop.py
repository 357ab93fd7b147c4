"""The step loop: every replica runs the same steps, agreed one step ahead; observers see each step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from replicator._tree import flatten, leading_size, leaves_with_paths
from replicator.comm.agreement import Agreement, PendingAgreement, Verdict, call_site
from replicator.context import ReplicaContext
from replicator.errors import NonFiniteError, ReplicaMismatchError, ReplicatorUsageError
from replicator.health import OutputCheck
from replicator.inputs import ReplicatedInput
from replicator.sync.state import GradientState

__all__ = ["StepLoop", "Observer", "InputPosition", "RunOutcome", "Checkpointer", "check_run_arguments"]


class Observer(Protocol):
    """Told about a run's steps, in the manner of acme's EnvironmentLoop observers."""

    def on_input_wait(self, seconds: float) -> None:
        """The loop waited `seconds` for a batch."""

    def on_agreement_wait(self, seconds: float) -> None:
        """The loop waited `seconds` for the replicas to agree on the next step."""

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        """Step `step` ran over `samples` samples (all replicas) in `seconds`; `global_step` is `step + 1`."""

    def on_run_end(self) -> None:
        """The run ended, normally or by an exception."""


@dataclass
class RunOutcome:
    """How a run ended: the step it stopped at, and the replicas whose input ran out first."""

    steps: int = 0
    ended_early: list[int] = field(default_factory=list)


class InputPosition:
    """Where the training's input stands, for checkpoints: a restored position, or counted from a run's start."""

    def __init__(self) -> None:
        self.inputs: Iterable[Any] | None = None
        self.start = (0, 0)  # (step, batches consumed) when the current run's input began
        self.pending: dict[str, Any] | None = None  # a restored position, for the next run

    def begin(self, inputs: Iterable[Any], step: int) -> Iterator[Any]:
        """Iterate `inputs`, from where a restored checkpoint left them if there is one."""
        pending, self.pending = self.pending, None
        skip = int(pending["batches"]) if pending else 0
        if isinstance(inputs, ReplicatedInput):
            if pending is not None:
                inputs.load_state_dict(pending)
            iterator = iter(inputs)
        else:
            # A plain iterable can only be skipped through: right for lists and other
            # re-iterable inputs that yield the same batches every time.
            iterator = iter(inputs)
            for _ in range(skip):
                next(iterator, None)
        self.inputs, self.start = inputs, (step, skip)
        return iterator

    def state_dict(self, step: int) -> dict[str, Any]:
        """The input position at `step`, for a checkpoint."""
        if self.pending is not None:  # restored, not yet run: save what was restored
            return dict(self.pending)
        start_step, start_batches = self.start
        batches = start_batches + step - start_step  # one batch per step; a prefetched one is not consumed
        if isinstance(self.inputs, ReplicatedInput):
            return self.inputs.state_dict(batches)
        return {"epoch": 0, "batches": batches}


class Checkpointer:
    """Saves the training after every `every`-th step through `save(step)`, a checkpoint cadence observer."""

    def __init__(self, every: int, save: Callable[[int], object]) -> None:
        self.every = every
        self.save = save

    def on_input_wait(self, seconds: float) -> None:
        pass

    def on_agreement_wait(self, seconds: float) -> None:
        pass

    def on_step_end(self, step: int, samples: int, output: Any, seconds: float) -> None:
        if (step + 1) % self.every == 0:
            self.save(step + 1)

    def on_run_end(self) -> None:
        pass


class StepLoop:
    """Runs `step_fn` on this replica's batches until `steps` or until some replica's input runs out.

    Before each step the replicas agree (has a batch? of what size? was an earlier output
    finite?) one step ahead, so the check travels while a step computes. A replica whose
    input ran out stops every replica at the same step; unequal batch sizes and NaN outputs
    raise on every replica.
    """

    def __init__(self, agreement: Agreement, context: ReplicaContext, state: GradientState, nonfinite: str) -> None:
        self.agreement = agreement
        self.context = context
        self.state = state
        self.nonfinite = nonfinite

    @property
    def num_replicas(self) -> int:
        return self.context.num_replicas

    def run(self, step_fn: Callable[[ReplicaContext, Any], Any], iterator: Iterator[Any], steps: int | None,
            observers: list[Observer]) -> Generator[tuple[int, Any], None, RunOutcome]:
        """Yield `(step, output)` per step; return the RunOutcome (use `yield from`)."""
        step = self.state.step
        outcome = RunOutcome()
        checks: deque[OutputCheck] = deque()  # outputs not yet judged finite, oldest first
        judged: OutputCheck | None = None  # the one the latest announcement carries
        try:
            batch, has_batch = self._next_batch(iterator, observers)
            pending = self._announce(step, batch, has_batch, steps, None)
            while steps is None or step < steps:
                started = time.perf_counter()
                if pending is not None:
                    if self._must_stop(step, pending, has_batch, outcome.ended_early, judged):
                        break
                elif not has_batch:
                    break
                agreed = time.perf_counter() - started
                for observer in observers:
                    observer.on_agreement_wait(agreed)
                size = leading_size(batch)
                self.context.step = step
                # Announce the next step before running this one: the agreement then travels
                # while this step computes, instead of adding a round trip between steps.
                last = steps is not None and step + 1 >= steps
                upcoming, has_upcoming = (None, False) if last else self._next_batch(iterator, observers)
                # The announcement judges an earlier step's output: the last one, or the one before
                # while the last is still on its way from a GPU (the host then never waits for it).
                judged = checks.popleft() if len(checks) > 1 or (checks and not checks[0].waits_for_a_device) else None
                pending = self._announce(step + 1, upcoming, has_upcoming, steps, judged)
                computing = time.perf_counter()
                output = step_fn(self.context, batch)
                check_output(output)
                if self.nonfinite == "raise":
                    checks.append(OutputCheck(output, step))
                seconds = agreed + time.perf_counter() - computing
                self.state.step = step + 1
                for observer in observers:
                    observer.on_step_end(step, size * self.num_replicas, output, seconds)
                batch, has_batch = upcoming, has_upcoming
                yield step, output
                step += 1
            if pending is not None:  # the last step's outputs are still to be judged
                self._judge(pending.wait(), judged)
            while checks:  # outputs not judged yet: one more agreement each
                judged = checks.popleft()
                final = self._announce(step, None, False, step, judged)
                if final is not None:
                    self._judge(final.wait(), judged)
        finally:
            for observer in observers:
                observer.on_run_end()
        outcome.steps = step
        return outcome

    @staticmethod
    def _next_batch(iterator: Iterator[Any], observers: list[Observer]) -> tuple[Any, bool]:
        started = time.perf_counter()
        try:
            batch, has_batch = next(iterator), True
        except StopIteration:
            batch, has_batch = None, False
        for observer in observers:
            observer.on_input_wait(time.perf_counter() - started)
        return batch, has_batch

    def _announce(self, step: int, batch: Any, has_batch: bool, steps: int | None,
                  judged: OutputCheck | None) -> PendingAgreement | None:
        """Start agreeing on the next step (has a batch? of what size?) while the caller works.

        The announcement also carries whether the `judged` step's output (an earlier one)
        was finite, so that every replica learns of a NaN anywhere at no extra cost. Past the
        last step it is still made when there is an output to judge.
        """
        nonfinite = judged.locations() if judged is not None else []
        if self.num_replicas == 1:
            if judged is not None and nonfinite:
                raise NonFiniteError(self._nonfinite_message(judged.step, {0: nonfinite}))
            return None
        if steps is not None and step >= steps and judged is None:
            return None
        size = leading_size(batch) if has_batch else 0
        # Named by the step this replica is at (announcements travel one step ahead), from the user's loop.
        return self.agreement.start(f"run() at step {self.state.step}, announcing step {step}", call_site(),
                                    [int(has_batch), size, int(bool(nonfinite))])

    def _must_stop(self, step: int, pending: PendingAgreement, has_batch: bool, ended_early: list[int],
                   judged: OutputCheck | None) -> bool:
        """True when some replica has no batch for this step; raises on unequal batch sizes."""
        verdict = pending.wait()
        self._judge(verdict, judged)
        (has_max, size_max, _), (has_min, size_min, _) = verdict.maxima, verdict.minima
        if has_min == 0:
            if has_max == 1:  # some replicas still had data: say who ran out
                intents = self.agreement.exchange("input ended", "", [float(has_batch)])
                ended_early.extend(i.replica for i in intents if not i.values[0])
                if self.agreement.rank == 0:
                    print(
                        f"replicator: input ran out on replica(s) {ended_early} at step {step} while others had "
                        "more; every replica stops here (shard evenly, e.g. ctx.sampler(..., drop_last=True))",
                        flush=True,
                    )
            return True
        if size_max != size_min:
            intents = self.agreement.exchange("batch sizes", "", [float(pending.values[1])])
            listing = ", ".join(f"replica {i.replica}: {int(i.values[0])}" for i in intents)
            raise ReplicaMismatchError(
                f"replicas have different batch sizes at step {step} ({listing}), raised on replica "
                f"{self.context.replica_id}. Averaging their gradients would weight samples unequally. Use a global "
                "batch divisible by the number of replicas and drop the last partial batch (drop_last=True)."
            )
        return False

    def _judge(self, verdict: Verdict, judged: OutputCheck | None) -> None:
        """Raise on every replica if any replica's `judged` output was NaN or infinite."""
        if verdict.maxima[2] == 0:
            return
        nonfinite = judged.locations() if judged is not None else []
        step = judged.step if judged is not None else -1
        intents = self.agreement.exchange("non-finite outputs", "", [float(bool(nonfinite)), float(step)])
        culprits = {i.replica: ["(see that replica's error)"] for i in intents if i.values[0]}
        if nonfinite:
            culprits[self.context.replica_id] = nonfinite
        raise NonFiniteError(self._nonfinite_message(int(max(i.values[1] for i in intents)), culprits))

    def _nonfinite_message(self, step: int, culprits: dict[int, list[str]]) -> str:
        listing = "; ".join(f"replica {replica}: {', '.join(spots)}" for replica, spots in sorted(culprits.items()))
        return (
            f"step_fn's output is NaN or infinite at step {step} on replica(s) {sorted(culprits)} ({listing}); raised "
            f"on replica {self.context.replica_id}. Its gradients were averaged into every replica's update. Lower "
            "the learning rate or check the data (a checkpoint from before this step is safe to resume from), or "
            "pass rp.Replicator(nonfinite='skip') to drop such updates on every replica"
        )


def check_run_arguments(steps: int | None, checkpoint_every: int | None, checkpoint_dir: object,
                        accumulation: int) -> None:
    """Raise on a run() request that cannot be honoured, before any replica starts."""
    if steps is not None and steps < 0:
        raise ReplicatorUsageError(f"steps must be >= 0, got {steps}")
    if checkpoint_every is not None and (checkpoint_dir is None or checkpoint_every < 1
                                         or checkpoint_every % accumulation):
        raise ReplicatorUsageError(
            f"checkpoint_every={checkpoint_every} needs a checkpoint_dir and must be a positive multiple of the "
            f"accumulation ({accumulation} micro-steps), so that checkpoints fall between updates"
        )


_REDUCIBLE = (torch.Tensor, bool, int, float)


def check_output(output: Any) -> None:
    """step_fn may return tensors, numbers and (nested) dicts, lists and tuples of them."""
    if all(leaf is None or isinstance(leaf, _REDUCIBLE) for leaf in flatten(output)[0]):
        return  # the common case, every step: no paths to spell out
    for where, value in leaves_with_paths(output, "the output"):
        if value is not None and not isinstance(value, _REDUCIBLE):
            raise ReplicatorUsageError(
                f"step_fn returned a {type(value).__name__} at {where}, which cannot be reduced across replicas; "
                "return tensors, numbers, or dicts/tuples/lists of them (for example ctx.all_mean(loss.detach()))"
            )
