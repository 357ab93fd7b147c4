"""`replicator launch` starts real replicas; `python script.py` runs one without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    import replicator as rp

    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(2, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx, batch):
        optimizer.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        return ctx.all_mean(loss.detach())

    losses = [float(loss) for _, loss in repl.run(step_fn, [torch.ones(4, 2) * (repl.replica_id + 1)] * 3)]
    if "--fail" in sys.argv and repl.replica_id == 1:
        raise SystemExit("replica 1 fails on purpose")
    out = {"replica": repl.replica_id, "replicas": repl.num_replicas, "threads": torch.get_num_threads(),
           "losses": losses, "weight": model.weight.tolist(),
           "heap": [os.environ.get(name) for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")]}
    with open(os.path.join(sys.argv[1], f"out{repl.replica_id}.json"), "w") as handle:
        json.dump(out, handle)
    """
)


def launch(
    tmp_path: Path, *extra: str, replicas: int = 2, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "replicator.cli", "launch", "-n", str(replicas), str(script), str(tmp_path),
               *extra]
    # TMPDIR: a failed launch keeps its log in a temporary directory, here the test's own.
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={"REPLICATOR_PROGRESS": "0",
                          "REPLICATOR_DEVICE": "cpu", "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path),
                          "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"], **(env or {})})


@pytest.fixture(scope="module")
def plain_launch(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One plain 2-replica launch, whose outputs several tests read: each launch costs seconds of start-up."""
    directory = tmp_path_factory.mktemp("plain-launch")
    result = launch(directory)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads((directory / f"out{r}.json").read_text()) for r in range(2)]


def test_launch_runs_replicas_that_agree(plain_launch: list[dict[str, Any]]) -> None:
    outputs = plain_launch
    assert [o["replicas"] for o in outputs] == [2, 2]
    assert outputs[0]["weight"] == outputs[1]["weight"]
    assert outputs[0]["losses"] == outputs[1]["losses"]
    assert all(o["threads"] == max(1, (os.cpu_count() or 1) // 2) for o in outputs), "cores shared evenly"


def test_replicas_keep_their_heap_unless_the_user_set_the_allocator(plain_launch: list[dict[str, Any]],
                                                                    tmp_path: Path) -> None:
    assert [output["heap"] for output in plain_launch] == [[str(1 << 30), str(1 << 30)]] * 2
    result = launch(tmp_path, env={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert [json.loads((tmp_path / f"out{r}.json").read_text())["heap"] for r in range(2)] == [[None, None]] * 2


def test_launch_reports_a_failing_replica(tmp_path: Path) -> None:
    result = launch(tmp_path, "--fail")
    assert result.returncode == 1
    assert "rank 1" in result.stdout and "failed" in result.stdout


def test_plain_python_runs_one_replica(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out0.json").read_text())["replicas"] == 1
