"""Every `REPLICATOR_*` environment variable, read in one place (internal)."""

from __future__ import annotations

import os

__all__: list[str] = []

# Long enough for a slow first step on a loaded machine, short enough that a stuck run ends
# with an error rather than hanging a job for torch's default half hour.
DEFAULT_TIMEOUT_S = 300.0
# Under Slurm, nohup or CI a line every 30 s shows a job is alive without flooding its log.
DEFAULT_PROGRESS_EVERY_S = 30.0

TIMEOUT = "REPLICATOR_TIMEOUT"  # seconds a collective may wait before it raises
DEBUG = "REPLICATOR_DEBUG"  # 1: fingerprint every collective and keep a trail of call sites
THREADS = "REPLICATOR_THREADS"  # torch threads per process, set by the launcher
PROGRESS = "REPLICATOR_PROGRESS"  # 0: no progress bar or breakdown table
PROGRESS_EVERY = "REPLICATOR_PROGRESS_EVERY"  # stdout not a terminal: a progress line every N steps or "Ns"
LOCAL_LINK = "REPLICATOR_LOCAL_LINK"  # 0: keep every message on the group's backend
PEER_LINK = "REPLICATOR_PEER_LINK"  # 0: peers exchange frames over Gloo point-to-point, not sockets
PS_SHARED_MEMORY = "REPLICATOR_PS_SHARED_MEMORY"  # 0: same-node parameter-server payloads stay on the socket
ATTEMPT = "REPLICATOR_ATTEMPT"  # which restart of the job this is, set by the launcher
MAX_RESTARTS = "REPLICATOR_MAX_RESTARTS"  # the launcher's --max-restarts, for the job to read
RUNS = "REPLICATOR_RUNS"  # where run() records its runs (default "runs"); 0 records none
TIMELINE = "REPLICATOR_TIMELINE"  # 1: every run() writes timeline-<time>.json; a path: there; 0: none
DEVICE = "REPLICATOR_DEVICE"  # cpu or cuda: where replicas compute (default: cuda when a GPU is visible)
BACKEND = "REPLICATOR_BACKEND"  # gloo or nccl: the collectives' backend (default: nccl on cuda, else gloo)
HEARTBEAT = "REPLICATOR_HEARTBEAT"  # seconds a wait for peers lasts before the waiting replica names them; 0: never
# A peer that is stuck is named after 30 s, ten times sooner than the default timeout ends the wait.
DEFAULT_HEARTBEAT_S = 30.0

_TRUE = ("1", "true", "yes", "on")
# The root of run records, relative to the working directory, as TensorBoard's and Lightning's are.
DEFAULT_RUNS = "runs"


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "")
    return default if value == "" else value.lower() in _TRUE


def _number(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        return float(value)
    except ValueError as error:
        raise ValueError(f"environment variable {name}={value!r} is not a number") from error


def timeout_s() -> float:
    """Seconds a collective may wait (REPLICATOR_TIMEOUT, default 300)."""
    return _number(TIMEOUT, DEFAULT_TIMEOUT_S)


def heartbeat_s(timeout_s: float) -> float:
    """Seconds a wait for peers lasts before the waiting replica names them (REPLICATOR_HEARTBEAT; 0: never).

    By default 30 s, or a third of a shorter collective timeout, so that it comes before the timeout."""
    value = _number(HEARTBEAT, -1.0)
    if value < 0:
        return min(DEFAULT_HEARTBEAT_S, timeout_s / 3)
    return value


def debug() -> bool:
    """REPLICATOR_DEBUG=1: fingerprint every collective and keep a trail of call sites."""
    return _flag(DEBUG, False)


def threads() -> int | None:
    """Torch threads per process that the launcher chose (REPLICATOR_THREADS), if any."""
    value = os.environ.get(THREADS, "")
    try:
        return int(value) if value else None
    except ValueError as error:
        raise ValueError(f"environment variable {THREADS}={value!r} is not a whole number of threads") from error


def progress() -> bool:
    """REPLICATOR_PROGRESS=0 silences the progress bar and the breakdown table."""
    return os.environ.get(PROGRESS, "1") != "0"


def progress_every() -> tuple[int | None, float | None]:
    """(steps, seconds) between progress lines when stdout is not a terminal (REPLICATOR_PROGRESS_EVERY):
    "100" means every 100 steps, "30s" every 30 seconds (the default)."""
    value = os.environ.get(PROGRESS_EVERY, "").strip().lower() or f"{DEFAULT_PROGRESS_EVERY_S:g}s"
    try:
        if value.endswith("s"):
            seconds = float(value[:-1])
            if seconds > 0:
                return None, seconds
        elif int(value) > 0:
            return int(value), None
    except ValueError:
        pass
    raise ValueError(
        f"environment variable {PROGRESS_EVERY}={value!r} is neither a number of steps (\"100\") nor of seconds "
        "(\"30s\"); both must be positive"
    )


def local_link() -> bool:
    """REPLICATOR_LOCAL_LINK=0 keeps every message on the group's backend."""
    return os.environ.get(LOCAL_LINK, "1") != "0"


def peer_link() -> bool:
    """REPLICATOR_PEER_LINK=0 carries the peer link's frames over Gloo instead of sockets."""
    return os.environ.get(PEER_LINK, "1") != "0"


def ps_shared_memory() -> bool:
    """REPLICATOR_PS_SHARED_MEMORY=0 keeps a same-node parameter server's payloads on the socket."""
    return os.environ.get(PS_SHARED_MEMORY, "1") != "0"


def attempt() -> int:
    """Which restart of the job this process belongs to: 0 on the first attempt."""
    return int(os.environ.get(ATTEMPT) or 0) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def runs_root() -> str | None:
    """Where run() records runs by default: REPLICATOR_RUNS (default "runs"); None when it is 0, off or false."""
    value = os.environ.get(RUNS, "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        return None
    return value or DEFAULT_RUNS


def timeline() -> bool | str:
    """REPLICATOR_TIMELINE: True ("1", "true", ...), False (unset, "0", "false", ...) or the path of the trace."""
    value = os.environ.get(TIMELINE, "").strip()
    if value.lower() in ("", "0", "false", "no", "off"):
        return False
    return True if value.lower() in _TRUE else value


def _choice(name: str, choices: tuple[str, ...]) -> str | None:
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return None
    if value not in choices:
        raise ValueError(f"environment variable {name}={value!r} is not one of {', '.join(choices)}; unset it "
                         "for the default")
    return value


def device() -> str | None:
    """REPLICATOR_DEVICE: "cpu" or "cuda" where replicas compute; None picks cuda when a GPU is visible."""
    return _choice(DEVICE, ("cpu", "cuda"))


def backend() -> str | None:
    """REPLICATOR_BACKEND: "gloo" or "nccl"; None picks nccl for CUDA replicas and gloo otherwise."""
    return _choice(BACKEND, ("gloo", "nccl"))
