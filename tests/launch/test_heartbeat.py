"""A replica that goes silent is named by the one waiting for it long before REPLICATOR_TIMEOUT (issue 28, 8d).

Before, the waiting replica said nothing until the collective timeout (300 s by default) and then
only that a rank "never arrived". The verdict here is the waiting replica's message; the test stops
the job as soon as it appears (the timeout is a safety net, never reached when the heartbeat works).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time, torch
    import replicator as rp

    mode, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(2, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx, batch):
        if ctx.step == 2 and ctx.replica_id == 1:
            (folder / "pid").write_text(str(os.getpid()))
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # as a debugger or `kill -STOP` would
            while True:
                time.sleep(1)  # line 17: a step that never ends
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()

    for _ in repl.run(step_fn, [torch.ones(2, 2)] * 6, record=False):
        pass
    """
)


def first_heartbeat_report(tmp_path: Path, mode: str) -> str:
    """The launched job's output up to and including the waiting replica's report; then the job is stopped."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "replicator.cli", "launch", "-n", "2", "--threads", "1",
               "--log-dir", str(tmp_path / "logs"), str(script), mode, str(tmp_path)]
    env = {"REPLICATOR_PROGRESS": "0", "REPLICATOR_DEVICE": "cpu", "REPLICATOR_HEARTBEAT": "2",
           "REPLICATOR_TIMEOUT": "240", "PATH": "/usr/bin:/bin", "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout or []], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 180  # a safety net: the report comes within seconds of the replica going silent
    try:
        while time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert launcher.poll() is None, "".join(seen)
                continue
            if seen[-1].startswith("The wait goes on until REPLICATOR_TIMEOUT"):
                return "".join(seen)
        raise AssertionError("no heartbeat report:\n" + "".join(seen))
    finally:
        pid = tmp_path / "pid"
        if pid.exists():
            os.kill(int(pid.read_text()), signal.SIGKILL)  # the silent replica: the other then fails at once
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()


def test_a_replica_stuck_in_step_fn_is_named_with_its_line(tmp_path: Path) -> None:
    out = first_heartbeat_report(tmp_path, "sleep")
    assert "replicator: replica 0 has waited " in out, out
    assert " s for its peers at the gradient sync of optimizer 0 (SGD), step 2:" in out, out
    assert "  replica 1 is alive but not waiting for its peers: it has been running train.py:17 in step_fn for " \
        in out, out
    assert "the job failed" not in out, "named before the timeout ended the job"


def test_a_stopped_replica_is_named_as_silent(tmp_path: Path) -> None:
    out = first_heartbeat_report(tmp_path, "stop")
    assert "replicator: replica 0 has waited " in out and " s for its peers at " in out, out
    assert "  replica 1 has given no sign of life for " in out, out
    assert "it is stopped (SIGSTOP, a debugger) or frozen in native code" in out, out
    assert "the job failed" not in out, out
