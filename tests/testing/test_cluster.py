"""Simulated cluster: 2 namespaces × 2 processes find their topology, hierarchical equals flat, the link limit
is real, cleanup is total."""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from replicator.comm.local_link import LocalLink
from replicator.sync.reducers import make_reducer
from replicator.testing import ReplicaFailure
from replicator.testing.cluster import PREFIX, SimulatedCluster, cluster_available, remove_stale
from replicator.topology import build_process_groups, discover

from _numerics import assert_within, bound

available, reason = cluster_available()
needs_cluster = pytest.mark.skipif(not available, reason=f"simulated cluster unavailable: {reason}")

LINK_MBIT = 200.0  # slow enough that a few MiB take a measurable time, fast enough to keep the test short
TRANSFER_BYTES = 4 << 20
REPEATS = 3
ODD_LENGTH = 100_003  # divides by neither 2 nor 4: the hierarchical reducer must pad


def _point_to_point(peer_of_rank0: int) -> float | None:
    """Seconds for rank 0 to push TRANSFER_BYTES to `peer_of_rank0` and hear back (None on other ranks)."""
    rank = dist.get_rank()
    payload = torch.zeros(TRANSFER_BYTES // 4)
    ack = torch.zeros(1)
    dist.barrier()
    if rank == 0:
        start = time.perf_counter()
        dist.send(payload, dst=peer_of_rank0)
        dist.recv(ack, src=peer_of_rank0)
        return time.perf_counter() - start
    if rank == peer_of_rank0:
        dist.recv(payload, src=0)
        dist.send(ack, dst=0)
    return None


def _shaped_bytes_sent(node: int) -> int:
    """Bytes the node's rate-limited link has sent so far: the tbf qdisc's own counter (`tc -s qdisc`)."""
    stats = subprocess.run(["tc", "-s", "qdisc", "show", "dev", f"veth{node}"], capture_output=True, text=True,
                           check=True).stdout
    match = re.search(r"Sent (\d+) bytes", stats)
    assert match is not None, stats
    return int(match.group(1))


def _on_cluster() -> dict[str, Any]:
    topology = discover()
    groups = build_process_groups(topology)
    rank = topology.rank
    out: dict[str, Any] = {
        "topology": (topology.rank, topology.world_size, topology.node_rank, topology.num_nodes,
                     topology.local_rank, topology.local_world_size),
        "namespace": os.environ["SIMULATED_CLUSTER_NODE"],
        "intra_members": dist.get_process_group_ranks(groups.intra_node),
    }

    # Integers sum exactly in fp32 whatever the order, so hierarchical must equal flat bit for bit.
    generator = torch.Generator().manual_seed(rank)
    integers = torch.randint(-1000, 1000, (ODD_LENGTH,), generator=generator).float()
    floats = torch.randn(ODD_LENGTH, generator=generator)
    results = {}
    for spec in ("flat", "hierarchical", "auto"):
        reducer = make_reducer(spec, groups)
        buffers = [integers.clone(), floats.clone()]
        for pending in [reducer.reduce(b, groups.replica) for b in buffers]:
            pending.wait()
        summation = getattr(reducer, "summation", None)
        # Who shares this process's /dev/shm rows: must be its own namespace's processes only.
        sharing = dist.get_process_group_ranks(summation.group) if hasattr(summation, "path_prefix") else None
        results[spec] = (reducer.name, buffers, sharing)
        getattr(reducer, "close", lambda: None)()
    out["sums"] = results
    # Abstract Unix sockets belong to a network namespace: a link forms inside a node, never across.
    across, inside = LocalLink.connect(groups.control, 30), LocalLink.connect(groups.intra_node, 30)
    out["links"] = (across is None, inside is not None)
    if inside is not None:
        inside.close()

    for peer in (2, 1):  # warm both connections before timing anything
        dist.barrier()
        if rank in (0, peer):
            other = peer if rank == 0 else 0
            (dist.send if rank == 0 else dist.recv)(torch.zeros(16), other)
    # Rank 0 counts what crossed its node's shaper during each kind of transfer: counters, not durations.
    shaped = [_shaped_bytes_sent(topology.node_rank)] if rank == 0 else []
    out["inter"] = [_point_to_point(2) for _ in range(REPEATS)]
    shaped += [_shaped_bytes_sent(topology.node_rank)] if rank == 0 else []
    out["intra"] = [_point_to_point(1) for _ in range(REPEATS)]
    shaped += [_shaped_bytes_sent(topology.node_rank)] if rank == 0 else []
    out["shaped_bytes"] = [after - before for before, after in zip(shaped, shaped[1:])]
    return out


def _fails_on_rank_one() -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("deliberate failure on rank 1")


def _namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _mine() -> list[str]:
    return [name for name in _namespaces() if name.startswith(f"{PREFIX}-{os.getpid()}-")]


@pytest.fixture(scope="module")
def cluster_results() -> tuple[list[dict[str, Any]], SimulatedCluster]:
    with SimulatedCluster(nodes=2, procs_per_node=2, link_mbit=LINK_MBIT) as cluster:
        results = cluster.run(_on_cluster, timeout_s=120)
    return results, cluster


@needs_cluster
def test_every_rank_finds_its_node(cluster_results: tuple[list[dict[str, Any]], SimulatedCluster]) -> None:
    results, _ = cluster_results
    for rank, result in enumerate(results):
        node, local = divmod(rank, 2)
        assert result["topology"] == (rank, 4, node, 2, local, 2), f"rank {rank}: {result['topology']}"
        assert result["namespace"].endswith(f"-n{node}"), f"rank {rank} runs in {result['namespace']}"
        assert result["intra_members"] == [2 * node, 2 * node + 1]
    assert results[0]["namespace"] != results[2]["namespace"]


@needs_cluster
def test_local_links_form_inside_a_node_only(cluster_results: tuple[list[dict[str, Any]], SimulatedCluster]) -> None:
    results, _ = cluster_results
    assert [result["links"] for result in results] == [(True, True)] * 4


@needs_cluster
def test_hierarchical_equals_flat_on_the_cluster(
    cluster_results: tuple[list[dict[str, Any]], SimulatedCluster]
) -> None:
    results, _ = cluster_results
    assert results[0]["sums"]["hierarchical"][0] == "hierarchical:2x2"
    # The nodes share /dev/shm, but "auto" must read the topology: two nodes, so shared memory only inside each.
    assert results[0]["sums"]["auto"][0] == "hierarchical:2x2"
    for rank, result in enumerate(results):
        for spec in ("hierarchical", "auto"):
            assert result["sums"][spec][2] == result["intra_members"], (
                f"rank {rank}: {spec} shares memory beyond its node"
            )
    expected_integers = sum(
        torch.randint(-1000, 1000, (ODD_LENGTH,), generator=torch.Generator().manual_seed(r)).float() for r in range(4)
    )
    # Floats: the same four terms added in another order, so fp32 round-off of their sum of |terms| only.
    float_terms = []
    for r in range(4):
        generator = torch.Generator().manual_seed(r)
        torch.randint(-1000, 1000, (ODD_LENGTH,), generator=generator)  # drawn first, as on the ranks
        float_terms.append(torch.randn(ODD_LENGTH, generator=generator).abs())
    float_tolerance = bound(torch.float32, sum(float_terms), 4)
    for rank, result in enumerate(results):
        _, (flat_integers, flat_floats), _ = result["sums"]["flat"]
        _, (hier_integers, hier_floats), _ = result["sums"]["hierarchical"]
        assert torch.equal(flat_integers, expected_integers), f"rank {rank}: flat sum is wrong"
        assert torch.equal(hier_integers, flat_integers), f"rank {rank}: hierarchical differs from flat on integers"
        assert torch.equal(result["sums"]["auto"][1][0], flat_integers), (
            f"rank {rank}: auto differs from flat on integers"
        )
        assert_within(hier_floats, flat_floats, float_tolerance, f"rank {rank}: hierarchical vs flat")
        assert torch.equal(hier_floats, results[0]["sums"]["hierarchical"][1][1]), f"rank {rank} disagrees with rank 0"


@needs_cluster
def test_the_link_limit_is_real(cluster_results: tuple[list[dict[str, Any]], SimulatedCluster]) -> None:
    results, cluster = cluster_results
    at_line_rate = TRANSFER_BYTES / cluster.link_bytes_per_s
    inter = min(results[0]["inter"])
    # Even the fastest repeat cannot beat the rate (the burst lets at most 64 KiB through early): a lower bound on a
    # duration, which a loaded machine only lengthens, so load cannot change this verdict.
    assert inter >= 0.7 * at_line_rate, (
        f"{TRANSFER_BYTES} B crossed nodes in {inter:.3f} s, faster than {LINK_MBIT} Mbit/s allows"
    )
    # The rest by the shaper's own byte counter, not by durations: every inter-node payload went through it, and
    # about once (a crawling, dropping shaper would resend much of it) ...
    inter_bytes, intra_bytes = results[0]["shaped_bytes"]
    payload = REPEATS * TRANSFER_BYTES
    assert payload <= inter_bytes <= 1.5 * payload, f"{inter_bytes} B through the shaper for {payload} B sent"
    # ... and inside a node the kernel delivers over loopback: none of that payload crossed it (a few barriers do).
    assert intra_bytes < TRANSFER_BYTES // 4, f"{intra_bytes} B of intra-node traffic went through the shaper"


@needs_cluster
def test_namespaces_are_removed_even_when_the_function_raises() -> None:
    dead = f"{PREFIX}-99999999-1-n0"  # no process has pid 99999999: a leftover of a killed run
    subprocess.run(["ip", "netns", "add", dead], check=True)
    cluster = SimulatedCluster(nodes=2, procs_per_node=2, link_mbit=LINK_MBIT)
    with pytest.raises(ReplicaFailure, match="deliberate failure on rank 1"):
        with cluster:
            assert dead not in _namespaces(), "a dead run's namespace survived start()"
            assert len(_mine()) == 3  # the switch and two nodes
            cluster.run(_fails_on_rank_one, timeout_s=60)
    assert _mine() == [], f"namespaces left behind: {_mine()}"
    assert remove_stale() == []


def test_unavailability_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    import replicator.testing.cluster as cluster

    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert cluster_available() == (False, "a simulated cluster needs root (network namespaces, veth pairs, tc)")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert cluster_available() == (False, "a simulated cluster needs the `tc` command (iproute2)")
    with pytest.raises(RuntimeError, match="needs the `tc` command"):
        SimulatedCluster().start()
