"""What the launcher says when replicas fail: each distinct error once, with its ranks; tracebacks in a log file.

Errors that differ only in the raising replica's own number ("... (replica 0)", "... (replica 1)")
are one error, printed once with every replica named ("... (replicas 0, 1)"). A replica that
failed only because another had failed first (its peer closed the connection, it was stopped)
is said to be so, in one line, instead of repeating a communication library's message.
"""

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
# Where else a message names its own replica ("(replica 1)", "on rank 1"): masked to compare errors.
_SELF_REFERENCE = re.compile(r"\b(replica|rank) (\d+)\b")
_OWN = "\0{}\0"  # the mask: the word it stands for, between NULs (never in a message)
_MASKED = re.compile("\0(replica|rank)\0")
# A C++ library's source position, "[/path/gloo/transport/tcp/pair.cc:553] ": nothing a user can act on.
_SOURCE_POSITION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


@dataclass(frozen=True)
class RankError:
    """What one failed replica recorded: its error ("KeyError: 'x'", maybe several lines) and the line of the
    user's code it came from, when that is not already in the message."""

    message: str
    site: str | None = None
    traceback: str = ""
    time: float | None = None  # when it was raised (seconds since the epoch), if known
    after: tuple[int, ...] = ()  # the ranks whose failure the job's store held before this one failed

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
        after = extra.get("after")
        return RankError(data["message"], extra.get("site"), str(extra.get("py_callstack") or ""),
                         float(when) if isinstance(when, (int, float)) else None,
                         tuple(int(r) for r in after if isinstance(r, int)) if isinstance(after, list) else ())
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
    the others); ranks without a recorded error by exit code; then the ranks that failed or were stopped only
    because another had failed first."""
    summaries = {rank: _masked(errors[rank].summary(), rank) for rank in failures if rank in errors}
    consequences = {rank: errors[rank].after for rank in summaries
                    if _follows(errors[rank].after, _kind(errors[rank]), {r: _kind(errors[r]) for r in summaries})}
    by_error: dict[str, list[int]] = {}
    first_time: dict[str, float] = {}
    for rank in sorted(failures):
        if rank in consequences:
            continue
        error = errors.get(rank)
        key = summaries[rank] if error else \
            f"{_exit(failures[rank])}, no error recorded (see its output above)"
        by_error.setdefault(key, []).append(rank)
        when = error.time if error and error.time is not None else math.inf
        first_time[key] = min(first_time.get(key, math.inf), when)
    timed = sum(when < math.inf for when in first_time.values())
    lines = []
    ordered = sorted(by_error, key=first_time.__getitem__)
    for number, key in enumerate(ordered):
        ranks = by_error[key]
        first, *rest = _unmasked(key, ranks).split("\n")
        label = " (first)" if number == 0 and timed > 1 else ""
        lines.append(f"  {_ranks(ranks)}{label}: {first}")
        lines.extend(f"    {line}" for line in rest)
    # What each follows: the ranks before it that failed of their own accord (else all that failed before it).
    causes_of = {rank: tuple(r for r in after if r not in consequences) or after
                 for rank, after in consequences.items()}
    for cause in sorted(set(causes_of.values())):
        ranks = [rank for rank, of in causes_of.items() if of == cause]
        raised = sorted({_short(errors[rank].message) for rank in ranks})
        then = f"then raised {raised[0]}" if len(raised) == 1 else "each then raised an error of its own"
        lines.append(f"  {_ranks(ranks)}: stopped because {_ranks(list(cause))} failed first ({then}; "
                     "full text in the log)")
    if stopped:
        causes = by_error[ordered[0]] if ordered else sorted(failures)
        lines.append(f"  {_ranks(stopped)}: stopped by the launcher because {_ranks(causes)} failed (it was "
                     "still running)" if causes else f"  {_ranks(stopped)}: stopped by the launcher")
    return lines


def _follows(after: tuple[int, ...], kind: str, kinds: dict[int, str]) -> bool:
    """A failure that only followed others: some failed before it, each with another kind of error. An error of
    the same kind is the same failure met on more replicas (each process's own EnvironmentUnavailable, say),
    however its words differ; a peer's failure shows up as another kind (Gloo's closed connection)."""
    earlier = [rank for rank in after if rank in kinds]
    return bool(earlier) and all(kinds[rank] != kind for rank in earlier)


def _kind(error: RankError) -> str:
    """The error's type, as its message begins ("ValueError: ...")."""
    return error.message.split(":", 1)[0].strip()


def _masked(summary: str, rank: int) -> str:
    """The summary with its own rank's number masked where a message names its replica or rank."""
    return _SELF_REFERENCE.sub(lambda found: _OWN.format(found[1]) if int(found[2]) == rank else found[0], summary)


def _unmasked(key: str, ranks: list[int]) -> str:
    """A masked summary shared by `ranks`, each mask replaced by their numbers: "(replicas 0, 1)"."""
    numbers = ", ".join(map(str, sorted(ranks)))
    return _MASKED.sub(lambda found: f"{found[1]}{'s' if len(ranks) > 1 else ''} {numbers}", key)


def _short(message: str, limit: int = 100) -> str:
    """An error's first sentence, without a C++ source position: what a consequence line quotes."""
    text = _SOURCE_POSITION.sub("", message.split("\n")[0]).strip()
    sentence = text.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= limit else sentence[:limit].rsplit(" ", 1)[0] + " ..."


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
