"""SimulatedCluster: nodes as network namespaces joined by a rate-limited switch, for multi-node jobs on one machine."""

from __future__ import annotations

import atexit
import ctypes
import importlib
import ipaddress
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from replicator.testing.processes import run_replicas

__all__ = ["SimulatedCluster", "Node", "run_on_cluster", "cluster_available", "remove_stale", "PREFIX"]

# Every namespace this module creates is named PREFIX-<pid>-<serial>-<role>, so a later run can
# tell its own leftovers (dead pid) from a live cluster of a parallel run (live pid).
PREFIX = "rpcl"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-(sw|n\d+)$")
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns"

_live: dict[int, SimulatedCluster] = {}
_serial = 0
_lock = threading.Lock()


@dataclass(frozen=True)
class Node:
    """One simulated machine: its namespace, its network interface (node side of its veth) and address."""

    index: int
    namespace: str
    interface: str
    address: str


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {result.returncode}): {result.stderr.strip()}")
    return result


def cluster_available() -> tuple[bool, str]:
    """(True, "") when this process can build a SimulatedCluster, else (False, why not)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "a simulated cluster needs root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"a simulated cluster needs the `{tool}` command (iproute2)"
    # Prove the kernel side too: a namespace with a veth pair and a tbf qdisc, removed at once.
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except RuntimeError as error:
        return False, f"cannot create a network namespace: {error}"
    try:
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "100mbit", "burst", "64kb",
              "latency", "10ms"])
    except RuntimeError as error:
        return False, f"veth pairs or the tbf qdisc are not available: {error}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def _namespaces() -> list[str]:
    listing = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces of this module whose creating process is gone (killed before it could clean up)."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name) or re.match(rf"^{PREFIX}-(\d+)-probe$", name)
        if match is not None and not _pid_alive(int(match.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Destinations of every IPv4 route (all tables) and every address's subnet in this namespace."""
    used: list[ipaddress.IPv4Network] = []
    types = {"local", "broadcast", "unicast", "multicast", "anycast", "blackhole", "unreachable", "prohibit", "throw",
             "nat"}
    for line in _run(["ip", "-4", "-o", "route", "show", "table", "all"], check=False).stdout.splitlines():
        tokens = line.split()
        if tokens and tokens[0] in types:
            tokens = tokens[1:]
        if not tokens or tokens[0] == "default":
            continue  # the default route covers everything; only specific routes can shadow ours
        try:
            used.append(ipaddress.IPv4Network(tokens[0], strict=False))
        except ValueError:
            continue
    for line in _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout.splitlines():
        match = re.search(r"inet (\S+)", line)
        if match:
            used.append(ipaddress.IPv4Interface(match.group(1)).network)
    return used


def _choose_subnet(seed: int) -> ipaddress.IPv4Network:
    """A private /24 in 10.0.0.0/8 that no route or address of the host overlaps.

    The nodes live in namespaces of their own, so an overlap could not misroute anything;
    avoiding one anyway keeps addresses in logs unambiguous, and seeding by pid keeps
    parallel runs on different subnets.
    """
    used = _networks_in_use()
    for attempt in range(4096):
        value = (seed * 7919 + attempt * 104729) % (250 * 256)
        candidate = ipaddress.IPv4Network(f"10.{200 + value // 256 % 50}.{value % 256}.0/24")
        if not any(candidate.overlaps(network) for network in used):
            return candidate
    raise RuntimeError("no free /24 in 10.200.0.0-10.249.255.0 for the simulated cluster; pass subnet=")


def _enter_namespace(namespace: str) -> None:
    """Move this process (its calling thread) into `namespace`; threads started later inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {namespace!r} failed: {os.strerror(error)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Placement:
    """What a rank needs to find its node: picklable, sent to every process."""

    nodes: tuple[Node, ...]
    procs_per_node: int


def _resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    if callable(target):
        return target
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"a target is a function or 'module:function', got {target!r}")
    function: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return function


def _on_node(placement: _Placement, target: Callable[..., Any] | str, args: tuple) -> Any:
    """Runs in each rank (under run_replicas): join this rank's node, then call the target."""
    rank = int(os.environ["RANK"])
    node = placement.nodes[rank // placement.procs_per_node]
    # setns() moves only the calling thread. A process fresh from run_replicas' forkserver has
    # no other thread yet, and Gloo and the TCP store open their sockets on this thread or on
    # threads started later, which inherit the namespace.
    _enter_namespace(node.namespace)
    # Gloo binds the node's own address; between two processes of one node the kernel then
    # delivers over the namespace's loopback (a local route), so only inter-node traffic
    # crosses the rate-limited veth: a fast intra-node link and a slow network, as on real nodes.
    os.environ.update(GLOO_SOCKET_IFNAME=node.interface, MASTER_ADDR=placement.nodes[0].address,
                      SIMULATED_CLUSTER_NODE=node.namespace)
    return _resolve(target)(*args)


class SimulatedCluster:
    """`nodes` network namespaces on a private switch, each node's link shaped to `link_mbit` both ways.

    Layout: a "switch" namespace holds a bridge; each node namespace is joined to it by a
    veth pair, so no packet touches the host's interfaces. A tbf qdisc on each end of a
    node's veth (node egress and switch egress toward the node) limits the node's link to
    `link_mbit` Mbit/s per direction, full duplex, counted at layer 2 as a NIC's line rate
    is. `burst_bytes` (default: 1 ms at the rate, at least 64 KiB, enough for one
    segmentation-offload packet) is what may pass at once above the rate; `queue_ms` is the
    switch buffer. There is no added propagation delay (this kernel has no netem).

    Use as a context manager; `run(fn, *args)` runs `fn` on nodes × procs_per_node ranks
    with torchrun's variables, as `run_replicas` does on loopback. Namespaces are removed on
    exit, on an exception, at interpreter exit, and (if the process was killed) by the next
    cluster's start.
    """

    def __init__(self, nodes: int = 2, procs_per_node: int = 2, link_mbit: float = 1000.0, *,
                 burst_bytes: int | None = None, queue_ms: float = 50.0, mtu: int = 1500,
                 subnet: str | None = None) -> None:
        if nodes < 1 or procs_per_node < 1:
            raise ValueError(
                f"need at least 1 node and 1 process per node, got nodes={nodes}, procs_per_node={procs_per_node}"
            )
        if nodes > 250:
            raise ValueError(f"at most 250 nodes fit the cluster's /24, got {nodes}")
        if link_mbit <= 0:
            raise ValueError(f"link_mbit must be > 0, got {link_mbit}")
        self.num_nodes = nodes
        self.procs_per_node = procs_per_node
        self.link_mbit = float(link_mbit)
        rate_bytes = self.link_mbit * 1e6 / 8
        self.burst_bytes = int(burst_bytes if burst_bytes is not None else max(64 * 1024, rate_bytes * 1e-3))
        self.queue_ms = queue_ms
        self.mtu = mtu
        self._subnet = subnet
        self.nodes: tuple[Node, ...] = ()
        self.switch = ""
        self._namespaces: list[str] = []

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.procs_per_node

    @property
    def link_bytes_per_s(self) -> float:
        """The line rate of one node's link, one direction, in bytes/s (layer 2, headers included)."""
        return self.link_mbit * 1e6 / 8

    def __enter__(self) -> SimulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Create the switch, the nodes and their shaped links (removing dead runs' leftovers first)."""
        global _serial
        if self._namespaces:
            raise RuntimeError("this SimulatedCluster is already started")
        available, why = cluster_available()
        if not available:
            raise RuntimeError(why)
        remove_stale()
        with _lock:
            _serial += 1
            serial = _serial
            _live[id(self)] = self
        base = f"{PREFIX}-{os.getpid()}-{serial}"
        subnet = ipaddress.IPv4Network(self._subnet) if self._subnet else _choose_subnet(os.getpid() * 31 + serial)
        hosts = list(subnet.hosts())
        if len(hosts) < self.num_nodes:
            raise ValueError(f"subnet {subnet} has room for {len(hosts)} nodes, need {self.num_nodes}")
        try:
            self.switch = f"{base}-sw"
            self._add_namespace(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            nodes = []
            for index in range(self.num_nodes):
                node = Node(index, f"{base}-n{index}", f"veth{index}", str(hosts[index]))
                self._add_namespace(node.namespace)
                port = f"port{index}"
                # Created directly inside the two namespaces: nothing ever appears in the host's.
                _run(["ip", "-n", self.switch, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                      "peer", "name", node.interface, "mtu", str(self.mtu), "netns", node.namespace])
                _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", self.switch, "link", "set", port, "up"])
                _run(["ip", "-n", node.namespace, "addr", "add", f"{node.address}/{subnet.prefixlen}",
                      "dev", node.interface])
                _run(["ip", "-n", node.namespace, "link", "set", node.interface, "up"])
                _run(["ip", "-n", node.namespace, "link", "set", "lo", "up"])
                self._shape(node.namespace, node.interface)  # node -> switch
                self._shape(self.switch, port)  # switch -> node
                nodes.append(node)
            self.nodes = tuple(nodes)
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)

    def _shape(self, namespace: str, device: str) -> None:
        rate = f"{self.link_mbit * 1000:.0f}kbit"
        limit = int(self.link_bytes_per_s * self.queue_ms / 1000) + self.burst_bytes
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
              "burst", str(self.burst_bytes), "limit", str(limit)])

    def close(self) -> None:
        """Delete every namespace of this cluster (their veths and qdiscs go with them). Idempotent."""
        # Nodes first: deleting a node's namespace destroys its veth and so the switch's end too.
        for name in reversed(self._namespaces):
            _run(["ip", "netns", "del", name], check=False)
        self._namespaces = []
        self.nodes = ()
        with _lock:
            _live.pop(id(self), None)

    def qdisc_stats(self) -> dict[str, str]:
        """`tc -s qdisc` of every shaped device, for a look at drops and overlimits."""
        stats = {}
        for node in self.nodes:
            command = ["tc", "-n", node.namespace, "-s", "qdisc", "show", "dev", node.interface]
            stats[node.interface] = _run(command).stdout
            port = f"port{node.index}"
            stats[port] = _run(["tc", "-n", self.switch, "-s", "qdisc", "show", "dev", port]).stdout
        return stats

    def run(self, fn: Callable[..., Any] | str, *args: Any, timeout_s: float = 120.0,
            env: dict[str, str] | None = None) -> list[Any]:
        """Run `fn(*args)` on every rank (node-major: rank = node * procs_per_node + local rank); results in rank order.

        `fn` is a module-level function or 'module:function'. Each rank sees RANK,
        WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR (node 0),
        MASTER_PORT, GLOO_SOCKET_IFNAME (its node's interface), REPLICATOR_THREADS=1 and
        SIMULATED_CLUSTER_NODE (its namespace). Errors and hangs are reported as
        run_replicas reports them.
        """
        if not self.nodes:
            raise RuntimeError("start the SimulatedCluster (use it as a context manager) before run()")
        placement = _Placement(self.nodes, self.procs_per_node)
        return run_replicas(_on_node, self.world_size, placement, fn, args, timeout_s=timeout_s,
                            env=env, local_world_size=self.procs_per_node)


def run_on_cluster(fn: Callable[..., Any] | str, *args: Any, nodes: int = 2, procs_per_node: int = 2,
                   link_mbit: float = 1000.0, timeout_s: float = 120.0, env: dict[str, str] | None = None,
                   **cluster_options: Any) -> list[Any]:
    """Build a SimulatedCluster, run `fn(*args)` on all its ranks, tear it down; results in rank order."""
    with SimulatedCluster(nodes, procs_per_node, link_mbit, **cluster_options) as cluster:
        return cluster.run(fn, *args, timeout_s=timeout_s, env=env)


@atexit.register
def _close_all() -> None:
    # A test runner that exits on an error in the middle of a `with` still removes the namespaces.
    for cluster in list(_live.values()):
        cluster.close()
