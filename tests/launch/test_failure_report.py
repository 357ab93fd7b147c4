"""The launcher's failure report: one line per failure, each replica described truthfully (issue 28, item 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from replicator.launch.report import RankError, failure_lines

SCRIPT = textwrap.dedent(
    """
    import pathlib, sys, torch
    import replicator as rp

    mode, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    repl = rp.Replicator()
    if mode == "outside":
        repl.wrap_optimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))  # outside repl.scope()
    with repl.scope():
        model = torch.nn.Linear(2, 1)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx, batch):
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()

    (folder / "blocker").write_text("a file where replica 0 makes the checkpoint's directory")
    for _ in repl.run(step_fn, [torch.ones(2, 2)] * 4, checkpoint_every=2, checkpoint_dir=folder / "blocker" / "ck"):
        pass
    """
)


def launch(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "replicator.cli", "launch", "-n", "2", "--threads", "1",
               "--log-dir", str(tmp_path / "logs"), str(script), mode, str(tmp_path)]
    env = {"REPLICATOR_PROGRESS": "0", "REPLICATOR_DEVICE": "cpu", "REPLICATOR_TIMEOUT": "60", "PATH": "/usr/bin:/bin",
           "REPLICATOR_RUNS": os.environ["REPLICATOR_RUNS"]}
    if "PYTHONPATH" in os.environ:  # a checkout put first on the path reaches the replicas too
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)  # a safety net only
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done.stdout


def test_errors_that_differ_only_by_the_replica_number_are_one_line_naming_both(tmp_path: Path) -> None:
    out = launch(tmp_path, "outside")
    assert "ranks 0, 1: ReplicatorUsageError: wrap_optimizer() was called outside repl.scope() (replicas 0, 1);" \
        in out, out
    assert out.count("outside repl.scope()") == 1, out


def test_an_error_in_replica_0s_save_is_printed_once_and_replica_1_is_said_to_have_followed_it(
        tmp_path: Path) -> None:
    out = launch(tmp_path, "save")
    assert out.count("NotADirectoryError") == 1, out
    assert "rank 0: NotADirectoryError: [Errno 20] Not a directory" in out, out
    # Replica 1 waited for replica 0 inside the save: it either fails when replica 0's connections close,
    # or the launcher stops it first; either way it is said to follow replica 0.
    assert ("rank 1: stopped because rank 0 failed first (then raised " in out
            or "rank 1: stopped by the launcher because rank 0 failed (it was still running)" in out), out
    assert "pair.cc" not in out and "GLHF" not in out, "a communication library's message is quoted only in short"


def error(message: str, time: float, after: tuple[int, ...] = ()) -> RankError:
    return RankError(message, time=time, after=after)


def test_a_failure_is_only_said_to_follow_another_when_its_error_differs() -> None:
    same = failure_lines({0: 1, 1: 1}, {0: error("ValueError: bad batch", 1.0),
                                        1: error("ValueError: bad batch", 2.0, after=(0,))}, [])
    assert same == ["  ranks 0, 1: ValueError: bad batch"], "the same error on both is one failure"
    chain = failure_lines({0: 1, 1: 1, 2: 1}, {
        0: error("KeyError: 'x'", 1.0),
        1: error("RuntimeError: [/src/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:41. GLHF", 2.0,
                 after=(0,)),
        2: error("ReplicatorError: rank(s) [1] sent nothing for 5 s", 3.0, after=(0, 1)),
    }, [3])
    assert chain == [
        "  rank 0: KeyError: 'x'",
        "  ranks 1, 2: stopped because rank 0 failed first (each then raised an error of its own; full text in the "
        "log)",
        "  rank 3: stopped by the launcher because rank 0 failed (it was still running)",
    ]
    one = failure_lines({0: 1, 1: 1}, {0: error("KeyError: 'x'", 1.0), 1: error(
        "RuntimeError: [/src/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:41. GLHF", 2.0, after=(0,))}, [])
    assert one[1] == ("  rank 1: stopped because rank 0 failed first (then raised RuntimeError: Connection closed by "
                      "peer [127.0.0.1]:41; full text in the log)")
