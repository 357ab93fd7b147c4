"""Fixtures for the multi-process tests: real processes joined by Gloo on 127.0.0.1, never mocks."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

from replicator.testing import run_replicas

# Every run() records itself (runs/<time>-<name> by default): the suite's records go to a temporary root, set
# before any process starts so that the replicas inherit it, never into the repository.
if "REPLICATOR_RUNS" not in os.environ:
    os.environ["REPLICATOR_RUNS"] = tempfile.mkdtemp(prefix="replicator-test-runs-")
    atexit.register(shutil.rmtree, os.environ["REPLICATOR_RUNS"], ignore_errors=True)

# The suite is about CPU processes joined by Gloo: on a GPU machine its in-process replicas compute on CPU too
# (REPLICATOR_DEVICE=cuda pytest ... overrides it). The GPU path has its own check, scripts/gpu_check.sh.
os.environ.setdefault("REPLICATOR_DEVICE", "cpu")


@pytest.fixture
def run_failing_fast() -> Callable[..., Any]:
    """run_replicas for tests that expect the replicas to fail: collectives give up after a few seconds.

    `timeout_s` bounds the whole run; `collective_timeout_s` is the replicas' REPLICATOR_TIMEOUT,
    short so that a hang the library failed to turn into an error ends the test quickly.
    """

    def run(fn: Callable[..., Any], replicas: int, *args: Any, timeout_s: float = 90.0,
            collective_timeout_s: float = 20.0) -> Any:
        return run_replicas(fn, replicas, *args, timeout_s=timeout_s,
                            env={"REPLICATOR_TIMEOUT": f"{collective_timeout_s:g}"})

    return run
