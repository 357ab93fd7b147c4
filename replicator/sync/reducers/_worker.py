"""A background thread that runs a reducer's multi-step reductions one at a time, in submission order (internal)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from replicator.sync.bucket import Bucket
from replicator.sync.reducers._summation import Summation, check_group

__all__ = ["ReductionWorker", "PendingWork", "SummationReducer", "BucketReducer"]


class PendingWork:
    """One submitted reduction; `wait()` blocks until it ran and re-raises its error, if any."""

    def __init__(self, job: Callable[[], None], label: str) -> None:
        self.job = job
        self.label = label
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.finished_at: float | None = None  # wall-clock time the job ended (a timeline's completion)

    def _run(self, earlier_failure: BaseException | None) -> BaseException | None:
        try:
            if earlier_failure is not None:
                # The collectives of the failed job may be half issued, so the groups' sequences
                # no longer match across replicas: running more would hang, not help.
                raise RuntimeError(f"{self.label} was not run: an earlier reduction failed ({earlier_failure})")
            self.job()
        except BaseException as error:  # delivered to whoever waits, on the caller's thread
            self._error = error
        finally:
            self.finished_at = time.time()
            self._done.set()
        return self._error

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class ReductionWorker:
    """Runs jobs FIFO on one daemon thread.

    A reduction made of several dependent collectives (reduce-scatter, then all-reduce,
    then all-gather) cannot be expressed as one async work handle on Gloo. Running every
    job of a reducer on one thread, in the order the synchronizer launched them, keeps
    each private group's sequence of collectives identical on every replica (no
    deadlock), while the caller's thread goes on with the backward pass.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[PendingWork | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failure: BaseException | None = None

    def submit(self, job: Callable[[], None], label: str, device: torch.device | None = None) -> PendingWork:
        work = PendingWork(_on_stream_after_caller(job, device), label)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"replicator-{self.name}", daemon=True)
                self._thread.start()
        self._jobs.put(work)
        return work

    def _loop(self) -> None:
        while True:
            work = self._jobs.get()
            if work is None:
                return
            error = work._run(self._failure)
            if error is not None and self._failure is None:
                self._failure = error

    def close(self) -> None:
        """Finish what was submitted, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()


def _on_stream_after_caller(job: Callable[[], None], device: torch.device | None) -> Callable[[], None]:
    """On CUDA, make the worker's stream wait for the caller's (which filled the buffer) and
    finish before wait() returns, so the caller may read the result on any stream."""
    if device is None or device.type != "cuda":
        return job
    filled = torch.cuda.Event()
    filled.record(torch.cuda.current_stream(device))

    def on_stream() -> None:
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).wait_event(filled)
            job()
            torch.cuda.current_stream(device).synchronize()

    return on_stream


class SummationReducer:
    """Sums each bucket with a blocking, lossless summation on a background thread; returns at once."""

    def __init__(self, summation: Summation) -> None:
        self.summation = summation
        self.name = summation.name
        self._worker = ReductionWorker(self.name)
        self._checked: set[int] = set()

    def reduce(self, buffer: torch.Tensor, group: dist.ProcessGroup, bucket: Bucket | None = None) -> PendingWork:
        check_group(group, self.summation.size, self.name, self._checked)
        label = f"{self.name} reduction of bucket {bucket.index if bucket is not None else '?'}"
        arrival = bucket.arrival if bucket is not None else None
        sum_after = getattr(self.summation, "sum_after", None)
        if arrival is not None and sum_after is not None:
            return self._worker.submit(lambda: sum_after(buffer, arrival), label, buffer.device)
        return self._worker.submit(lambda: self.summation.sum_(buffer), label, buffer.device)

    def scatter(self, buffer: torch.Tensor, group: dist.ProcessGroup, bucket: Bucket,
                out: torch.Tensor | None = None) -> PendingWork | None:
        """Reduce `bucket` only as far as its scatter (see SharedMemorySum.scatter_after): this replica's slice and
        the presence slots summed, the slice into `out` where given. None where the summation cannot stop there
        (the caller reduces in full)."""
        if not self.scatters:
            return None
        check_group(group, self.summation.size, self.name, self._checked)
        label = f"{self.name} reduce-scatter of bucket {bucket.index}"
        scatter = self.summation.scatter_after  # type: ignore[attr-defined]
        return self._worker.submit(lambda: scatter(buffer, bucket.arrival, bucket.numel, out), label, buffer.device)

    @property
    def scatters(self) -> bool:
        """Can a reduction stop after its scatter here (shared memory, every replica on one node)?"""
        return hasattr(self.summation, "scatter_after") and getattr(self.summation, "gathers", False)

    def all_gather(self, tensor: torch.Tensor, bounds: list[int]) -> PendingWork | None:
        """Replica i's part `bounds[i]:bounds[i + 1]` of `tensor` everywhere, on the worker in submission order (after
        the reductions before it); None where the summation has no such collective (the caller uses its own)."""
        gather = getattr(self.summation, "all_gather_", None)
        if gather is None or not getattr(self.summation, "gathers", False):
            return None
        return self._worker.submit(lambda: gather(tensor, bounds), f"{self.name} all-gather", tensor.device)

    def all_gather_into(self, buckets: list[tuple[list[tuple[torch.Tensor, int]], list[int], torch.Tensor | None]]
                        ) -> PendingWork | None:
        """Every bucket's parts gathered in place, as SharedMemorySum.all_gather_into_ says, on the worker in
        submission order; None where the summation has no such collective (the caller uses its own)."""
        gather = getattr(self.summation, "all_gather_into_", None)
        if gather is None or not getattr(self.summation, "gathers", False) or not buckets:
            return None
        device = buckets[0][0][0][0].device if buckets[0][0] else None
        return self._worker.submit(lambda: gather(buckets), f"{self.name} all-gather of the parameters", device)

    def lend(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A row of a new shared mapping that shard="gradients" loads buckets into (the first columns of it) and
        scatters in place, then gathers the parameters through; None where no reduction here stops after its
        scatter (the buckets are then private tensors)."""
        return self.allocate(numel, dtype, device) if self.scatters else None

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A bucket buffer the summation can reduce without copying, or None (allocate it as usual)."""
        allocate = getattr(self.summation, "allocate", None)
        buffer = allocate(numel, dtype, device) if allocate is not None else None
        if buffer is not None:
            # On the worker, in submission order: its collectives never interleave with reductions.
            self._worker.submit(self.summation.settle, f"{self.name} allocation").wait()  # type: ignore[attr-defined]
        return buffer

    def close(self) -> None:
        self._worker.close()
        getattr(self.summation, "close", lambda: None)()


class BucketReducer:
    """Base of reducers that keep state per bucket and reduce on their own background thread.

    Subclasses set `name` and `summation` and implement `_reduce(buffer, bucket)`.
    """

    name: str

    def __init__(self, name: str, replicas: int) -> None:
        self.name = name
        self._replicas = replicas
        self._worker = ReductionWorker(name)
        self._checked: set[int] = set()

    def reduce(self, buffer: torch.Tensor, group: dist.ProcessGroup, bucket: Bucket | None = None) -> PendingWork:
        if bucket is None:
            raise TypeError(
                f"the {self.name} reducer needs the bucket (where its gradients end and its presence slots begin, "
                "and a key for its per-bucket state): call reduce(buffer, group, bucket)"
            )
        check_group(group, self._replicas, self.name, self._checked)
        label = f"{self.name} reduction of bucket {bucket.index}"
        return self._worker.submit(lambda: self._reduce(buffer, bucket), label, buffer.device)

    def close(self) -> None:
        self._worker.close()

    def _reduce(self, buffer: torch.Tensor, bucket: Bucket) -> None:
        raise NotImplementedError
