"""A checkpoint's directory: naming by step, the job file written last, the atomic commit, pruning."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from replicator.checkpoint.errors import CheckpointError
from replicator.errors import ReplicatorUsageError

__all__ = ["step_path", "latest", "prune", "read_info", "read_json"]

FORMAT = 2  # 2: values are replicator.codec's tagged JSON (1: tags of its own, still read)
JOB_FILE = "replicator.json"  # written last, by rank 0: a directory without it is not a checkpoint
PARTIAL_SUFFIX = ".partial"
STEP_NAME = re.compile(r"^step_(\d+)$")


def step_path(directory: str | os.PathLike[str], step: int) -> Path:
    """The checkpoint path for `step` inside `directory` (zero-padded, so names sort by step)."""
    return Path(directory) / f"step_{step:09d}"


def committed(path: Path) -> bool:
    """True when `path` is a checkpoint whose write finished (its job file exists)."""
    return path.is_dir() and (path / JOB_FILE).is_file()


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in `directory` (partial writes are ignored), or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_NAME.match(p.name)) and committed(p)]
    return max(found)[1] if found else None


def prune(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and any abandoned partial ones."""
    if keep < 1:
        raise ReplicatorUsageError(f"keep must be at least 1 (the checkpoint just written), got {keep}")
    directory = Path(directory)
    complete = sorted(
        (int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_NAME.match(p.name)) and committed(p)
    )
    doomed = [p for _, p in complete[:-keep]]
    doomed += [p for p in directory.iterdir() if p.name.endswith(PARTIAL_SUFFIX) and p.is_dir()]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def read_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The job-wide JSON of a complete checkpoint: step, layout, input position, extra."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    if not committed(path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {JOB_FILE}): its write was interrupted; use latest(directory) "
            "to find the last complete one"
        )
    info = read_json(path / JOB_FILE)
    saved_format = info.get("format") if isinstance(info, dict) else None
    if saved_format not in range(1, FORMAT + 1):
        raise CheckpointError(
            f"{path / JOB_FILE} has checkpoint format {saved_format!r}; this replicator reads formats 1 to "
            f"{FORMAT}: a newer replicator wrote it, so restore it with that one"
        )
    return info


def read_json(path: Path) -> Any:
    """One of a checkpoint's JSON files; a damaged one is named (json's own error names no file)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"checkpoint file {path} cannot be read ({type(error).__name__}: {error}): the file is damaged; restore "
            "another checkpoint"
        ) from error


def write_json(path: Path, payload: Any) -> None:
    """Write `payload` as JSON and flush it to disk before returning."""
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_directory(path: Path) -> None:
    """Flush a directory entry (a new or renamed file) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def commit(partial: Path, path: Path) -> None:
    """Make the written directory visible under `path` in one rename (the previous one survives until then)."""
    if path.exists():
        retired = path.with_name(path.name + ".old" + PARTIAL_SUFFIX)
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(path, retired)
        os.rename(partial, path)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(partial, path)
    fsync_directory(path.parent)

