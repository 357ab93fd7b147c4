"""checkpoint.Layout read off the job's Mesh: the replica and stage a process saves and restores as."""

from __future__ import annotations

from replicator.checkpoint import Layout
from replicator.topology import Mesh


def test_a_layout_of_a_mesh_names_the_same_replica_and_stage() -> None:
    # 4 replicas x 2 stages, replica-major: rank 5 is stage 1 of replica 2.
    assert Layout.of(Mesh(rank=5, world_size=8, stages=2)) == Layout(2, 4, 1, 2)
    assert Layout.of(Mesh(rank=5, world_size=8, stages=2)).tag == "r2s1"
    assert Layout.of(Mesh()) == Layout()
