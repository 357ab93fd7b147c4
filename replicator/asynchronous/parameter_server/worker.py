"""Internal: a sync group's side of the exchange: its leader pushes the group's averaged gradient to
every server and pulls the parameters they produce; the group's other members get them from it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from replicator.asynchronous.parameter_server import links
from replicator.asynchronous.parameter_server.payloads import SharedPayloads, shared_payloads_wanted
from replicator.asynchronous.parameter_server.server import DIED, reply_header_size
from replicator.asynchronous.parameter_server.shards import ShardMap
from replicator.asynchronous.parameter_server.staleness import StalenessRecord
from replicator.checkpoint.errors import CheckpointError
from replicator.comm.frames import Outgoing, byte_view
from replicator.comm.peer_link import PeerLinkError
from replicator.errors import ReplicatorError
from replicator.timeline import recorder as timeline
from replicator.topology import Mesh

__all__ = ["GroupExchange", "ServerError"]

# Each request as the timeline names its span.
_SPAN_NAMES = {links.PULL: "pull", links.PUSH: "push", links.SAVE: "save at cut", links.DONE: "finish"}


class ServerError(ReplicatorError):
    """A parameter server died, hung or dropped this group: raised on every worker of the group."""


class GroupExchange:
    """Push and pull for one sync group; every member calls the same methods at the same points.

    The trained parameters are views of one flat buffer per optimizer, server and dtype (see
    `Shard.bind`): a server's reply lands in them, and the leader passes them to its members."""

    def __init__(self, mesh: Mesh, group: dist.ProcessGroup | None, shards: ShardMap, max_staleness: int | None,
                 timeout_s: float, plan: links.Links) -> None:
        self.mesh, self.group, self.timeout_s = mesh, group, timeout_s
        self.group_id = mesh.group_id
        self.leader = mesh.group_partition[self.group_id][0]
        self.is_leader = mesh.rank == self.leader
        self.shards = shards
        self.num_servers = mesh.serving
        for row in shards.shards:
            for shard in row:
                shard.bind()
        self._apart = any(shard.apart for row in shards.shards for shard in row)  # some parameter is not a view
        self.record = StalenessRecord(max_staleness)
        self.departed: dict[int, str] = {}  # other groups the servers reported gone, and how
        self.step = 0
        self.on_wait: Callable[[float], None] = lambda seconds: None  # told each exchange's seconds (step times)
        self._header = torch.empty(reply_header_size(len(mesh.group_partition)), dtype=torch.int64)
        self._numbers = byte_view(self._header).cast("q")  # the reply header's numbers, read without torch
        self._flat_lists: dict[tuple[tuple[int, ...], int | None], Outgoing] = {}
        # What each reply lands in: a tuple, so that the link checks it and views its bytes once.
        self._replies: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, ...]] = {}
        self._pushed: dict[tuple[int, int], tuple[list[float], list[bool], Outgoing]] = {}
        self.shared: list[SharedPayloads | None] = []  # per server: the segment its payloads travel in, if any
        self._slot_views: dict[tuple[int, int], list[torch.Tensor]] = {}
        if self.is_leader:
            self.servers = [plan.to_server(server) for server in range(self.num_servers)]
            self.shared = [self._offer(server, link) for server, link in enumerate(self.servers)]
            self.members = plan.to_members()
            self.transport = self.servers[0].transport
        else:
            self.servers, self.members = [], []
            self.to_leader = plan.to_leader()
            self.transport = self.to_leader.transport

    def _offer(self, server: int, link: links.Link) -> SharedPayloads | None:
        """On the server's node (a Unix socket), a segment for the payloads to and from it: made here, offered by
        name, mapped by the server, unlinked at once. None where it cannot be (the payloads stay on the socket)."""
        if link.transport != "unix" or shared_payloads_wanted() is not None:
            return None
        try:
            payloads = SharedPayloads.make(self.shards, server)
        except OSError:
            return None
        try:
            name = torch.frombuffer(bytearray(payloads.segment.name.encode("ascii")), dtype=torch.uint8)
            link.send(links.OFFER, [name])
            answer = link.receive()
        finally:
            payloads.segment.unlink()  # the server has it mapped (or refused it): no name is left behind
        if answer.kind != links.OFFER:
            raise ServerError(f"parameter server {server} answered the offer of shared memory with a frame of kind "
                              f"{answer.kind}")
        if not answer.flags:
            return None
        for k in range(len(self.shards.optimizers)):  # the parameters become views of the reply slot
            self.shards.shard(k, server).move(payloads.slots[k].reply)
        return payloads

    def link_bytes(self) -> int:
        """Bytes this process sent to and received from the servers (frames whole: headers and payloads)."""
        return sum(getattr(link, "sent_bytes", 0) + getattr(link, "received_bytes", 0) for link in self.servers)

    @property
    def payloads(self) -> str:
        """Where the payloads to the servers travel: "shared memory" (every server on this node), or the links'."""
        if self.shared and all(self.shared):
            return "shared memory"
        return "mixed" if any(self.shared) else self.transport

    # -- the three requests ----------------------------------------------------------------------
    def pull(self) -> None:
        """The servers' current parameters, into every optimizer's parameters (the start of a run)."""
        self._exchange(links.PULL, None, range(len(self.shards.optimizers)))

    def push(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        """Send the group's averaged gradients of optimizer `index`; take the parameters that come back."""
        self.record.updates += 1
        self.step = self.record.updates
        self._exchange(links.PUSH, index, [index])

    def save(self, state: bytes) -> None:
        """Hand this process's `state` to the servers and wait at the checkpoint's cut until they have written it;
        then take the parameters they hold."""
        links.SavedStates.put(self.mesh.rank, state)
        if self.group is not None and self.mesh.group_size > 1:
            dist.barrier(group=self.group)  # every member's state is in the store before the leader asks
        self._exchange(links.SAVE, None, range(len(self.shards.optimizers)))

    def finish(self) -> None:
        """Say this group is done; wait for every group to be, and take the final parameters."""
        self._exchange(links.DONE, None, range(len(self.shards.optimizers)))

    def close(self) -> None:
        for link in [*self.servers, *self.members, *([self.to_leader] if not self.is_leader else [])]:
            link.close()

    # -- how -------------------------------------------------------------------------------------
    def _exchange(self, kind: int, index: int | None, optimizers: Iterable[int]) -> None:
        with timeline.span(_SPAN_NAMES[kind], "async", step=self.step, group=self.group_id):
            self._exchange_with_servers(kind, index, list(optimizers))

    def _flats(self, optimizers: list[int], server: int | None = None) -> Outgoing:
        """The flat buffers of `optimizers`' shards on `server` (None: on every server), in the order frames carry
        (the same object each time: the buffers never move, so their descriptors and bytes are taken once)."""
        key = (tuple(optimizers), server)
        if (flats := self._flat_lists.get(key)) is None:
            servers = range(self.num_servers) if server is None else [server]
            flats = self._flat_lists[key] = Outgoing([flat for k in optimizers for s in servers
                                                      for flat in self.shards.shard(k, s).flats])
        return flats

    def _exchange_with_servers(self, kind: int, index: int | None, optimizers: list[int]) -> None:
        started = time.perf_counter()
        # The verdict: status, the failing server, the staleness each server measured. The leader's travels to
        # its members first, so that on a server's failure every member raises the same error instead of waiting
        # for parameters that will never come.
        verdict = [-1] * (2 + self.num_servers)
        if self.is_leader:
            message = self._leader_exchange(kind, index, optimizers, verdict)
            self._tell_members(verdict, message, optimizers)
        else:
            message = self._hear_leader(verdict, optimizers)
        if verdict[0] == links.SAVE_FAILED:
            raise CheckpointError(f"the parameter servers could not write the checkpoint (raised on rank "
                                  f"{self.mesh.rank}, sync group {self.group_id}): {links.SavedStates.error()}")
        if verdict[0] != links.OK:
            server = verdict[1]
            raise ServerError(message or (
                f"parameter server {server} (rank {self.mesh.serving_ranks[server]}) failed or dropped sync group "
                f"{self.group_id}; see the error of its leader (rank {self.leader})"))
        if self._apart:  # parameters on an accelerator: from the buffers the bytes landed in
            for k in optimizers:
                for server in range(self.num_servers):
                    self.shards.shard(k, server).settle()
        if kind == links.PUSH:
            self.record.values.extend(verdict[2:])
        waited = time.perf_counter() - started
        self.record.wait_seconds += waited
        self.on_wait(waited)

    def _tell_members(self, verdict: list[int], message: str, optimizers: list[int]) -> None:
        """The verdict (and why, on a failure) to each member, then the parameters it received."""
        if not self.members:
            return
        why = [torch.frombuffer(bytearray(message.encode("utf-8")), dtype=torch.uint8)] if message else []
        numbers = torch.tensor(verdict, dtype=torch.int64)
        for link in self.members:
            try:
                link.send(links.VERDICT, [numbers, *why])
                if verdict[0] == links.OK:
                    link.send(links.PARAMETERS, self._flats(optimizers))
            except PeerLinkError as error:
                if verdict[0] == links.OK:  # else the leader's own error, which follows, says more
                    raise ReplicatorError(f"the leader of sync group {self.group_id} (rank {self.leader}) could not "
                                          f"pass the parameters on to {link.peer}: {error}") from error

    def _hear_leader(self, verdict: list[int], optimizers: list[int]) -> str:
        """A member's side: the leader's verdict and, when all went well, the parameters, landing in place."""
        try:
            frame = self.to_leader.receive()
            if frame.kind != links.VERDICT or not frame.tensors or frame.tensors[0].shape != (len(verdict),):
                raise PeerLinkError(f"{self.to_leader.peer} sent a frame of kind {frame.kind}, not a verdict")
            verdict[:] = frame.tensors[0].tolist()
            message = bytes(frame.tensors[1].numpy()).decode("utf-8", "replace") if len(frame.tensors) > 1 else ""
            if verdict[0] == links.OK:
                self.to_leader.receive(into=self._flats(optimizers))
        except PeerLinkError as error:
            raise ServerError(
                f"the leader of sync group {self.group_id} (rank {self.leader}) did not say how its exchange with the "
                f"parameter servers went (raised on rank {self.mesh.rank}): {error}. See the leader's own error or "
                "exit status") from error
        return message

    def _leader_exchange(self, kind: int, index: int | None, optimizers: list[int], verdict: list[int]) -> str:
        """Request from every server, then read every answer; returns an error message, or ""."""
        failure = self._send_requests(kind, index, verdict)
        if failure:
            return failure
        with timeline.span("wait on servers", "async"):
            return self._read_answers(optimizers, verdict)

    def _send_requests(self, kind: int, index: int | None, verdict: list[int]) -> str:
        """One frame to every server (for a push, with the gradient of its shard); an error message, or ""."""
        for server, link in enumerate(self.servers):
            tensors: list[torch.Tensor] | Outgoing = []
            if kind == links.PUSH:
                assert index is not None
                tensors = self._gradient(index, server)
            try:
                link.send(links.push_kind(index) if index is not None else kind, tensors, request=self.step)
            except PeerLinkError as error:
                return self._failed(verdict, server, "could not be reached", error)
        return ""

    def _read_answers(self, optimizers: list[int], verdict: list[int]) -> str:
        """Every server's answer, its parameters landing in place; an error message, or ""."""
        verdict[0] = links.OK
        header = self._header
        for server, link in enumerate(self.servers):
            key = (tuple(optimizers), server)
            if (into := self._replies.get(key)) is None:  # in shared memory, the header alone: the rest is in place
                into = self._replies[key] = (header, *([] if self.shared[server] else self._flats(optimizers, server)))
            try:
                link.receive(into=into)
            except (PeerLinkError, ValueError) as error:  # ValueError: a reply that does not fit: out of step
                return self._failed(verdict, server, "stopped answering", error)
            status, staleness, _, *codes = self._numbers.tolist()
            if status == links.SAVE_FAILED:
                verdict[0] = links.SAVE_FAILED
                return ""
            if status != links.OK:
                return self._dropped(verdict, server, links.Dropped.read(self.group_id) or "")
            verdict[2 + server] = staleness
            if any(codes):
                self._note_departures(codes)
        return ""

    def _gradient(self, index: int, server: int) -> list[torch.Tensor] | Outgoing:
        """The frame of a push: learning rates, which parameters have a gradient, and each gradient from its own
        memory (no packing: the frame's one `sendmsg` gathers them). The first two are kept from push to push, with
        their descriptors, and made again only when the rates or the gradients present change."""
        shard = self.shards.shard(index, server)
        grads = [p.grad for p in shard.params]
        rates = [float(g["lr"]) for g in self.shards.optimizers[index].param_groups]
        presence = [g is not None for g in grads]
        kept = self._pushed.get((index, server))
        if kept is None or kept[0] != rates or kept[1] != presence:
            kept = self._pushed[(index, server)] = (rates, presence, Outgoing(
                [torch.tensor(rates, dtype=torch.float64), torch.tensor(presence, dtype=torch.uint8)]))
        if self.shared[server] is None:
            return [*kept[2], *(_on_the_wire(g, p) for g, p in zip(grads, shard.params, strict=True))]
        if (views := self._slot_views.get((index, server))) is None:
            views = self._slot_views[(index, server)] = self.shared[server].gradient_views(index, shard)  # type: ignore[union-attr]
        with torch.no_grad():  # one copy, into the slot the server reads
            if all(presence):  # one call for every tensor: the same bytes as copy_ each
                torch._foreach_copy_(views, grads)  # type: ignore[arg-type]  # (all present: no None left)
            else:
                for grad, view in zip(grads, views, strict=True):
                    view.zero_() if grad is None else view.copy_(grad)  # zeros: a sum of groups adds them
        return kept[2]

    def _failed(self, verdict: list[int], server: int, what: str, error: BaseException | None) -> str:
        verdict[0], verdict[1] = links.FAILED, server
        if (why := links.Dropped.read(self.group_id)) is not None:  # the servers went on without this group
            return self._dropped(verdict, server, why)
        rank = self.mesh.serving_ranks[server]
        cause = f": {error}" if error is not None else ""
        return (f"parameter server {server} (rank {rank}) {what} while sync group {self.group_id} (leader rank "
                f"{self.leader}) was at step {self.step}{cause}. The asynchronous run cannot go on without the "
                "parameters that server holds; see that server's own error or exit status")

    def _dropped(self, verdict: list[int], server: int, why: str) -> str:
        verdict[0], verdict[1] = links.FAILED, server
        return (f"parameter server {server} (rank {self.mesh.serving_ranks[server]}) dropped sync group "
                f"{self.group_id} (leader rank {self.leader}) as hung, {self.step - 1} updates into the run: "
                f"{why or 'it sent nothing for longer than REPLICATOR_TIMEOUT'}, so the servers went on without it. "
                f"A group that computes longer than REPLICATOR_TIMEOUT ({self.timeout_s:g} s) between optimizer "
                "steps needs a larger REPLICATOR_TIMEOUT")

    def _note_departures(self, codes: list[int]) -> None:
        for group, code in enumerate(codes):
            if code and group not in self.departed:
                self.departed[group] = "died" if code == DIED else "hung"


def _on_the_wire(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    """A gradient as the server's buffer takes it: a contiguous host tensor of its parameter's dtype (zeros for
    None); the gradient itself when it is one already."""
    if grad is None:
        return torch.zeros(param.shape, dtype=param.dtype)
    if grad.device.type != "cpu" or grad.dtype != param.dtype or not grad.is_contiguous():
        grad = grad.detach().to("cpu", param.dtype).contiguous()
    return grad  # its bytes are what is sent: no detached alias needed
