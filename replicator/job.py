"""The wiring of one job: topology, mesh, process groups, agreements, links and the replica context."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from replicator import _env
from replicator.comm import collectives
from replicator.comm.agreement import Agreement, call_site
from replicator.comm.heartbeat import Heartbeat
from replicator.comm.local_link import LocalLink
from replicator.comm.stalls import StallWatch, grace_for
from replicator.context import ReplicaContext, set_active_context
from replicator.errors import ReplicaMismatchError
from replicator.topology import Mesh, ProcessGroups, Topology, build_process_groups, discover

__all__ = ["Job", "announced", "leave_after_failure"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_Class = TypeVar("_Class", bound=type)


@dataclass(eq=False)
class Job:
    """Everything one process of the job talks through, built once and closed once.

    `agreement` checks the whole job (steps, run summaries, the facade's verbs);
    `replica_agreement` checks this stage's replicas (gradients, ctx collectives): the same
    object, one ordered channel, unless the job has pipeline stages. Each travels over a
    Unix-socket link when its group lives on one node (decided together), and `data_link`
    carries small ctx collectives.
    """

    topology: Topology
    groups: ProcessGroups
    timeout_s: float
    debug: bool
    agreement: Agreement
    replica_agreement: Agreement
    context: ReplicaContext
    data_link: LocalLink | None = None
    owns_process_group: bool = False
    _closers: list[object] = field(default_factory=list)
    _said_goodbye: bool = False
    _in_verb: bool = False  # inside a facade verb that announced itself
    failing: bool = False  # an exception is ending this process: leave at once, wait for no peer

    @classmethod
    def start(cls, *, stages: int = 1, timeout_s: float | None = None, debug: bool | None = None,
              serving: int = 0, group_size: int = 1,
              role_names: tuple[str, str] = ("worker", "parameter server")) -> Job:
        """Discover this process's place, join the job's process groups and connect the links.

        `serving` > 0 gives the processes roles (Mesh): the last `serving` ranks serve (`role_names[1]`), the others
        step in sync groups of `group_size` (`role_names[0]`)."""
        topology = discover()
        threads = _env.threads()
        if threads is not None:
            torch.set_num_threads(threads)
        timeout_s = _env.timeout_s() if timeout_s is None else timeout_s
        debug = _env.debug() if debug is None else debug
        owns_process_group = topology.distributed and not dist.is_initialized()
        groups = build_process_groups(topology, stages=stages, timeout_s=timeout_s, serving=serving,
                                      group_size=group_size, role_names=role_names)
        mesh = groups.mesh
        agreement, replica_agreement = _agreements(topology, groups, timeout_s, debug)
        context = ReplicaContext(mesh.replica_id, mesh.num_replicas, groups.replica, replica_agreement)
        # A third link, for the data of small ctx collectives: kept apart from the checks, whose
        # order relative to collectives in a backward pass need not match across replicas. It is
        # made over the replicas' Gloo control group (the replica group may be NCCL, which cannot
        # carry the set-up's host tensors), whose members are the same in the same order.
        data_link = None
        if groups.replica is not None and groups.replica_control is not None:
            data_link = LocalLink.connect(groups.replica_control, timeout_s)
        if data_link is not None:
            assert groups.replica is not None and data_link.ranks == dist.get_process_group_ranks(groups.replica)
            collectives.attach_link(groups.replica, data_link)
        set_active_context(context)
        if debug and topology.rank == 0:
            print("replicator: debug mode is on (REPLICATOR_DEBUG or debug=True): every collective and gradient "
                  "bucket is checked and leaves a trail, at some cost in speed", flush=True)
        job = cls(topology, groups, timeout_s, debug, agreement, replica_agreement, context, data_link,
                  owns_process_group)
        heartbeat_s = _env.heartbeat_s(timeout_s)
        if topology.world_size > 1 and heartbeat_s > 0:  # a wait that lasts names the peers it waits for
            one_role = mesh.stages == 1 and mesh.serving == 0 and mesh.world_size == mesh.num_replicas
            names = [f"{'replica' if one_role else 'rank'} {rank}" for rank in range(topology.world_size)]
            job.close_with(Heartbeat(topology.rank, names, heartbeat_s, timeout_s).start())
        _open_jobs.add(job)
        if owns_process_group:
            atexit.register(job.close)
            _leave_on_uncaught_errors()
        return job

    @property
    def mesh(self) -> Mesh:
        return self.groups.mesh

    @property
    def device(self) -> torch.device:
        return self.topology.device

    def close_with(self, closer: object) -> None:
        """Have `close()` call `closer.close()` first (a reducer's background worker, say)."""
        self._closers.append(closer)

    def _say_goodbye(self) -> None:
        """A last check, so that a peer left waiting at one (a `repl.save()` under `if repl.is_main:` after
        training) learns that this process is leaving, and says so, instead of waiting for its timeout.

        Bounded: a process that ends after an error elsewhere must not wait for peers that are stuck."""
        if self._said_goodbye or self.agreement.broken or self.agreement.size == 1 or not dist.is_initialized():
            return
        self._said_goodbye = True
        try:
            pending = self.agreement.start("the end of the job (exit or repl.close())")
            if pending.arrived_within(grace_for(self.timeout_s)):
                pending.wait()
        except ReplicaMismatchError as error:
            print(f"replicator: {error}", file=sys.stderr, flush=True)  # at exit, where nobody catches it
        except RuntimeError:
            pass  # a peer already failed: its own error says why

    def barrier(self) -> None:
        """Wait until every process of the job reaches this point."""
        if self.groups.control is not None:
            dist.barrier(group=self.groups.control)

    def announce(self, verb: str, step: int) -> None:
        """Check that every process of the job makes this call (`verb`, "repl.save()") at this point.

        On the channel of the step loop's own checks: a replica that skipped the call (say, under
        `if repl.is_main:`) goes on to a step or a collective, which meets this check and fails
        there, on every replica, naming the verb, instead of leaving the caller waiting.
        """
        self.agreement.require_same(f"{verb} at step {step}", call_site())

    def close(self) -> None:
        """Stop background work, close the links and, if this job created them, the process groups."""
        if not self.failing:
            self._say_goodbye()
        for closer in self._closers:
            close = getattr(closer, "close", lambda: None)
            if self.failing:
                _close_within(close, grace_for(self.timeout_s))
            else:
                close()
        self._closers.clear()
        if self.data_link is not None and self.groups.replica is not None:
            collectives.detach_link(self.groups.replica, self.data_link)
        # A peer still collecting this replica's last messages reads them before it sees the close.
        links = {id(link): link for link in (self.agreement.link, self.replica_agreement.link, self.data_link)}
        for link in links.values():
            if link is not None:
                link.close()
        if self.owns_process_group and dist.is_initialized():
            # Tear down together: a replica that closes its sockets while a peer is still
            # finishing its last collective can make that peer abort at exit.
            if not self.failing:
                with contextlib.suppress(RuntimeError):
                    self.barrier()
            dist.destroy_process_group()
            self.owns_process_group = False
        _open_jobs.discard(self)


def _close_within(close: Callable[[], None], seconds: float) -> None:
    """Call `close` but wait for it at most `seconds`: a failing process must not wait on background work
    (a reduction still waiting for a peer, say) that its peers may never complete. Errors are ignored."""
    def close_quietly() -> None:
        with contextlib.suppress(Exception):
            close()

    thread = threading.Thread(target=close_quietly, name="replicator-close", daemon=True)
    thread.start()
    thread.join(seconds)


# The jobs started in this process and not yet closed (weakly: a job nobody holds is not kept alive for this).
_open_jobs: weakref.WeakSet[Job] = weakref.WeakSet()
_leaves_on_uncaught_errors = False


def leave_after_failure() -> None:
    """Leave every job of this process at once, as a process that an error ends must: the one exit path.

    A replica that fails while its peers compute would otherwise wait for them at close()'s last
    check and barrier, and they for it at their next collective, until the timeout. Closing each
    open job as failing skips those waits and tells the peers through its closed links (an actor–learner
    learner's actors hear why); the process groups go last, the user's own included. Called by
    `replicator launch`'s worker, by `replicator.testing.run_replicas`, and (plain torchrun, Slurm)
    after Python reports an uncaught error. Never raises: the error that ended the process is what matters.
    """
    for job in list(_open_jobs):
        job.failing = True
        with contextlib.suppress(Exception):
            job.close()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _leave_on_uncaught_errors() -> None:
    """After Python prints an uncaught error, leave the jobs at once (before the exit-time close would wait)."""
    global _leaves_on_uncaught_errors
    if _leaves_on_uncaught_errors:
        return
    _leaves_on_uncaught_errors = True
    previous = sys.excepthook

    def report_then_leave(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        previous(kind, error, trace)
        leave_after_failure()

    sys.excepthook = report_then_leave


def _agreements(topology: Topology, groups: ProcessGroups, timeout_s: float,
                debug: bool) -> tuple[Agreement, Agreement]:
    """The job's channel of checks and its stage replicas' channel: one and the same without pipeline stages.

    Checks pair in the order each channel carries them, so a call that only some replicas make
    meets another check and fails at once. Two channels would let it meet nothing (a ctx
    collective waiting on one, the next step's check on the other); with pipeline stages there
    are two, and a long wait looks for that deadlock through the store (comm.stalls).
    """
    link = LocalLink.connect(groups.control, timeout_s)
    if groups.replica_control is groups.control:
        agreement = Agreement(groups.control, debug, link)
        return agreement, agreement
    mesh = groups.mesh
    watch = StallWatch(topology.rank, f"replica {mesh.replica_id} of stage {mesh.stage_id}",
                       mesh.replica_ranks, grace_for(timeout_s))
    agreement = Agreement(groups.control, debug, link, watch=watch, label="rank")
    replica_agreement = Agreement(groups.replica_control, debug, LocalLink.connect(groups.replica_control, timeout_s),
                                  watch=watch, name=f"the replicas of stage {mesh.stage_id}")
    return agreement, replica_agreement


def announced(*verbs: str) -> Callable[[_Class], _Class]:
    """A class decorator: these methods of the facade first announce themselves (Job.announce).

    A verb called by another (save averages buffers) announces only the outer call; one that
    run() calls (its checkpoints, its last buffer average) is announced as run()'s, since the
    user did not write that call.
    """

    def wrap(cls: _Class) -> _Class:
        for verb in verbs:
            setattr(cls, verb, _announcing(getattr(cls, verb), verb))
        return cls

    return wrap


def _announcing(method: Callable[..., Any], verb: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def announcing(self: Any, *args: Any, **kwargs: Any) -> Any:
        job: Job = self.job
        if job.agreement.size > 1 and not job._in_verb:
            inside = sys._getframe(1).f_code.co_filename.startswith(_PACKAGE_DIR)
            job.announce(f"run()'s repl.{verb}()" if inside else f"repl.{verb}()", self.global_step)
        outer, job._in_verb = job._in_verb, True
        try:
            return method(self, *args, **kwargs)
        finally:
            job._in_verb = outer

    return announcing
