"""Synchronous data parallelism: the gradient synchronizer and its reducers."""

from replicator.sync.bucket import Reducer
from replicator.sync.reducers import FlatReducer, make_reducer
from replicator.sync.synchronizer import GradientSynchronizer

__all__ = ["GradientSynchronizer", "Reducer", "FlatReducer", "make_reducer"]
