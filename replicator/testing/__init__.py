"""Helpers to test distributed code with real processes (Gloo on 127.0.0.1)."""

from replicator.testing.processes import ReplicaFailure, run_replicas

__all__ = ["run_replicas", "ReplicaFailure"]
