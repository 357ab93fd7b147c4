"""A wrong `--master` fails at once or says that it waits for node 0, and ends with an error that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from replicator.launch import free_port


def launch_node_1(tmp_path: Path, master: str, *extra: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text("import replicator as rp\nrp.Replicator()\n")
    command = [sys.executable, "-m", "replicator.cli", "launch", "--nnodes", "2", "--node-rank", "1",
               "--master", master, *extra, str(script)]
    # Before: torch's store retried the name, or the address, until its rendezvous gave up (600 s); that now ends in
    # subprocess.TimeoutExpired after 60 s, a failure, whatever the machine's load. No clock in the verdicts.
    return subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env={"REPLICATOR_PROGRESS": "0", "REPLICATOR_DEVICE": "cpu", "PATH": "/usr/bin:/bin",
                               "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]})


def test_a_master_that_does_not_resolve_fails_at_once(tmp_path: Path) -> None:
    result = launch_node_1(tmp_path, "no-such-host.invalid:29400")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--master no-such-host.invalid:29400: the host name 'no-such-host.invalid' does not resolve" in result.stderr
    assert "node 0's host name or IP address" in result.stderr


def test_a_node_waits_for_node_0_aloud_and_gives_up_with_advice(tmp_path: Path) -> None:
    port = free_port()  # nobody listens there
    result = launch_node_1(tmp_path, f"127.0.0.1:{port}", "--master-timeout", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"replicator: waiting for node 0 at 127.0.0.1:{port} (0 s)" in result.stdout
    assert f"node 0 did not answer at 127.0.0.1:{port} within 2 s (this is node 1" in result.stderr
    assert "--master-timeout" in result.stderr and "Start node 0" in result.stderr
