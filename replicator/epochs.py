"""A run's input over epochs: each epoch's sampler told, every batch's place kept, resume without re-reading."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from replicator._tree import to_device
from replicator.context import InputContext
from replicator.errors import ReplicatorUsageError
from replicator.inputs import (
    ReplicatedInput,
    generators,
    resume_iterator,
    set_epoch,
    shard_loader,
    skips_without_reading,
)

if TYPE_CHECKING:
    from replicator.checkpoint import Restored

__all__ = ["Place", "EpochStream", "InputPosition"]

_GLOBAL = "torch"  # the global generator's entry among an epoch's generator states


@dataclass
class Place:
    """Where a batch sits: batch `index` of `epoch`, and the generator states that re-create it.

    `epoch_rng` holds the states of the global torch generator and of the loader's own
    generators as the epoch began (its order and worker seeds are drawn from them);
    `fetch_rng`, the global torch generator's just before the batch was read (random
    transforms in the main process draw from it).
    """

    epoch: int = 0
    index: int = 0
    epoch_rng: dict[str, torch.Tensor] = field(default_factory=dict)
    fetch_rng: torch.Tensor | None = None

    def state_dict(self, global_batch: int | None) -> dict[str, Any]:
        """For a checkpoint: JSON numbers for the job, tensors for this process (the keys of earlier releases kept)."""
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self.index}
        if global_batch is not None:
            state["global_batch"] = global_batch
        for role, value in self.epoch_rng.items():
            state["epoch_rng" if role == _GLOBAL else f"epoch_rng_{role}"] = value
        if self.fetch_rng is not None:
            state["fetch_rng"] = self.fetch_rng
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Place:
        epoch_rng = {(_GLOBAL if key == "epoch_rng" else key[len("epoch_rng_"):]): value
                     for key, value in state.items() if key.startswith("epoch_rng")}
        return cls(int(state.get("epoch", 0)), int(state.get("batches", 0)), epoch_rng, state.get("fetch_rng"))


class EpochStream(Iterator[Any]):
    """The batches of a run, epoch after epoch, each on this replica's device, with its place remembered.

    The step loop reads one batch ahead, so a batch is fetched before it is trained on: the
    places of fetched batches wait in a queue until `consume()` says the step took one. A
    checkpoint records the first batch not trained on; a resumed stream starts there, with
    the generators set back so that the order, the worker seeds and the batch itself come out
    as they did (`resume_iterator` skips without reading where it can).
    """

    def __init__(self, source: Iterable[Any], device: torch.device, start: Place, num_replicas: int,
                 say: Callable[[str], None], expected_global_batch: int | None = None) -> None:
        self.source, self.device, self.num_replicas, self.say = source, device, num_replicas, say
        self.limit: int | None = None  # stop before this epoch (see `bound`)
        self.one_pass = True  # stop at the end of the first epoch that gave a batch
        self.one_shot = isinstance(source, Iterator)  # a generator: read once, no epochs to restart
        self.frontier = start  # the place of the next batch to read from the source
        self.exhausted = False
        self.global_batch: int | None = None
        self.expected_batch = expected_global_batch
        self._fetched: deque[tuple[Place, Any]] = deque()  # read, not yet trained on
        self._replay: deque[tuple[Place, Any]] = deque()  # read by an earlier run that stopped before them
        self._consumed: Place | None = None  # the place of the batch trained on last
        self._batches = self._read(start)

    # -- what the step loop sees ------------------------------------------------------------
    def __next__(self) -> Any:
        if self._replay:
            item = self._replay.popleft()
        else:
            try:
                item = next(self._batches)
            except StopIteration:
                self.exhausted = True
                raise
        self._fetched.append(item)
        return item[1]

    def consume(self, size: int) -> int:
        """The step loop trains on the oldest fetched batch (of `size` samples) now; returns its epoch."""
        place, _ = self._fetched.popleft()
        size *= self.num_replicas
        if self.expected_batch is not None and size != self.expected_batch:
            self.say(f"replicator: warning: the checkpoint's run trained on a global batch of {self.expected_batch}; "
                     f"this run's is {size}, so it does not continue that training exactly")
        self.expected_batch, self.global_batch = None, size
        self._consumed = place
        return place.epoch

    def closes_epoch(self) -> bool:
        """Is the batch consumed last its epoch's final one? Asked once the batch after it was read (or not found)."""
        if self._consumed is None:
            return False
        if self._fetched:
            return self._fetched[0][0].epoch != self._consumed.epoch
        return self.exhausted

    def rewind(self) -> None:
        """A new run continues this stream: batches fetched but never trained on come first."""
        self._replay.extendleft(reversed(self._fetched))
        self._fetched.clear()

    def position(self) -> Place:
        """The place of the first batch not trained on yet."""
        if self._fetched:
            return self._fetched[0][0]
        if self._replay:
            return self._replay[0][0]
        return self.frontier

    def bound(self, epochs: int | None, cycle: bool) -> None:
        """Stop before epoch `epochs`; without it, after one pass, or never when `cycle` (a run bounded by steps)."""
        self.limit, self.one_pass = epochs, epochs is None and not cycle

    def end_reason(self) -> str:
        own = getattr(self.source, "end_reason", None)  # an input that knows why it ended (actor-learner's)
        if callable(own) and (reason := own()):
            return str(reason)
        if self.limit is not None and self.frontier.epoch >= self.limit:
            return f"epochs={self.limit} are done"
        if self.one_shot:
            return (f"the input, a {type(self.source).__name__} that can be read once, ran out; give run() something "
                    "it can iterate again (a DataLoader, a list, repl.prepare_input(input_fn)) to train epoch after "
                    "epoch")
        return "the input gives no batches"

    # -- reading the source -----------------------------------------------------------------
    def _read(self, start: Place) -> Iterator[tuple[Place, Any]]:
        epoch, skip, resuming = start.epoch, start.index, bool(start.epoch_rng) or start.fetch_rng is not None
        trained = False
        while self.limit is None or epoch < self.limit:
            if not self.one_shot:
                set_epoch(self.source, epoch)
            loader_generators = generators(self.source)
            now = torch.get_rng_state()
            if resuming and start.epoch_rng:  # re-create the epoch as it began
                _set_generators(start.epoch_rng, loader_generators)
            epoch_rng = {_GLOBAL: torch.get_rng_state(), **{r: g.get_state() for r, g in loader_generators.items()}}
            if skip and not skips_without_reading(self.source):
                self.say(f"replicator: resuming epoch {epoch} at batch {skip} by reading and discarding the {skip} "
                         f"batches before it: a {type(self.source).__name__} cannot skip them unread (a torch "
                         "DataLoader over a map-style dataset, or a list, can)")
            batches, draw_order = resume_iterator(self.source, skip)
            draw_order()
            if resuming:  # the batch in flight was read from this state, or is read from the restored one
                torch.set_rng_state(start.fetch_rng if start.fetch_rng is not None else now)
            index = skip
            while True:
                fetch_rng = torch.get_rng_state()
                batch = next(batches, _END)
                if resuming:
                    torch.set_rng_state(now)  # the restored streams go on where they were saved
                    resuming = False
                if batch is _END:
                    break
                self.frontier = Place(epoch, index + 1, epoch_rng)
                yield Place(epoch, index, epoch_rng, fetch_rng), to_device(batch, self.device)
                trained, index = True, index + 1
            empty = index == skip == 0
            epoch, skip = epoch + 1, 0
            self.frontier = Place(epoch)
            if self.one_shot or empty or (self.one_pass and trained):  # an empty epoch: so would every later one be
                break


def _set_generators(states: dict[str, torch.Tensor], loader_generators: dict[str, torch.Generator]) -> None:
    if _GLOBAL in states:
        torch.set_rng_state(states[_GLOBAL])
    for role, generator in loader_generators.items():
        if role in states:
            generator.set_state(states[role])


class InputPosition:
    """Where the training's input stands, across run() calls and restarts: the facade's one input record."""

    def __init__(self, replica_id: int, num_replicas: int, device: torch.device, is_main: bool,
                 num_stages: int) -> None:
        # One input pipeline per replica: the stages of a replica read the same batches.
        self.context = InputContext(num_replicas=num_replicas, replica_id=replica_id, input_pipeline_id=replica_id,
                                    num_input_pipelines=num_replicas)
        self.device, self.is_main, self.num_stages = device, is_main, num_stages
        self.inputs: Any = None  # what the user passed to the current stream's run()
        self.stream: EpochStream | None = None
        self.pending: dict[str, Any] | None = None  # a restored position, for the next run
        self._notes: set[str] = set()

    def say(self, line: str) -> None:
        if self.is_main and line not in self._notes:
            self._notes.add(line)
            print(line, flush=True)

    def restored(self, restored: Restored) -> None:
        """The next run starts where `restored` left its input; say so, and what differs from the run that saved it."""
        self.pending = dict(restored.input_state)
        place = Place.from_state(self.pending)
        self.say(f"replicator: resumed from step {restored.step} in {restored.path} (epoch {place.epoch}, "
                 f"{place.index} batches into it)")
        saved = restored.saved_layout
        # Input pipelines: the replicas, or the asynchronous regime's workers (whose count its checkpoints record).
        pipelines = self.context.num_input_pipelines
        if (saved.num_replicas, saved.num_stages) != (pipelines, self.num_stages):
            self.say(f"replicator: warning: that checkpoint was written by {saved.num_replicas} replica(s) x "
                     f"{saved.num_stages} stage(s), this job is {pipelines} x {self.num_stages}: "
                     "the batches each replica reads and its random streams differ from that run's, so training goes "
                     "on but not exactly as it would have")

    def begin(self, inputs: Iterable[Any], epochs: int | None, steps: int | None) -> EpochStream:
        """The stream a run reads: the same inputs go on where the last run stopped; others start at their beginning.

        With `epochs` it ends before that epoch; without, after one pass, or (with `steps`)
        never: the step count ends the run, with as many epochs as it takes.
        """
        stream = self.stream
        if self.pending is None and stream is not None and inputs is self.inputs and not stream.exhausted:
            stream.rewind()
            stream.bound(epochs, cycle=steps is not None)
            return stream
        pending, self.pending = self.pending, None
        expected = None  # the global batch of the checkpoint's run, to warn if this one's differs
        if pending:
            start, expected = Place.from_state(pending), pending.get("global_batch")
        elif stream is not None and inputs is self.inputs:
            # The same inputs, their stream ended: go on from its position, all of it. A run whose epochs= were
            # done before it read anything (a restored `for epoch in range(E)` loop's first calls) leaves the
            # restored place there, in the middle of an epoch; starting that epoch again would re-train batches.
            start, expected = stream.position(), stream.expected_batch
        else:  # other inputs start from their first batch; the epoch count goes on
            start = Place(stream.position().epoch if stream is not None else 0)
        source, device = self._source(inputs)
        if isinstance(source, Iterator) and epochs is not None and epochs - start.epoch > 1:
            raise ReplicatorUsageError(
                f"run(epochs={epochs}) got a {type(source).__name__}, an iterator that can be read once "
                f"(raised on replica {self.context.replica_id}); pass something run() can iterate once per epoch: "
                "a DataLoader, a list, or repl.prepare_input(input_fn)"
            )
        if pending and epochs is None and steps is None and start.epoch > 0:
            self.say(f"replicator: warning: this run() resumes in epoch {start.epoch} and has no epochs=, so it "
                     f"trains the rest of epoch {start.epoch} only; a `for epoch in range(E)` loop around run() "
                     "would train epochs again after every restart. Pass epochs=E to run() (or epochs=epoch + 1 "
                     "inside such a loop)")
        if epochs is not None and start.epoch >= epochs:
            self.say(f"replicator: run(epochs={epochs}) has nothing to do: the training is in epoch {start.epoch}")
        self.inputs = inputs
        self.stream = EpochStream(source, device, start, self.context.num_replicas, self.say, expected)
        self.stream.bound(epochs, cycle=steps is not None)
        return self.stream

    def _source(self, inputs: Iterable[Any]) -> tuple[Iterable[Any], torch.device]:
        if isinstance(inputs, ReplicatedInput):
            return inputs.source, inputs.device
        if isinstance(inputs, DataLoader):
            loader, note = shard_loader(inputs, self.context)
            if note:
                self.say(note)
            return loader, self.device
        return inputs, self.device

    def state_dict(self) -> dict[str, Any]:
        """The input position for a checkpoint."""
        if self.pending is not None:  # restored, not yet run: save what was restored
            return dict(self.pending)
        if self.stream is None:
            return Place().state_dict(None)
        return self.stream.position().state_dict(self.stream.global_batch)


_END = object()
