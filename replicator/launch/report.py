"""What the launcher says when replicas fail: each distinct error once, with its ranks; tracebacks in a log file."""

from __future__ import annotations

import logging
import math
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["RankError", "read_error", "failure_lines", "interrupted_line", "LaunchLog"]

# Replicas name themselves in their errors ("(raised on replica 1)"); without that phrase the
# same error raised on every replica reads the same, and is printed once.
_RAISED_ON = re.compile(r"\s*\(raised on replica \d+\)|[,;]? raised on replica \d+")


@dataclass(frozen=True)
class RankError:
    """What one failed replica recorded: its error ("KeyError: 'x'", maybe several lines) and the line of the
    user's code it came from, when that is not already in the message."""

    message: str
    site: str | None = None
    traceback: str = ""
    time: float | None = None  # when it was raised (seconds since the epoch), if known

    def summary(self) -> str:
        """The error as the launcher prints it: the message without the raising replica, then the site."""
        text = _RAISED_ON.sub("", self.message).strip()
        return f"{text} (at {self.site})" if self.site else text


def read_error(error_file_data: Any) -> RankError | None:
    """The error a replica wrote to torchrun's error file (torch's ErrorHandler schema), or None."""
    data = error_file_data.get("message") if isinstance(error_file_data, dict) else None
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        extra = data.get("extraInfo") or {}
        when = extra.get("time")
        return RankError(data["message"], extra.get("site"), str(extra.get("py_callstack") or ""),
                         float(when) if isinstance(when, (int, float)) else None)
    if isinstance(data, str) and data and data != "<NONE>":
        return RankError(data)
    return None


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def failure_lines(failures: dict[int, int], errors: dict[int, RankError], stopped: list[int]) -> list[str]:
    """One entry per distinct error with the ranks that raised it, the first raised first (often the cause of
    the others); ranks without a recorded error by exit code; then the ranks the launcher stopped."""
    by_error: dict[str, list[int]] = {}
    first_time: dict[str, float] = {}
    for rank in sorted(failures):
        error = errors.get(rank)
        key = error.summary() if error else f"{_exit(failures[rank])}, no error recorded (see its output above)"
        by_error.setdefault(key, []).append(rank)
        when = error.time if error and error.time is not None else math.inf
        first_time[key] = min(first_time.get(key, math.inf), when)
    timed = sum(when < math.inf for when in first_time.values())
    lines = []
    for number, text in enumerate(sorted(by_error, key=first_time.__getitem__)):
        first, *rest = text.split("\n")
        label = " (first)" if number == 0 and timed > 1 else ""
        lines.append(f"  {_ranks(by_error[text])}{label}: {first}")
        lines.extend(f"    {line}" for line in rest)
    if stopped:
        lines.append(f"  {_ranks(stopped)}: stopped by the launcher (still running when the job failed)")
    return lines


def interrupted_line(stopped: list[int]) -> str:
    """What the launcher says after Ctrl-C (or SIGTERM): which replicas it stopped."""
    return "replicator: interrupted; " + (f"stopped {_ranks(stopped)}" if stopped else "no replica was running")


class LaunchLog:
    """The launch's log file: torchrun's own messages and every failed replica's full traceback.

    Lives in `directory`, or in a fresh temporary directory that is removed again when every
    attempt succeeded. torchrun keeps its per-replica error files under the same directory.
    """

    def __init__(self, directory: str | None = None) -> None:
        self._temporary = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="replicator-launch-") if directory is None else directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "launch.log"
        self.failed = False
        self._handler = logging.FileHandler(self.path, encoding="utf-8", delay=True)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        self._logger = logging.getLogger("replicator.launch")
        # torchrun's agent logs every failure and every stop to stderr (through torch's own
        # handler on this logger): the summary says it once, so its lines go to the file.
        self._torch = logging.getLogger("torch.distributed")
        self._torch_handlers: list[logging.Handler] = []

    def __enter__(self) -> LaunchLog:
        self._torch_handlers = list(self._torch.handlers)
        for handler in self._torch_handlers:
            self._torch.removeHandler(handler)
        self._torch.addHandler(self._handler)
        self._logger.addHandler(self._handler)
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._torch.removeHandler(self._handler)
        for handler in self._torch_handlers:
            self._torch.addHandler(handler)
        self._logger.removeHandler(self._handler)
        self._logger.propagate = True
        self._handler.close()
        if self._temporary and not self.failed:
            shutil.rmtree(self.directory, ignore_errors=True)

    def record(self, attempt: int, rank: int, exit_code: int, error: RankError | None) -> None:
        """Keep one failed replica's traceback (or what is known of its end) in the file."""
        self.failed = True
        body = (error.traceback or error.message) if error else "no error recorded (see its output)"
        self._logger.error("attempt %d, rank %d (%s):\n%s", attempt, rank, _exit(exit_code), body.rstrip())
