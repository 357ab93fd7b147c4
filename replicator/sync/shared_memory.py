"""SharedMemorySum: a lossless sum over replicas on one node through /dev/shm instead of sockets."""

from __future__ import annotations

import mmap
import os
import secrets
import stat

import torch
import torch.distributed as dist

from replicator.sync.hierarchical import processes_per_node, replicas_per_node
from replicator.sync.summation import create_groups, replica_partition
from replicator.topology import ProcessGroups

__all__ = ["SharedMemorySum", "shared_memory_usable", "SHARED_MEMORY_DIR"]

SHARED_MEMORY_DIR = "/dev/shm"


def shared_memory_usable(groups: ProcessGroups, device: torch.device) -> str | None:
    """None when every stage's replicas can sum through shared memory; else the reason they cannot."""
    if device.type != "cpu":
        return f"gradients live on {device}, not in host memory"
    if not os.path.isdir(SHARED_MEMORY_DIR) or not os.access(SHARED_MEMORY_DIR, os.W_OK):
        return f"{SHARED_MEMORY_DIR} is missing or not writable"
    partition = replica_partition(groups)
    try:
        per_node = replicas_per_node(partition[0], processes_per_node(groups))
    except ValueError as error:
        return str(error)
    if per_node != len(partition[0]):
        return f"the replicas span {len(partition[0]) // per_node} nodes"
    return None


class _Segment:
    """One mapping shared by the node's replicas: `replicas` rows of `numel` elements, row i
    being replica i's contribution, and one more row where each replica writes the slice it sums."""

    def __init__(self, path: str, replicas: int, numel: int, dtype: torch.dtype) -> None:
        size = (replicas + 1) * numel * torch.empty((), dtype=dtype).element_size()
        # 0600 and a random name: only this user's processes that were told the name can map it.
        # O_NOFOLLOW and the owner check: a name planted in the world-writable /dev/shm by someone
        # else (a symlink to one of our files, or a file they can read) is refused, not shared.
        descriptor = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise PermissionError(f"{path} is not a private file of this user; refusing to share gradients through it")
            os.ftruncate(descriptor, size)  # every replica asks for the same size: idempotent
            self._mapping = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        whole = torch.frombuffer(self._mapping, dtype=dtype).view(replicas + 1, numel)
        self.rows, self.result = whole[:replicas], whole[replicas]


class SharedMemorySum:
    """Sums a tensor in place over the replicas of this stage, all on one node, through /dev/shm.

    Each replica's tensor is its own row of a shared mapping: a bucket allocated through
    `allocate` already is one, anything else is copied into a staging row first. After a barrier,
    replica i adds up slice i of every row into slice i of the result row (a reduce-scatter
    with no sockets and no kernel copies); after a second barrier every replica copies the
    whole result row out (the all-gather). No third barrier is needed: after the second,
    nobody reads the contribution rows, and a replica rewrites its result slice only after
    the next sum's first barrier, which no peer reaches before it finished copying out.
    The barriers are tiny Gloo messages on the reducer's own group, so a missing replica
    still ends in a timeout, not a hang. Each slice is summed by one replica and read by
    all, so every replica ends with identical bits.
    """

    name = "shm"

    def __init__(self, groups: ProcessGroups, timeout_s: float) -> None:
        self.size = len(groups.replica_ranks)
        self.position = groups.replica_ranks.index(dist.get_rank())
        self.group = create_groups(replica_partition(groups), timeout_s)
        stage = groups.stage_ranks.index(dist.get_rank())
        # A name nobody can guess, agreed on by the stage's replicas: the first one draws it.
        token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        dist.broadcast(token, src=groups.replica_ranks[0], group=self.group)
        self.path_prefix = os.path.join(SHARED_MEMORY_DIR, f"replicator-{int(token):x}-stage{stage}")
        self._staging: dict[tuple[int, torch.dtype], _Segment] = {}
        self._owned: dict[int, _Segment] = {}  # allocated buckets, by their row's address
        self._unnamed: list[str] = []  # mapped here, perhaps not yet by every peer

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A zeroed buffer that is this replica's row of a new shared mapping, so summing it
        needs no copy in. Every replica must allocate the same buffers in the same order,
        then run `settle()` on the reducer's worker. None where shared memory cannot help."""
        if torch.device(device).type != "cpu":
            return None
        # Every replica allocates the same buckets in the same order, so the names agree.
        path = f"{self.path_prefix}-bucket{len(self._owned)}"
        segment = _Segment(path, self.size, numel, dtype)
        self._unnamed.append(path)
        row = segment.rows[self.position]
        self._owned[row.data_ptr()] = segment
        return row

    def settle(self) -> None:
        """Once every replica has mapped the new segments, remove their names: nothing is
        left in /dev/shm for a crash to leak, and the memory lives until the last unmap."""
        dist.barrier(group=self.group)
        for path in self._unnamed:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # a peer removed it first
        self._unnamed.clear()

    def _staging_segment(self, numel: int, dtype: torch.dtype) -> _Segment:
        key = (numel, dtype)
        if key not in self._staging:
            path = f"{self.path_prefix}-staging{len(self._staging)}"
            self._staging[key] = _Segment(path, self.size, numel, dtype)
            self._unnamed.append(path)
            self.settle()
        return self._staging[key]

    def sum_(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise TypeError(f"the shared-memory reducer sums host tensors only, got one on {tensor.device}; use 'flat'")
        flat = tensor.view(-1)
        if flat.numel() == 0:
            return  # every replica holds the same nothing; mmap cannot map zero bytes
        segment = self._owned.get(flat.data_ptr())
        if segment is None or segment.rows.shape[1] != flat.numel():  # not an allocated bucket: stage it
            segment = self._staging_segment(flat.numel(), flat.dtype)
            segment.rows[self.position].copy_(flat)
        mine = slice(flat.numel() * self.position // self.size, flat.numel() * (self.position + 1) // self.size)
        dist.barrier(group=self.group)
        torch.sum(segment.rows[:, mine], dim=0, out=segment.result[mine])
        dist.barrier(group=self.group)
        flat.copy_(segment.result)
