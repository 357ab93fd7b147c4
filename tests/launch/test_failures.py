"""What `replicator launch` prints when replicas fail or it is interrupted: each error once, no traceback walls."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import pathlib, sys, time, torch
    import replicator as rp

    mode, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    repl = rp.Replicator()

    def step_fn(ctx, batch):
        if mode == "mismatch" and ctx.replica_id == 1:
            ctx.all_sum(batch)  # a collective only replica 1 calls
        return ctx.all_mean(batch.sum())

    for _ in repl.run(step_fn, [torch.ones(2, 2)] * 2):
        pass
    if mode == "one" and repl.replica_id == 1:
        raise ValueError("a bad value on purpose")
    (folder / f"ready{repl.replica_id}").touch()
    time.sleep(120)  # outside any collective: only the launcher can stop it
    """
)


def start(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "replicator.cli", "launch", "-n", "2", "--threads", "1",
               "--log-dir", str(tmp_path / "logs"), str(script), mode, str(tmp_path)]
    env = {"REPLICATOR_PROGRESS": "0", "REPLICATOR_DEVICE": "cpu", "REPLICATOR_TIMEOUT": "30", "PATH": "/usr/bin:/bin",
           "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]}
    if "PYTHONPATH" in os.environ:  # a checkout put first on the path reaches the replicas too
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(launcher: subprocess.Popen, timeout_s: float = 120.0) -> tuple[int, str, str]:
    try:
        out, err = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        launcher.terminate()  # torchrun's agent then stops its workers
        out, err = launcher.communicate(timeout=60)
        raise AssertionError(f"the launcher hung:\n{out}\n{err}") from None
    return launcher.returncode, out, err


def test_the_same_error_on_every_replica_is_printed_once_and_tracebacks_go_to_a_log(tmp_path: Path) -> None:
    code, out, err = finish(start(tmp_path, "mismatch"))
    assert code == 1, out + err
    everything = out + err
    # Before: a traceback per rank, each line prefixed with [rankN], then torchrun's log lines.
    assert "Traceback" not in everything and "[rank" not in everything, everything
    assert "torch/distributed/elastic" not in everything, everything
    assert "ranks 0, 1: ReplicaMismatchError: replicas diverged: they reached different collectives" in out, out
    assert "train.py:10 in step_fn" in out, "the merged message still names the call sites"
    assert len(everything.strip().splitlines()) <= 8, everything
    log = Path(re.search(r"tracebacks and torchrun's messages are in (\S+)", out).group(1))
    assert log.parent == tmp_path / "logs"
    kept = log.read_text()
    assert kept.count("Traceback (most recent call last)") == 2
    # (a replica that recorded its error may still be stopped while it exits: its error counts)
    assert "attempt 0, rank 0 (" in kept and "attempt 0, rank 1 (" in kept
    assert "failed (exitcode: " in kept, "torchrun's own lines are kept in the log"
    assert 'File "' + str(tmp_path / "train.py") + '", line 10, in step_fn' in kept
    assert "runpy" not in kept, "the worker entry's frames are not the user's"


def test_one_failing_replica_is_named_with_its_line_and_the_survivor_is_stopped_not_failed(tmp_path: Path) -> None:
    code, out, err = finish(start(tmp_path, "one"))
    assert code == 1, out + err
    assert "rank 1: ValueError: a bad value on purpose (at train.py:16 in <module>)" in out, out
    assert "rank 0: stopped by the launcher because rank 1 failed (it was still running)" in out, out
    assert "rank 0: exit code" not in out and "signal" not in out, out
    assert "Traceback" not in out + err


def test_ctrl_c_says_which_replicas_it_stopped(tmp_path: Path) -> None:
    launcher = start(tmp_path, "sleep")
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.2)
    launcher.send_signal(signal.SIGINT)
    code, out, err = finish(launcher, timeout_s=60)
    assert code == 130, out + err
    assert "replicator: interrupted; stopped ranks 0, 1" in out, out
    assert "0 replica process(es) failed" not in out
    assert "KeyboardInterrupt" not in out + err and "Traceback" not in out + err, out + err


PLAIN_TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import time, torch
    import replicator as rp

    repl = rp.Replicator()
    if repl.replica_id == 1:
        raise ValueError("replica 1 fails while replica 0 computes")
    time.sleep(6)  # computing, outside any collective, longer than the goodbye waits for it
    repl.context.all_sum(torch.ones(1))
    """
)


def test_a_replica_failing_under_plain_torchrun_leaves_at_once(tmp_path: Path) -> None:
    """Without `replicator launch`'s worker, a failing replica used to wait at exit for its peers (and they
    for it, at their next collective) until REPLICATOR_TIMEOUT; now it leaves, and torchrun stops the rest."""
    script = tmp_path / "train.py"
    script.write_text(PLAIN_TORCHRUN_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    # Collectives would give up after 600 s, finish() after 120: a job that waited for the timeout to end fails as
    # "the launcher hung", whatever the machine's load. No clock decides.
    env = {"REPLICATOR_PROGRESS": "0", "REPLICATOR_DEVICE": "cpu", "REPLICATOR_TIMEOUT": "600",
           "REPLICATOR_THREADS": "1", "PATH": "/usr/bin:/bin", "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]}
    torchrun = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    code, out, err = finish(torchrun)
    assert code != 0 and "replica 1 fails while replica 0 computes" in err, out + err
