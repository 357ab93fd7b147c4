"""The step loop: every replica runs the same steps, agreed one step ahead; observers see each step."""

from __future__ import annotations

import contextlib
import numbers
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from replicator._tree import flatten, leading_size, leaves_with_paths
from replicator.comm.agreement import Agreement, PendingAgreement, Verdict, call_site
from replicator.context import ReplicaContext
from replicator.epochs import EpochStream
from replicator.errors import NonFiniteError, ReplicaMismatchError, ReplicatorUsageError
from replicator.health import OutputCheck
from replicator.sync.state import GradientState
from replicator.timeline import recorder as timeline

__all__ = ["StepLoop", "Observer", "RunOutcome", "check_run_arguments"]


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


class CollectiveInputs:
    """Whether what this replica fed into each ctx collective was finite, per step not yet judged.

    A NaN that one replica passes to `ctx.all_mean` is every replica's output afterwards; these
    flags let the error name the replica it came from. Each is one device reduction, read only
    when some output was found non-finite.
    """

    def __init__(self) -> None:
        self._current: list[tuple[str, torch.Tensor]] = []
        self._steps: dict[int, list[tuple[str, torch.Tensor]]] = {}

    def record(self, operation: str, tensor: torch.Tensor) -> None:
        if tensor.is_floating_point() or tensor.is_complex():
            self._current.append((f"ctx.{operation}", torch.isfinite(tensor.detach()).all()))

    def close_step(self, step: int) -> None:
        if self._current:
            self._steps[step], self._current = self._current, []

    def forget(self, step: int) -> None:
        """`step` and the steps before it were judged finite."""
        for done in [s for s in self._steps if s <= step]:
            del self._steps[done]

    def nonfinite(self, step: int) -> list[str]:
        return [name for name, finite in self._steps.get(step, []) if not bool(finite)]


class Precision(Protocol):
    """What the loop asks of the job's precision (replicator.sync.precision.MixedPrecision)."""

    def begin_run(self) -> None: ...

    def step(self) -> contextlib.AbstractContextManager[None]: ...


class StepLoop:
    """Runs `step_fn` on this replica's batches until `steps` or until some replica's input runs out.

    Before each step the replicas agree (has a batch? of what size? was an earlier output
    finite?) one step ahead, so the check travels while a step computes. A replica whose
    input ran out stops every replica at the same step; unequal batch sizes (unless weighted:
    `GradientState.count_samples`) and NaN outputs raise on every replica.
    """

    def __init__(self, agreement: Agreement, context: ReplicaContext, state: GradientState, nonfinite: str,
                 precision: Precision | None = None) -> None:
        self.agreement = agreement
        self.precision = precision  # autocast (and fp16's loss scale) around every step_fn call
        self.context = context
        self.state = state
        self.nonfinite = nonfinite
        self._collective_inputs = CollectiveInputs()
        self._counted: tuple[Any, int] | None = None  # the latest batch counted, and its samples

    @property
    def num_replicas(self) -> int:
        return self.context.num_replicas

    @property
    def stages(self) -> int:
        """The processes of the job that announce each replica's batch: its pipeline stages (else 1)."""
        return max(1, self.agreement.size // self.num_replicas)

    def run(self, step_fn: Callable[[ReplicaContext, Any], Any], iterator: EpochStream, steps: int | None,
            observers: list[Observer]) -> Generator[tuple[int, Any], None, RunOutcome]:
        """Yield `(step, output)` per step; return the RunOutcome (use `yield from`)."""
        step = self.state.step
        if self.precision is not None:
            self.precision.begin_run()
        if self.nonfinite == "raise" and self.num_replicas > 1:
            self.context.on_collective = self._collective_inputs.record
        outcome = RunOutcome()
        checks: deque[OutputCheck] = deque()  # outputs not yet judged finite, oldest first
        judged: OutputCheck | None = None  # the one the latest announcement carries
        self.state.in_run = True
        recording = timeline.active()  # the run's timeline, if it records one: a span per step
        try:
            batch, has_batch = self._next_batch(iterator, observers)
            pending = self._announce(step, batch, has_batch, steps, None)
            while steps is None or step < steps:
                started = time.perf_counter()
                began = timeline.clock() if recording is not None else 0.0
                if pending is not None:
                    if self._must_stop(step, pending, has_batch, outcome.ended_early, judged):
                        break
                elif not has_batch:
                    break
                agreed = time.perf_counter() - started
                for observer in observers:
                    observer.on_agreement_wait(agreed)
                size = self._count(batch)
                verdict = pending.wait() if pending is not None else None  # this step's, awaited already
                # The announcement sums over every process of the job: with pipeline stages, each replica's
                # batch once per stage. The step's samples count each replica once.
                total = verdict.sums[1] // self.stages if verdict is not None else size * self.num_replicas
                uneven = verdict is not None and verdict.minima[1] != verdict.maxima[1]
                # The input's position counts samples, whatever count_samples weighs the gradient by.
                self.context.step, self.context.epoch = step, iterator.consume(leading_size(batch))
                # Announce the next step before running this one: the agreement then travels
                # while this step computes, instead of adding a round trip between steps.
                last = steps is not None and step + 1 >= steps
                # epoch_end="flush" reads past the last step too: is this step's batch its epoch's last?
                flushing = self.state.epoch_end == "flush"
                upcoming, has_upcoming = (None, False) if last and not flushing else self._next_batch(iterator,
                                                                                                      observers)
                closes = flushing and iterator.closes_epoch()
                # The announcement judges an earlier step's output: the last one, or the one before
                # while the last is still on its way from a GPU (the host then never waits for it).
                judged = checks.popleft() if len(checks) > 1 or (checks and not checks[0].waits_for_a_device) else None
                pending = self._announce(step + 1, upcoming, has_upcoming, steps, judged, closes)
                computing = time.perf_counter()
                # A replica whose epoch ends here updates only if every replica's does (it waits for the next step's
                # announcement, which says so, once an epoch); else none does, and the next step names them.
                self.state.closing = closes and (pending is None or pending.wait().minima[3] == 1)
                self.state.begin_step(size, total)
                # Inside a step whose replicas hold unequal counts, ctx.all_mean weighs each by its count.
                self.context.sample_share = size / total if uneven and self.state.count_samples else None
                try:
                    with self.precision.step() if self.precision is not None else contextlib.nullcontext():
                        output = step_fn(self.context, batch)
                finally:
                    self.state.end_step()
                    self.state.closing = False
                    self.context.sample_share = None
                check_output(output)
                if recording is not None:
                    recording.add("step", "step", began, timeline.clock(), args={"step": step})
                if self.nonfinite == "raise":
                    checks.append(OutputCheck(output, step))
                    self._collective_inputs.close_step(step)
                seconds = agreed + time.perf_counter() - computing
                self.state.step = step + 1
                for observer in observers:
                    observer.on_step_end(step, total, output, seconds)
                batch, has_batch = upcoming, has_upcoming
                yield step, output
                step += 1
            if steps is not None and step < steps and not outcome.ended_early and self.agreement.rank == 0:
                print(f"replicator: run() stopped at step {step}, before steps={steps}: {iterator.end_reason()}",
                      flush=True)
            if pending is not None:  # the last step's outputs are still to be judged
                self._judge(pending.wait(), judged)
                if steps is not None and step >= steps:  # stopped by steps=, not by an input that ran out
                    self._check_epoch_ends(step - 1, pending)
            while checks:  # outputs not judged yet: one more agreement each
                judged = checks.popleft()
                final = self._announce(step, None, False, step, judged)
                if final is not None:
                    self._judge(final.wait(), judged)
        finally:
            self.context.on_collective = None
            self.state.in_run = False
            for observer in observers:
                observer.on_run_end()
        outcome.steps = step
        return outcome

    @staticmethod
    def _next_batch(iterator: Iterator[Any], observers: list[Observer]) -> tuple[Any, bool]:
        started = time.perf_counter()
        try:
            with timeline.span("input wait", "input"):
                batch, has_batch = next(iterator), True
        except StopIteration:
            batch, has_batch = None, False
        for observer in observers:
            observer.on_input_wait(time.perf_counter() - started)
        return batch, has_batch

    def _announce(self, step: int, batch: Any, has_batch: bool, steps: int | None,
                  judged: OutputCheck | None, closes: bool = False) -> PendingAgreement | None:
        """Start agreeing on the next step (has a batch? of what size?) while the caller works.

        The announcement also carries whether the `judged` step's output (an earlier one)
        was finite, so that every replica learns of a NaN anywhere at no extra cost, and whether
        the step before `step` closes an epoch (`closes`). Past the last step it is still made
        when there is an output to judge, or with epoch_end="flush" (the last step may close one).
        """
        nonfinite = judged.locations() if judged is not None else []
        size = self._count(batch) if has_batch else 0
        if self.num_replicas == 1:
            if judged is not None and nonfinite:
                raise NonFiniteError(self._nonfinite_message(judged.step, {0: nonfinite}))
            return None
        if steps is not None and step >= steps and judged is None and self.state.epoch_end != "flush":
            return None
        # Named by the step this replica is at (announcements travel one step ahead), from the user's loop.
        return self.agreement.start(f"run() at step {self.state.step}, announcing step {step}", call_site(),
                                    [int(has_batch), size, int(bool(nonfinite)), int(closes)])

    def _must_stop(self, step: int, pending: PendingAgreement, has_batch: bool, ended_early: list[int],
                   judged: OutputCheck | None) -> bool:
        """True when some replica has no batch for this step; raises on unequal batch sizes."""
        with timeline.span("agreement wait", "agreement", step=step):
            verdict = pending.wait()
        self._judge(verdict, judged)
        (has_max, size_max, *_), (has_min, size_min, *_) = verdict.maxima, verdict.minima
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
        self._check_epoch_ends(step - 1, pending)
        weighted = self.state.count_samples is not None
        if (size_max != size_min and not weighted) or (weighted and size_min == 0):
            intents = self.agreement.exchange("batch sizes", "", [float(pending.values[1])])
            listing = ", ".join(f"replica {i.replica}: {int(i.values[0])}" for i in intents)
            if weighted:
                raise ReplicatorUsageError(
                    f"some replica has no samples at step {step} ({listing}; raised on replica "
                    f"{self.context.replica_id}): uneven_batches weighs each replica's gradient by its samples, "
                    "and an empty batch's mean loss is NaN. Drop empty batches in input_fn."
                )
            raise ReplicaMismatchError(
                f"replicas have different batch sizes at step {step} ({listing}), raised on replica "
                f"{self.context.replica_id}. Averaging their gradients would weight samples unequally. Use a global "
                "batch divisible by the number of replicas and drop the last partial batch (drop_last=True), or "
                "pass rp.Replicator(uneven_batches=\"weighted\") to weigh each replica by its batch size."
            )
        return False

    def _check_epoch_ends(self, step: int, pending: PendingAgreement) -> None:
        """Raise on every replica if `step` closed an epoch on some replicas only (epoch_end="flush" needs all)."""
        verdict = pending.wait()
        if verdict.maxima[3] == verdict.minima[3]:
            return
        intents = self.agreement.exchange("epoch ends", "", [float(pending.values[3])])
        ending = [i.replica for i in intents if i.values[0]]
        raise ReplicaMismatchError(
            f"step {step} ended an epoch on replica(s) {ending} but not on the others (raised on replica "
            f"{self.context.replica_id}). repl.accumulate(..., epoch_end=\"flush\") updates on every replica "
            "when an epoch ends, so every replica needs as many batches per epoch: shard the data evenly "
            "(ctx.sampler(dataset), or a DataLoader handed to run(), which splits it so), or use epoch_end=\"carry\""
        )

    def _count(self, batch: Any) -> int:
        """The batch's samples (`GradientState.count_samples`, else its leading size), counted once per batch."""
        if self._counted is None or self._counted[0] is not batch:
            self._counted = (batch, int((self.state.count_samples or leading_size)(batch)))
        return self._counted[1]

    def _judge(self, verdict: Verdict, judged: OutputCheck | None) -> None:
        """Raise on every replica if any replica's `judged` output was NaN or infinite."""
        step = judged.step if judged is not None else -1
        if verdict.maxima[2] == 0:
            self._collective_inputs.forget(step)
            return
        nonfinite = judged.locations() if judged is not None else []
        fed = self._collective_inputs.nonfinite(step)  # what this replica put into ctx collectives
        intents = self.agreement.exchange("non-finite outputs", "", [float(bool(nonfinite)), float(step),
                                                                     float(bool(fed))])
        # A NaN that one replica feeds into ctx.all_mean comes out on every replica: blame where it went in.
        feeders = [i.replica for i in intents if i.values[2]]
        culprits = {r: ["(see that replica's error)"] for r in feeders or [i.replica for i in intents if i.values[0]]}
        if feeders and fed:
            culprits[self.context.replica_id] = [f"the input of {name}" for name in fed]
        elif not feeders and nonfinite:
            culprits[self.context.replica_id] = nonfinite
        raise NonFiniteError(self._nonfinite_message(int(max(i.values[1] for i in intents)), culprits,
                                                     through_collective=bool(feeders)))

    def _nonfinite_message(self, step: int, culprits: dict[int, list[str]], through_collective: bool = False) -> str:
        listing = "; ".join(f"replica {replica}: {', '.join(spots)}" for replica, spots in sorted(culprits.items()))
        where = (f"came out of a ctx collective at step {step}, fed a NaN or infinite value by replica(s) "
                 if through_collective else f"is NaN or infinite at step {step} on replica(s) ")
        return (
            f"step_fn's output {where}{sorted(culprits)} ({listing}); raised "
            f"on replica {self.context.replica_id}. Its gradients were averaged into every replica's update. Lower "
            "the learning rate or check the data (a checkpoint from before this step is safe to resume from), or "
            "pass rp.Replicator(nonfinite='skip') to drop such updates on every replica"
        )


def check_run_arguments(steps: int | None, checkpoint_every: int | None, checkpoint_dir: object,
                        accumulation: int, epochs: int | None = None) -> None:
    """Raise on a run() request that cannot be honoured, before any replica starts."""
    for name, value in (("steps", steps), ("epochs", epochs)):
        if value is not None and (not isinstance(value, numbers.Integral) or value < 0):
            raise ReplicatorUsageError(f"{name} must be a whole number >= 0 (or None), got {value!r}")
    if checkpoint_every is not None and (checkpoint_dir is None or checkpoint_every < 1
                                         or checkpoint_every % accumulation):
        raise ReplicatorUsageError(
            f"checkpoint_every={checkpoint_every} needs a checkpoint_dir and must be a positive multiple of the "
            f"accumulation ({accumulation} micro-steps), so that checkpoints fall between updates"
        )


_REDUCIBLE = (torch.Tensor, bool, int, float)


def check_output(output: Any) -> None:
    """step_fn may return tensors, numbers and (nested) dicts, lists and tuples of them."""
    if output is None or isinstance(output, _REDUCIBLE):
        return  # a single loss, the most common output: no walk at all
    if all(leaf is None or isinstance(leaf, _REDUCIBLE) for leaf in flatten(output)[0]):
        return  # the common case, every step: no paths to spell out
    for where, value in leaves_with_paths(output, "the output"):
        if value is not None and not isinstance(value, _REDUCIBLE):
            raise ReplicatorUsageError(
                f"step_fn returned a {type(value).__name__} at {where}, which cannot be reduced across replicas; "
                "return tensors, numbers, or dicts/tuples/lists of them (for example ctx.all_mean(loss.detach()))"
            )
