"""Who am I: ranks, nodes, device and backend; the job's Mesh of replicas × stages and its process groups."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from replicator import _env
from replicator._env import DEFAULT_TIMEOUT_S
from replicator.errors import ReplicatorUsageError

__all__ = ["Topology", "Mesh", "ProcessGroups", "discover", "build_process_groups", "group_of_mine",
           "WAIT_WITHOUT_LIMIT_S", "DEFAULT_TIMEOUT_S", "RegroupedMesh", "build_regrouped"]


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job. Ranks follow the launcher's numbering."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "none"  # "torchrun", "slurm" or "none"

    @property
    def distributed(self) -> bool:
        """True when the job has more than one process or was started by a launcher."""
        return self.world_size > 1 or self.launcher != "none"

    @property
    def device(self) -> torch.device:
        """cuda:<local rank> when a GPU is visible (REPLICATOR_DEVICE=cpu or cuda decides instead), else cpu."""
        wanted = _env.device()
        if wanted == "cpu" or (wanted is None and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ReplicatorUsageError(
                f"REPLICATOR_DEVICE=cuda, but torch {torch.__version__} sees no CUDA GPU on this node: install a "
                "CUDA build of torch, check CUDA_VISIBLE_DEVICES, or unset REPLICATOR_DEVICE to train on CPU")
        return torch.device("cuda", self.local_rank % torch.cuda.device_count())

    def refuse_shared_gpus(self, groups: list[list[int]]) -> None:
        """Raise if two processes of this node would share a GPU inside one of my NCCL `groups`.

        NCCL refuses two ranks of a communicator on one GPU, but only at the group's first
        collective and as "Duplicate GPU detected": say it before anything starts, with the ways out."""
        if self.backend != "nccl":
            return
        gpus = torch.cuda.device_count()
        node = self.rank // self.local_world_size
        for ranks in groups:
            if self.rank not in ranks:
                continue
            here = [rank % self.local_world_size for rank in ranks if rank // self.local_world_size == node]
            if len({local_rank % gpus for local_rank in here}) < len(here):
                raise ReplicatorUsageError(
                    f"{len(here)} processes of this node share an NCCL group but {gpus} GPU(s) are visible: NCCL "
                    f"needs a GPU per process. Launch at most {gpus} per node (replicator launch -n {gpus}), make "
                    "more GPUs visible (CUDA_VISIBLE_DEVICES), or train on CPU with REPLICATOR_DEVICE=cpu "
                    f"(seen on replica {self.rank}, local rank {self.local_rank})")

    @property
    def backend(self) -> str:
        """nccl for CUDA replicas and gloo for CPU ones, unless REPLICATOR_BACKEND says otherwise."""
        chosen = _env.backend()
        if chosen == "nccl" and self.device.type != "cuda":
            raise ReplicatorUsageError("REPLICATOR_BACKEND=nccl needs CUDA replicas, but these compute on CPU: "
                                       "unset REPLICATOR_BACKEND (Gloo is used on CPU)")
        return chosen or ("nccl" if self.device.type == "cuda" else "gloo")


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        if env.get(name, "") != "":
            try:
                return int(env[name])
            except ValueError as error:
                raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from error
    if default is None:
        raise KeyError(f"none of {names} is set")
    return default


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as 'gpu[03-05,09],cpu1' -> 'gpu03'."""
    match = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def discover(env: Mapping[str, str] | None = None) -> Topology:
    """Read the topology from torchrun's variables, else Slurm's, else a single process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = _int(env, "WORLD_SIZE")
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", default=world_size)
        return Topology(
            rank=_int(env, "RANK"),
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK", default=0),
            local_world_size=local_world_size,
            node_rank=_int(env, "GROUP_RANK", "NODE_RANK", default=_int(env, "RANK") // local_world_size),
            num_nodes=max(1, world_size // local_world_size),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", default=29500),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world_size = _int(env, "SLURM_NTASKS")
        num_nodes = _int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
        # SLURM_NTASKS_PER_NODE may read "4(x2)"; the even split is what the mesh assumes.
        local_world_size = world_size // num_nodes
        master = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return Topology(
            rank=_int(env, "SLURM_PROCID"),
            world_size=world_size,
            local_rank=_int(env, "SLURM_LOCALID", default=0),
            local_world_size=local_world_size,
            node_rank=_int(env, "SLURM_NODEID", default=0),
            num_nodes=num_nodes,
            master_addr=master,
            master_port=_int(env, "MASTER_PORT", default=29500),
            launcher="slurm",
        )
    return Topology()


@dataclass(frozen=True)
class Mesh:
    """The job's processes as replicas × stages, cut into nodes: every coordinate and partition.

    Ranks are laid out replica-major: rank = replica * stages + stage, so the stages of
    one replica are neighbours (usually on one node, where activations travel fastest).
    Nodes hold `local_world_size` consecutive ranks. Every process computes the same
    partitions, which is what lets them create process groups in the same order.

    Roles (the asynchronous modes): with `serving` > 0 the last `serving` ranks serve instead of
    stepping (parameter servers; actors and the evaluator), and the others run step_fn in sync
    groups of `group_size` consecutive ranks (workers; learners). `role_names` names the two
    sides in messages. A process's "replicas" are then its role group (its sync group, or the
    serving ranks), the processes it stays in lock-step with.
    """

    rank: int = 0
    world_size: int = 1
    stages: int = 1
    local_world_size: int = 1
    serving: int = 0
    group_size: int = 1
    role_names: tuple[str, str] = ("worker", "parameter server")  # (who steps, who serves)

    @classmethod
    def of(cls, topology: Topology, stages: int = 1, serving: int = 0, group_size: int = 1,
           role_names: tuple[str, str] = ("worker", "parameter server")) -> Mesh:
        """This process's mesh; raises when `stages` does not divide the world."""
        if stages < 1 or topology.world_size % stages != 0:
            raise ReplicatorUsageError(
                f"stages={stages} does not divide the world size {topology.world_size}: "
                f"launch a multiple of {stages} processes or change stages"
            )
        return cls(topology.rank, topology.world_size, stages, topology.local_world_size, serving, group_size,
                   role_names)

    @property
    def num_stepping(self) -> int:
        """The processes that run step_fn: all of them but the serving ones."""
        return self.world_size - self.serving

    @property
    def serves(self) -> bool:
        """Does this process serve (a parameter server, an actor, the evaluator) instead of stepping?"""
        return self.rank >= self.num_stepping

    @property
    def serving_ranks(self) -> list[int]:
        return list(range(self.num_stepping, self.world_size))

    @property
    def group_partition(self) -> list[list[int]]:
        """The workers' sync groups (asynchronous regime), group by group."""
        return self.sync_group_partition(self.group_size)

    @property
    def group_id(self) -> int:
        """This worker's sync group (asynchronous regime)."""
        return self.rank // self.group_size

    @property
    def num_replicas(self) -> int:
        if self.serving:
            return len(self.replica_ranks)
        return self.world_size // self.stages

    @property
    def replica_id(self) -> int:
        if self.serving:
            return self.replica_ranks.index(self.rank)
        return self.rank // self.stages

    @property
    def stage_id(self) -> int:
        return self.rank % self.stages

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    def node_of(self, rank: int) -> int:
        """The node that holds `rank`."""
        return rank // self.local_world_size

    @property
    def replica_partition(self) -> list[list[int]]:
        """Each stage's replica group (the ranks that average one stage's gradients), stage by stage.

        With roles: the sync groups, then the servers."""
        if self.serving:
            return [*self.group_partition, self.serving_ranks]
        return [[r * self.stages + s for r in range(self.num_replicas)] for s in range(self.stages)]

    @property
    def stage_partition(self) -> list[list[int]]:
        """Each replica's pipeline (its stages' ranks), replica by replica."""
        return [[r * self.stages + s for s in range(self.stages)] for r in range(self.num_replicas)]

    @property
    def node_partition(self) -> list[list[int]]:
        """The ranks of each node."""
        local = self.local_world_size
        return [[n * local + i for i in range(local)] for n in range(self.num_nodes)]

    @property
    def cross_node_partition(self) -> list[list[int]]:
        """The ranks with the same local rank, one per node."""
        local = self.local_world_size
        return [[n * local + i for n in range(self.num_nodes)] for i in range(local)]

    @property
    def replica_ranks(self) -> list[int]:
        """This stage's replica group: where this process's gradients are averaged."""
        if self.serving:
            return self.serving_ranks if self.serves else self.group_partition[self.group_id]
        return self.replica_partition[self.stage_id]

    @property
    def stage_ranks(self) -> list[int]:
        """This replica's stages: where this process's activations travel."""
        return self.stage_partition[self.replica_id]

    def sync_group_partition(self, size: int) -> list[list[int]]:
        """The workers (every rank of a job without stages or servers) in sync groups of `size` neighbouring ranks."""
        return [list(range(first, first + size)) for first in range(0, self.num_stepping, size)]

    def across_sync_groups_partition(self, size: int) -> list[list[int]]:
        """One rank of every sync group, at the same place in each: where groups pool what they learned."""
        return [list(range(place, self.world_size, size)) for place in range(size)]


@dataclass(frozen=True)
class RegroupedMesh(Mesh):
    """The job's Mesh with other replica groups (`partition`): the view a reducer over sync groups is built on."""

    partition: tuple[tuple[int, ...], ...] = ((0,),)

    @property
    def replica_partition(self) -> list[list[int]]:
        return [list(ranks) for ranks in self.partition]

    @property
    def num_replicas(self) -> int:
        return len(self.partition[0])

    @property
    def replica_id(self) -> int:
        return next(ranks.index(self.rank) for ranks in self.partition if self.rank in ranks)

    @property
    def replica_ranks(self) -> list[int]:
        return next(list(ranks) for ranks in self.partition if self.rank in ranks)


@dataclass
class ProcessGroups:
    """The groups every process builds once, in the same order, over the job's Mesh.

    A group is None where the job is a single process.
    """

    world: dist.ProcessGroup | None
    control: dist.ProcessGroup | None  # small fixed-size agreement messages, whole job
    replica_control: dist.ProcessGroup | None  # the same, among the replicas of this stage
    replica: dist.ProcessGroup | None  # same stage across replicas: gradients are averaged here
    stage: dist.ProcessGroup | None  # the stages of this replica: the pipeline's p2p
    intra_node: dist.ProcessGroup | None
    inter_node: dist.ProcessGroup | None  # same local rank across nodes
    mesh: Mesh
    everyone: dist.ProcessGroup | None = None  # with roles: the whole job on Gloo (servers and workers meet here)

    @property
    def replica_ranks(self) -> list[int]:
        return self.mesh.replica_ranks

    @property
    def stage_ranks(self) -> list[int]:
        return self.mesh.stage_ranks


_rendezvous: tuple[dist.Store, int, int] | None = None  # this process's store, made once (see _store_for_next_job)
_jobs_started = 0


def _store_for_next_job(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """The store for this process's next job, with the rank and world size that the environment gives.

    The rendezvous store (rank 0 serves it on MASTER_PORT) is made once per process and kept:
    a job closed with `repl.close()` and a new `rp.Replicator()` in the same processes would
    otherwise race a peer to the port, and a peer that reached the old store before it closed
    found last job's keys there, went on, and left rank 0 waiting. Each job gets its own key
    prefix, the same on every process because every process starts its jobs in the same order.
    """
    global _rendezvous, _jobs_started
    if _rendezvous is None:
        _rendezvous = next(dist.rendezvous("env://", timeout=timeout))
    store, rank, world_size = _rendezvous
    _jobs_started += 1
    return dist.PrefixStore(f"replicator-job-{_jobs_started}", store), rank, world_size


def build_process_groups(topology: Topology, stages: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                         serving: int = 0, group_size: int = 1,
                         role_names: tuple[str, str] = ("worker", "parameter server")) -> ProcessGroups:
    """Initialise torch.distributed (if the job has peers) and build every group once.

    With `serving` ranks (the asynchronous modes) the control and replica groups are each process's
    role group, so the step loop's checks and gradient averaging stay inside a sync group and
    never wait for another group or a server; `everyone` spans the job."""
    mesh = Mesh.of(topology, stages, serving, group_size, role_names)
    if not topology.distributed:
        return ProcessGroups(None, None, None, None, None, None, None, mesh)

    if not dist.is_initialized():
        if topology.launcher == "slurm":
            os.environ.setdefault("MASTER_ADDR", topology.master_addr)
            os.environ.setdefault("MASTER_PORT", str(topology.master_port))
            os.environ.setdefault("RANK", str(topology.rank))
            os.environ.setdefault("WORLD_SIZE", str(topology.world_size))
        if topology.device.type == "cuda":
            # Only the groups that average gradients run NCCL collectives (servers and actors use Gloo).
            topology.refuse_shared_gpus(mesh.group_partition if serving else [list(range(topology.world_size))])
            torch.cuda.set_device(topology.device)
        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = _store_for_next_job(timeout)
        dist.init_process_group(topology.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    world = dist.group.WORLD
    everyone = [list(range(topology.world_size))]

    def mine(partition: list[list[int]], backend: str | None = None) -> dist.ProcessGroup | None:
        return group_of_mine(partition, timeout_s, backend)

    if serving:
        whole = mine(everyone, backend="gloo")
        role_control = mine(mesh.replica_partition, backend="gloo")
        # The sync groups average gradients on the data backend; the servers' (or actors') group talks
        # over Gloo, so that on a GPU machine actors and servers may share the learners' GPUs.
        role = None
        for ranks in mesh.replica_partition:
            group = mine([ranks], None if ranks in mesh.group_partition else "gloo")
            role = group if group is not None else role
        return ProcessGroups(world, role_control, role_control, role, None, role, None, mesh, whole)
    # The control group is always Gloo on the CPU: its messages are tiny and must not
    # queue behind gradient traffic on the accelerator's stream.
    control = mine(everyone, backend="gloo")
    replica = world if stages == 1 else mine(mesh.replica_partition)
    replica_control = control if stages == 1 else mine(mesh.replica_partition, backend="gloo")
    stage = None if stages == 1 else mine(mesh.stage_partition)
    intra = mine(mesh.node_partition) if mesh.num_nodes > 1 else world
    inter = mine(mesh.cross_node_partition) if mesh.num_nodes > 1 else None
    return ProcessGroups(world, control, replica_control, replica, stage, intra, inter, mesh)


# A group timeout for waits that only the other side's departure should end (a Gloo receive that timed out
# would break its pair for good): a server's or a learner's wait for the next request.
WAIT_WITHOUT_LIMIT_S = 7 * 24 * 3600.0


def group_of_mine(partition: Sequence[Sequence[int]], timeout_s: float, backend: str | None = None
                  ) -> dist.ProcessGroup | None:
    """Make one process group per entry of `partition`, in order, and return the one this process is in (or None).

    The package's one group builder. new_group is collective over the whole job: every process must
    call this with the same partition, at the same point. `timeout_s` is this process's own limit on
    the group's collectives (processes may choose different ones)."""
    me = dist.get_rank()
    found = None
    for ranks in partition:
        group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s), backend=backend)
        if me in ranks:
            found = group
    return found


def build_regrouped(groups: ProcessGroups, partition: list[list[int]], timeout_s: float) -> ProcessGroups:
    """`groups` with `partition` (equal parts, stages == 1) as the replica groups; every rank calls it, in order."""
    mesh = groups.mesh
    regrouped = RegroupedMesh(mesh.rank, mesh.world_size, mesh.stages, mesh.local_world_size,
                              partition=tuple(tuple(ranks) for ranks in partition))
    if groups.world is None:
        return dataclasses.replace(groups, mesh=regrouped)
    # The data group, then a Gloo twin for small control messages unless the data group is Gloo already.
    backends: list[str | None] = [None] if dist.get_backend() == "gloo" else [None, "gloo"]
    mine = [group_of_mine(partition, timeout_s, backend) for backend in backends]
    return dataclasses.replace(groups, mesh=regrouped, replica=mine[0], replica_control=mine[-1])
