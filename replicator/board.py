"""A run record's TensorBoard event file: tensorboard's own events and record framing, in one buffered file."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["EventFile", "tensorboard_installed"]

_SERIAL = itertools.count()  # tells apart the event files one process opens within a second


def tensorboard_installed() -> bool:
    """Can the `tensorboard` package be imported (its protos and record writer)?"""
    try:
        from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: F401
    except ImportError:
        return False
    return True


class EventFile:
    """A new event file in `directory`, named as TensorBoard's own writers name theirs, that TensorBoard reads as
    any other: events framed by tensorboard's `RecordWriter` (length, data, their checksums).

    Why not `SummaryWriter`: without TensorFlow, tensorboard's file layer opens, appends to and closes the file
    for every event, which cost the run record ~60 µs of CPU a step; here the events go into one buffered file
    that the caller flushes (the record does after each batch of steps).
    """

    def __init__(self, directory: Path, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_SERIAL)}"
        self.path = directory / name
        self._file = open(self.path, "wb")  # noqa: SIM115  # open for the run, closed by close()
        self._records = RecordWriter(self._file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # as SummaryWriter(purge_step=): earlier files' events from this step on are hidden
            self._write(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
            self._write(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def add_scalars(self, step: int, wall_time: float, values: Iterable[tuple[str, float]]) -> None:
        """One event holding the step's scalars (nothing when there are none)."""
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value) for tag, value in values])
        if summary.value:
            self._write(self._event(wall_time=wall_time, step=step, summary=summary))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
