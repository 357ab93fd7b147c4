"""The wiring of one job: topology, mesh, process groups, agreements, links and the replica context."""

from __future__ import annotations

import atexit
import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from replicator import _env
from replicator.comm import collectives
from replicator.comm.agreement import Agreement
from replicator.comm.local_link import LocalLink
from replicator.context import ReplicaContext, set_active_context
from replicator.topology import Mesh, ProcessGroups, Topology, build_process_groups, discover

__all__ = ["Job"]


@dataclass(eq=False)
class Job:
    """Everything one process of the job talks through, built once and closed once.

    `agreement` checks the whole job (steps, run summaries); `replica_agreement` checks this
    stage's replicas (gradients, ctx collectives). Each travels over a Unix-socket link when its
    group lives on one node (decided together), and `data_link` carries small ctx collectives.
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

    @classmethod
    def start(cls, *, stages: int = 1, timeout_s: float | None = None, debug: bool | None = None) -> Job:
        """Discover this process's place, join the job's process groups and connect the links."""
        topology = discover()
        threads = _env.threads()
        if threads is not None:
            torch.set_num_threads(threads)
        timeout_s = _env.timeout_s() if timeout_s is None else timeout_s
        debug = _env.debug() if debug is None else debug
        owns_process_group = topology.distributed and not dist.is_initialized()
        groups = build_process_groups(topology, stages=stages, timeout_s=timeout_s)
        mesh = groups.mesh
        agreement = Agreement(groups.control, debug, LocalLink.connect(groups.control, timeout_s))
        replica_agreement = Agreement(groups.replica_control, debug,
                                      LocalLink.connect(groups.replica_control, timeout_s))
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
        job = cls(topology, groups, timeout_s, debug, agreement, replica_agreement, context, data_link,
                  owns_process_group)
        if owns_process_group:
            atexit.register(job.close)
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

    def barrier(self) -> None:
        """Wait until every process of the job reaches this point."""
        if self.groups.control is not None:
            dist.barrier(group=self.groups.control)

    def close(self) -> None:
        """Stop background work, close the links and, if this job created them, the process groups."""
        for closer in self._closers:
            getattr(closer, "close", lambda: None)()
        self._closers.clear()
        if self.data_link is not None and self.groups.replica is not None:
            collectives.detach_link(self.groups.replica, self.data_link)
        # A peer still collecting this replica's last messages reads them before it sees the close.
        for link in (self.agreement.link, self.replica_agreement.link, self.data_link):
            if link is not None:
                link.close()
        if self.owns_process_group and dist.is_initialized():
            # Tear down together: a replica that closes its sockets while a peer is still
            # finishing its last collective can make that peer abort at exit.
            with contextlib.suppress(RuntimeError):
                self.barrier()
            dist.destroy_process_group()
            self.owns_process_group = False
