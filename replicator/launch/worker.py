"""Each replica process under `replicator launch`: the user's script, its error kept for the launcher (internal).

torchrun starts `python -m replicator.launch.worker [-m] TARGET ARGS...` instead of the
target itself. The target runs as `python TARGET` (or `python -m TARGET`) would run it; if it
raises, the error goes into torchrun's error file (TORCHELASTIC_ERROR_FILE, in the schema of
torch.distributed.elastic's ErrorHandler) rather than onto the terminal, and the launcher
prints one summary for every replica, keeping the tracebacks in its log file.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import sysconfig
import time
import traceback
from datetime import timedelta
from types import TracebackType

from replicator.errors import ReplicatorError

__all__: list[str] = []

# torchrun sets this for every worker it starts; the launcher reads the file back.
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"

# Frames in these directories are library code: the site of an error is the innermost frame
# outside them, the line of the user's script that led to it.
_LIBRARY_DIRS = tuple(
    os.path.join(directory, "")
    for directory in {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    | {os.path.abspath(sysconfig.get_paths()[name]) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the target's own first frame on: without this module's and runpy's frames."""
    here = os.path.abspath(__file__)
    while tb is not None and (os.path.abspath(tb.tb_frame.f_code.co_filename) == here
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    return tb


def _site(error: BaseException, tb: TracebackType | None) -> str | None:
    """`file:line in function` of the innermost frame in the user's code; None for replicator's own
    errors, whose messages already name the call sites that matter."""
    if isinstance(error, ReplicatorError):
        return None
    site = None
    for frame in traceback.extract_tb(tb):
        if not os.path.abspath(frame.filename).startswith(_LIBRARY_DIRS):
            site = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return site


_FAILURES_KEY = "replicator/failures"  # in the job's store: how many processes have failed, and which


def _note_failure() -> list[int]:
    """Note in the job's store that this process failed; return the ranks noted there before it.

    The store lives in the launcher (torchrun's agent), so it outlives any replica. A replica
    whose peer failed first then fails too (the peer closed its connections), with an error of
    the communication library's: the order noted here lets the launcher say which failure came
    first and that the later one only followed it. Bounded: a store that does not answer within
    seconds is left alone.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        from replicator.comm.store import job_store

        store = job_store()
        store.set_timeout(timedelta(seconds=5))
        number = store.add(_FAILURES_KEY, 1)
        store.set(f"{_FAILURES_KEY}/{number}", str(dist.get_rank()))
        return [int(store.get(f"{_FAILURES_KEY}/{earlier}")) for earlier in range(1, number)]
    except Exception:  # the store's host is gone too: the launcher orders failures by time alone
        return []


def _record(message: str, callstack: str, site: str | None, after: list[int] | None = None) -> bool:
    """Write the error file torchrun's agent reads; False when there is none to write."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        return False
    now = time.time()
    # "timestamp" is torch's (whole seconds); "time" orders failures within a second for the summary.
    extra: dict[str, str | float | list[int]] = {"py_callstack": callstack, "timestamp": str(int(now)), "time": now}
    if after:
        extra["after"] = after
    if site:
        extra["site"] = site
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump({"message": {"message": message, "extraInfo": extra}}, file)
    except OSError:
        return False
    return True


def _leave() -> None:
    """Leave the job at once, as a failing replica must (replicator.job.leave_after_failure: the one exit path)."""
    from replicator.job import leave_after_failure

    leave_after_failure()


def run(argv: list[str]) -> None:
    """Run `[-m] TARGET ARGS...` as python would, as `__main__`, with `sys.argv` = `[TARGET, *ARGS]`."""
    module = bool(argv) and argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # `python script.py` puts the script's directory first on the path, not the cwd.
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except KeyboardInterrupt:
        # The launcher stopped this replica (Ctrl-C): its summary says so, once for all of them.
        _leave()
        sys.exit(130)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            _leave()
        if isinstance(stop.code, str) and _record(stop.code, "", None):
            sys.exit(1)
        raise
    except BaseException as error:  # everything else the target raises is reported, then exits 1
        tb = _user_frames(error.__traceback__)
        callstack = "".join(traceback.format_exception(type(error), error, tb))
        after = _note_failure()  # before leaving: the peers' own failures follow from this one's departure
        recorded = _record(f"{type(error).__name__}: {error}", callstack, _site(error, tb), after)
        _leave()
        if not recorded:
            raise
        sys.exit(1)


if __name__ == "__main__":
    run(sys.argv[1:])
