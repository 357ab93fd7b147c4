"""Helpers to test distributed code with real processes: Gloo on 127.0.0.1, or a simulated multi-node cluster."""

from replicator.testing.cluster import SimulatedCluster, cluster_available, run_on_cluster
from replicator.testing.processes import ReplicaFailure, run_replicas

__all__ = ["run_replicas", "ReplicaFailure", "SimulatedCluster", "run_on_cluster", "cluster_available"]
