"""SharedMemorySum: a lossless sum over replicas through /dev/shm inside each node, sockets only across nodes."""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replicator.comm.agreement import PendingAgreement
from replicator.comm.decision import everyone_agrees
from replicator.comm.local_link import LocalLink
from replicator.comm.shared_segment import SHARED_MEMORY_DIR, reserve_pages, shared_memory_writable
from replicator.errors import ReplicaMismatchError
from replicator.sync.reducers.hierarchical import DEFAULT_CHUNK_BYTES, level_groups, replicas_per_node
from replicator.topology import ProcessGroups, group_of_mine

__all__ = ["SharedMemorySum", "shared_memory_usable", "host_memory_usable", "sum_in_ring_order", "SHARED_MEMORY_DIR"]



def host_memory_usable(device: torch.device) -> str | None:
    """None when this process can share gradients through /dev/shm; else the reason it cannot."""
    if device.type != "cpu":
        return f"gradients live on {device}, not in host memory"
    return shared_memory_writable()


def shared_memory_usable(groups: ProcessGroups, device: torch.device) -> str | None:
    """None when every stage's replicas can sum through shared memory alone; else the reason they cannot."""
    refusal = host_memory_usable(device)
    if refusal is not None:
        return refusal
    mesh = groups.mesh
    try:
        per_node = replicas_per_node(mesh.replica_partition[0], mesh.local_world_size)
    except ValueError as error:
        return str(error)
    if per_node != mesh.num_replicas:
        return f"the replicas span {mesh.num_replicas // per_node} nodes"
    return None


def sum_in_ring_order(parts: torch.Tensor, owner: int, out: torch.Tensor) -> None:
    """`out` = the sum of `parts`' rows (one per replica) in the order Gloo's ring all-reduce adds them for the
    slice of replica `owner`: from the replica before it, backwards round the ring to itself,
    ((x[owner-1] + x[owner-2]) + ...) + x[owner] (read off torch 2.13's Gloo at 2, 3 and 4 processes, for tensors
    of a few hundred to a million elements). A reduce-scatter summed so gives the bits of FSDP2's on Gloo."""
    replicas = parts.shape[0]
    if replicas == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[(owner - 1) % replicas], parts[(owner - 2) % replicas], out=out)
    for step in range(3, replicas + 1):
        out.add_(parts[(owner - step) % replicas])


class _Segment:
    """One mapping shared by the node's replicas: `replicas` rows of `numel` elements, row i replica i's tensor."""

    def __init__(self, path: str, replicas: int, numel: int, dtype: torch.dtype) -> None:
        size = replicas * numel * torch.empty((), dtype=dtype).element_size()
        # 0600 and a random name: only this user's processes that were told the name can map it.
        # O_NOFOLLOW and the owner check: a name planted in the world-writable /dev/shm by someone
        # else (a symlink to one of our files, or a file they can read) is refused, not shared.
        descriptor = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise PermissionError(
                    f"{path} is not a private file of this user; refusing to share gradients through it")
            os.ftruncate(descriptor, size)  # every replica asks for the same size: idempotent
            reserve_pages(descriptor, size, path, "gradient buckets",
                          "give it more (for a container, e.g. docker run --shm-size=2g) or use reducer='flat'")
            self._mapping = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        self.rows = torch.frombuffer(self._mapping, dtype=dtype).view(replicas, numel)


@dataclass(frozen=True)
class _Rows:
    """The first columns of a larger segment's rows: a staged tensor's place."""

    rows: torch.Tensor


class SharedMemorySum:
    """Sums a tensor in place over the replicas of this stage through /dev/shm: over all of
    them when they share one node; with `per_node`, over each node's, with one all-reduce
    across nodes in the middle (the two-level hierarchy of PowerAI DDL, shared memory inside).

    Each replica's tensor is a row of a shared mapping; between two barriers (messages on the
    node's LocalLink) replica i sums slice i of every row into its own and writes it back to
    all, so every replica ends with identical bits. Across nodes each local replica all-reduces
    its slice in chunks of `chunk_bytes`. Why two barriers suffice, why the first bucket needs
    none of its own, and how chunks overlap: docs/concepts/design.md, 'Shared-memory summation'.
    """

    def __init__(self, groups: ProcessGroups, timeout_s: float, per_node: int | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        mesh = groups.mesh
        partition = mesh.replica_partition
        self.size = mesh.num_replicas
        per_node = self.size if per_node is None else per_node
        levels = (per_node, self.size // per_node)
        self.name = "shm" if levels[1] == 1 else f"hierarchical:{per_node}x{levels[1]}"
        node_groups = [ranks for members in partition for ranks in level_groups(members, levels, 0)]
        neighbours = next(ranks for ranks in node_groups if mesh.rank in ranks)
        self.local_size, self.position = per_node, neighbours.index(mesh.rank)
        self.group = group_of_mine(node_groups, timeout_s)
        # The node's barriers carry no data: a Unix socket signals them ten times faster than Gloo.
        self.link = LocalLink.connect(self.group, timeout_s)
        self.across = None
        if levels[1] > 1:
            self.across = group_of_mine([ranks for members in partition for ranks in level_groups(members, levels, 1)],
                                        timeout_s)
        # A name nobody can guess, agreed on by the node's replicas of this stage: the first one draws it.
        token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        dist.broadcast(token, src=neighbours[0], group=self.group)
        self.path_prefix = os.path.join(SHARED_MEMORY_DIR, f"replicator-{int(token):x}-stage{mesh.stage_id}")
        self._require_one_shared_memory(groups, neighbours, int(token))
        self._staging: dict[torch.dtype, _Segment] = {}  # one per dtype, as long as the longest tensor staged
        self._staged_segments = 0
        self._owned: dict[int, _Segment] = {}  # allocated buckets, by their row's address
        self._unnamed: list[str] = []  # mapped here, perhaps not yet by every peer
        self._shared: dict[str, _Segment] = {}  # shared_rows' segments, by their caller's key

    def _require_one_shared_memory(self, groups: ProcessGroups, neighbours: list[int], token: int) -> None:
        """Raise on every process unless the replicas the topology puts on one node also see one
        /dev/shm (separate containers each have their own: summing there would silently miss peers)."""
        probe = f"{self.path_prefix}-probe"
        if self.position == 0:
            descriptor = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(token.to_bytes(8, "little"))
        self._barrier()
        try:
            with open(probe, "rb") as handle:
                sees_it = handle.read() == token.to_bytes(8, "little")
        except FileNotFoundError:
            sees_it = False
        everyone_sees_it = everyone_agrees(sees_it, groups.control)  # the whole job decides together
        if self.position == 0:
            os.unlink(probe)
        if not everyone_sees_it:
            raise RuntimeError(
                f"replicas that the topology places on one node do not share {SHARED_MEMORY_DIR} (this process, "
                f"rank {dist.get_rank()} with node peers {neighbours}, {'does' if sees_it else 'does not'} see its "
                "node's; separate containers or mount namespaces?), so gradients cannot be summed through shared "
                "memory; use reducer='flat', or give the processes of a node one /dev/shm"
            )

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    def _barrier(self) -> None:
        if self.link is not None:
            self.link.barrier()
        else:
            dist.barrier(group=self.group)

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A zeroed buffer that is this replica's row of a new shared mapping, so summing it
        needs no copy in. Every replica must allocate the same buffers in the same order,
        then run `settle()` on the reducer's worker. None where shared memory cannot help."""
        if torch.device(device).type != "cpu":
            return None
        # Every replica allocates the same buckets in the same order, so the names agree.
        path = f"{self.path_prefix}-bucket{len(self._owned)}"
        segment = _Segment(path, self.local_size, numel, dtype)
        self._unnamed.append(path)
        row = segment.rows[self.position]
        self._owned[row.data_ptr()] = segment
        return row

    def settle(self) -> None:
        """Once every replica has mapped the new segments, remove their names: nothing is
        left in /dev/shm for a crash to leak, and the memory lives until the last unmap."""
        self._barrier()
        for path in self._unnamed:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # a peer removed it first
        self._unnamed.clear()

    def shared_rows(self, key: str, rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`rows` x `numel` zeroed elements that every replica of the node maps, for a protocol of the caller's own;
        they replace those it asked for under `key` before. Collective: every replica of the node asks for the same
        in the same order, and this returns once all have mapped it."""
        path = f"{self.path_prefix}-{key}{self._staged_segments}"
        self._staged_segments += 1
        self._shared[key] = segment = _Segment(path, rows, numel, dtype)
        self._unnamed.append(path)
        self.settle()
        return segment.rows

    def _staging_segment(self, numel: int, dtype: torch.dtype) -> _Segment | _Rows:
        """Where a tensor that is no allocated bucket is summed: the first `numel` columns of one segment per dtype,
        replaced by a longer one when a longer tensor comes (every replica stages the same tensors in the same
        order, so they replace it together). One per tensor length would keep a copy of every staged bucket
        (shard="gradients" stages them all) in shared memory for good."""
        segment = self._staging.get(dtype)
        if segment is None or segment.rows.shape[1] < numel:
            path = f"{self.path_prefix}-staging{self._staged_segments}"
            self._staged_segments += 1
            segment = self._staging[dtype] = _Segment(path, self.local_size, numel, dtype)
            self._unnamed.append(path)
            self.settle()
        return segment if segment.rows.shape[1] == numel else _Rows(segment.rows[:, :numel])

    @property
    def gathers(self) -> bool:
        """Can `all_gather_` run here: do all the replicas share this node?"""
        return self.across is None

    def all_gather_(self, tensor: torch.Tensor, bounds: list[int], arrival: PendingAgreement | None = None) -> None:
        """Replica i holds elements `bounds[i]:bounds[i + 1]` of `tensor`; afterwards every replica holds them all.

        Each replica writes its part into every replica's row of a staging segment, between two barriers (the
        first: every replica is done with the segment's last use), then reads its own row. `arrival`, a check
        every replica made on reaching this call and that matched, takes the first barrier's place.
        """
        flat = tensor.view(-1)
        if flat.numel() == 0:
            return
        segment = self._staging_segment(flat.numel(), flat.dtype)
        mine = slice(bounds[self.position], bounds[self.position + 1])
        self._all_loaded(arrival)
        for peer in range(self.local_size):
            if peer != self.position:
                segment.rows[peer, mine] = flat[mine]
        self._barrier()
        own = segment.rows[self.position]
        for peer in range(self.local_size):
            if peer != self.position:
                theirs = slice(bounds[peer], bounds[peer + 1])
                flat[theirs] = own[theirs]

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       arrival: PendingAgreement | None = None) -> None:
        """`output` gets the sum over the replicas of slice i of their `tensor` (i: this replica's position; the
        slices are as long as `output`). `arrival`, a check every replica made on reaching this call and that
        matched, takes the first barrier's place.

        Each replica writes its slice j into row j of a staging segment (its own place in that row), then, after
        the barrier, sums the slices in its own row in Gloo's order (`sum_in_ring_order`): the write of every
        peer's whole tensor into every row, and the copy back of the whole sum, that `sum_` needs are saved. One
        node only.
        """
        flat, size = tensor.view(-1), output.numel()
        if flat.numel() != size * self.local_size:
            raise ValueError(f"reduce_scatter: {flat.numel()} elements do not cut into {self.local_size} slices of "
                             f"{size}")
        if size == 0:
            return
        segment = self._staging_segment(flat.numel(), flat.dtype)
        self._all_loaded(arrival)  # every replica is done with the segment's last use
        place = slice(self.position * size, (self.position + 1) * size)
        for owner, part in enumerate(flat.view(self.local_size, size)):
            segment.rows[owner, place] = part
        self._barrier()
        sum_in_ring_order(segment.rows[self.position].view(self.local_size, size), self.position, output.view(-1))

    def sum_(self, tensor: torch.Tensor) -> None:
        self.sum_after(tensor, None)

    def sum_after(self, tensor: torch.Tensor, arrival: PendingAgreement | None) -> None:
        """Sum like `sum_`, with `arrival` in place of the first barrier.

        `arrival` must be a check that every replica starts only once its `tensor` (an
        allocated bucket) is completely written, presence slots included. If the replicas
        made different checks, their buckets belong to different syncs: nothing is summed and
        this raises, while the caller's wait on the check raises the error that names them.
        """
        if tensor.device.type != "cpu":
            raise TypeError(f"the shared-memory reducer sums host tensors only, got one on {tensor.device}; use 'flat'")
        flat = tensor.view(-1)
        if flat.numel() == 0:
            return  # every replica holds the same nothing; mmap cannot map zero bytes
        segment: _Segment | _Rows | None = self._owned.get(flat.data_ptr())
        if segment is None or segment.rows.shape[1] != flat.numel():  # not an allocated bucket: stage it
            segment, staged = self._staging_segment(flat.numel(), flat.dtype), True
        else:
            staged = False
        # A staged tensor is copied in here, after the check was made: it needs a barrier of its own.
        arrival = None if staged else arrival
        bounds = [flat.numel() * k // self.local_size for k in range(self.local_size + 1)]
        if self.across is not None:
            self._sum_across_nodes(flat, segment, bounds, staged, arrival)
            return
        own = segment.rows[self.position]
        if staged:
            own.copy_(flat)
        mine = slice(bounds[self.position], bounds[self.position + 1])
        self._all_loaded(arrival)
        self._add_peers(segment, mine)
        self._write_to_peers(segment, mine)
        self._barrier()
        if staged:
            flat.copy_(own)

    def scatter_after(self, tensor: torch.Tensor, arrival: PendingAgreement | None, tail: int,
                      out: torch.Tensor | None = None) -> None:
        """Sum like `sum_after`, but stop after the scatter: replica i's slice of `tensor` (the same slices as a sum's)
        and the elements from `tail` on (a bucket's presence slots) hold the sums; the rest is left as it was.

        What sharded data parallelism (shard="gradients") keeps: the writes of every slice into every peer's row,
        and the copy out of the whole tensor, are saved. With `out`, the sum of this replica's slice short of `tail`
        goes there instead (read from the rows, written once: no copy of it in or out of `tensor`), and `tensor` may
        be the first columns of an allocated row (a bucket of shard="gradients" loaded in place). One node only.
        """
        flat = tensor.view(-1)
        if flat.numel() == 0:
            return
        segment = self._rows_of(flat)
        staged = segment is None
        if segment is None:
            segment = self._staging_segment(flat.numel(), flat.dtype)
            segment.rows[self.position].copy_(flat)
        own = segment.rows[self.position]
        bounds = [flat.numel() * k // self.local_size for k in range(self.local_size + 1)]
        mine = slice(bounds[self.position], bounds[self.position + 1])
        summed = slice(mine.start, max(mine.start, min(mine.stop, tail)))  # the gradients' part of it
        shared = slice(max(mine.start, tail), mine.stop)  # the tail's sums, which every replica needs
        if out is not None and out.numel() != summed.stop - summed.start:
            raise ValueError(f"out holds {out.numel()} elements, this replica's slice short of the tail "
                             f"{summed.stop - summed.start}")
        self._all_loaded(None if staged else arrival)
        if out is None:
            self._add_peers(segment, mine)
        else:
            self._add_peers(segment, summed, out)
            self._add_peers(segment, shared)
        if shared.start < shared.stop:
            self._write_to_peers(segment, shared)
        self._barrier()
        if staged:
            if out is None:
                flat[mine] = own[mine]
            flat[tail:] = own[tail:]

    def _rows_of(self, flat: torch.Tensor) -> _Segment | _Rows | None:
        """The rows `flat` is this replica's row of (or the first columns of): None for a tensor to stage. Every
        replica passes the same columns of its own row of the same allocation, so the slices line up."""
        segment = self._owned.get(flat.data_ptr())
        if segment is None or segment.rows.shape[1] < flat.numel():
            return None
        return segment if segment.rows.shape[1] == flat.numel() else _Rows(segment.rows[:, : flat.numel()])

    def all_gather_into_(self, buckets: list[tuple[list[tuple[torch.Tensor, int]], list[int], torch.Tensor | None]]
                         ) -> None:
        """For each bucket `(parts, bounds, via)`: `parts` are flat tensors (a bucket's parameters) laid at their
        offsets in the bucket's elements, of which this replica holds the true values of `bounds[i]:bounds[i + 1]`
        (i its position); afterwards every replica's parts hold them all.

        Each replica writes its elements from its parts straight into every peer's row, then, after a barrier,
        copies the peers' elements from its own row straight into its parts: one write and one read of the
        bucket, against the staged `all_gather_`'s copies of the whole bucket into and out of a flat tensor.
        `via` is this replica's row of an allocated segment that nothing else uses meanwhile (shard="gradients"'s
        transport), at least as wide as the bucket; None stages the bucket. A bucket never goes through the
        segment of the bucket before it without a barrier, since a peer may still be reading that one.
        """
        last: int | None = None
        for parts, bounds, via in buckets:
            numel = bounds[-1]
            if numel == 0:
                continue
            found = None if via is None else self._rows_of(via.view(-1)[:numel])
            segment = self._staging_segment(numel, parts[0][0].dtype) if found is None else found
            home = segment.rows.untyped_storage().data_ptr()
            if last is None or home == last:  # every replica done with the segment's last use
                self._barrier()
            last = home
            low, high = bounds[self.position], bounds[self.position + 1]
            for part, offset in parts:
                start, stop = max(low, offset), min(high, offset + part.numel())
                if start < stop:
                    for peer in range(self.local_size):
                        if peer != self.position:
                            segment.rows[peer, start:stop] = part[start - offset : stop - offset]
            self._barrier()
            own = segment.rows[self.position]
            for part, offset in parts:
                for peer in range(self.local_size):
                    if peer == self.position:
                        continue
                    start, stop = max(bounds[peer], offset), min(bounds[peer + 1], offset + part.numel())
                    if start < stop:
                        part[start - offset : stop - offset] = own[start:stop]

    def _all_loaded(self, arrival: PendingAgreement | None) -> None:
        """Return once every local replica's row is loaded: the first barrier of a sum."""
        if arrival is None:
            self._barrier()
        elif not arrival.arrived():
            raise ReplicaMismatchError(
                "gradient buckets were not summed: the replicas reached different gradient syncs (the error "
                "raised by backward(), train_step or the optimizer's step says which)")

    # Between a sum's first and last barrier, slice i of every row is replica i's alone: it adds
    # the peers' slices into its own row's, then writes the sum back into theirs. Each replica
    # then finds the whole sum in its own row (a bucket's gradients already live there): the
    # buffer is read once, where summing apart and copying out would read it twice.
    def _add_peers(self, segment: _Segment | _Rows, mine: slice, out: torch.Tensor | None = None) -> None:
        """Slice `mine` of every row summed into this replica's row, or into `out` (the same additions, the same
        bits: only where the result is written differs)."""
        rows = segment.rows[:, mine]
        if self.local_size == 2:
            if out is None:
                rows[self.position].add_(rows[1 - self.position])
            else:
                torch.add(rows[self.position], rows[1 - self.position], out=out)
        elif out is None:  # one pass over every row, where L - 1 additions in place would read this row L - 1 times
            rows[self.position] = rows.sum(dim=0)
        else:
            torch.sum(rows, dim=0, out=out)

    def _write_to_peers(self, segment: _Segment | _Rows, mine: slice) -> None:
        for peer in range(self.local_size):
            if peer != self.position:
                segment.rows[peer, mine] = segment.rows[self.position, mine]

    def _sum_across_nodes(self, flat: torch.Tensor, segment: _Segment | _Rows, bounds: list[int], staged: bool,
                          arrival: PendingAgreement | None) -> None:
        """Sum this node's slice chunk by chunk, all-reducing each chunk with the other nodes'
        replicas of the same slice (whose bounds are the same on every node), and write each
        chunk into the peers' rows as soon as it comes back, while later chunks are still
        crossing. A staged tensor is also copied in and out chunk by chunk, a barrier each, so
        the first chunk leaves before the last is copied in, and the last copy out is one
        chunk's. Every local replica takes as many barriers as the longest slice has chunks, so
        uneven slices keep them matched."""
        step = max(1, self.chunk_bytes // segment.rows.element_size())
        chunks = -(-max(b - a for a, b in zip(bounds, bounds[1:])) // step)

        def chunk(owner: int, k: int) -> slice:
            end = bounds[owner + 1]
            return slice(min(bounds[owner] + k * step, end), min(bounds[owner] + (k + 1) * step, end))

        own = segment.rows[self.position]
        if not staged:
            self._all_loaded(arrival)
        crossing = []
        for k in range(chunks):
            if staged:
                for owner in range(self.local_size):
                    own[chunk(owner, k)] = flat[chunk(owner, k)]
                self._barrier()
            mine = chunk(self.position, k)
            self._add_peers(segment, mine)
            empty = mine.stop == mine.start
            crossing.append(None if empty else dist.all_reduce(own[mine], op=dist.ReduceOp.SUM, group=self.across,
                                                               async_op=True))
        for k, handle in enumerate(crossing):
            if handle is not None:
                handle.wait()
            self._write_to_peers(segment, chunk(self.position, k))
            if staged:  # copy out chunk k of every slice while later chunks still cross
                self._barrier()
                for owner in range(self.local_size):
                    flat[chunk(owner, k)] = own[chunk(owner, k)]
        if not staged:
            self._barrier()
