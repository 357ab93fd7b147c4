"""SharedSegment: a private /dev/shm mapping that one process makes and one peer of its node opens by name."""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat

import torch

__all__ = ["SharedSegment", "SegmentError", "SHARED_MEMORY_DIR", "shared_memory_writable", "reserve_pages"]

SHARED_MEMORY_DIR = "/dev/shm"
_PREFIX = "replicator-peer-"
# What a name told by a peer may look like: ours, random, nothing that could point elsewhere.
_NAME = re.compile(rf"{_PREFIX}[0-9a-f]{{32}}")


class SegmentError(OSError):
    """A segment could not be made, or a name a peer told does not name a private segment of the agreed size."""


def shared_memory_writable() -> str | None:
    """None when this process can make segments; else why it cannot."""
    if not os.path.isdir(SHARED_MEMORY_DIR) or not os.access(SHARED_MEMORY_DIR, os.W_OK):
        return f"{SHARED_MEMORY_DIR} is missing or not writable"
    return None


class SharedSegment:
    """`size` bytes of shared memory as a uint8 tensor (`.bytes`), mapped by this process.

    Made with a random name, mode 0600 and O_EXCL; opened only if the file is a regular file of
    this user, private to it, of exactly the agreed size (O_NOFOLLOW: no link planted in the
    world-writable directory is followed). `unlink` as soon as both ends have mapped it: the
    memory then lives until both let go of it, and a process that dies leaves nothing behind.
    """

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self._mapping = mapping
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8) if len(mapping) else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int) -> SharedSegment:
        name = _PREFIX + secrets.token_hex(16)
        path = os.path.join(SHARED_MEMORY_DIR, name)
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(descriptor, max(size, 1))
            reserve_pages(descriptor, size, path, "parameter-server payloads",
                          "give it more room or set REPLICATOR_PS_SHARED_MEMORY=0")
            return cls(name, mmap.mmap(descriptor, max(size, 1)))
        except BaseException:
            _remove(path)
            raise
        finally:
            os.close(descriptor)

    @classmethod
    def open(cls, name: str, size: int) -> SharedSegment:
        """The segment a peer made and told the name of; SegmentError, saying why, if it is not one to share."""
        if not _NAME.fullmatch(name):
            raise SegmentError(f"{name!r} is not the name of a replicator segment")
        path = os.path.join(SHARED_MEMORY_DIR, name)
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise SegmentError(f"cannot open {path}: {error}") from None
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise SegmentError(f"{path} is not a private file of this user")
            if info.st_size != max(size, 1):
                raise SegmentError(f"{path} holds {info.st_size} bytes, not the agreed {max(size, 1)}")
            return cls(name, mmap.mmap(descriptor, max(size, 1)))
        finally:
            os.close(descriptor)

    def unlink(self) -> None:
        """Remove the name (the mapping stays); nothing if it is gone already (the peer removed it)."""
        _remove(os.path.join(SHARED_MEMORY_DIR, self.name))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def reserve_pages(descriptor: int, size: int, path: str, holding: str = "a segment",
                  remedy: str = "give it more room (for a container, e.g. docker run --shm-size=2g)") -> None:
    """Take a segment's pages now: a full /dev/shm then says so here (an OSError naming what it was to hold and
    how to fix it), instead of killing the process with SIGBUS at the first write into a page it could not get."""
    try:
        os.posix_fallocate(descriptor, 0, max(size, 1))
    except OSError as error:
        if error.errno != errno.ENOSPC:
            return  # a filesystem that cannot reserve ahead: pages come at first touch
        free = os.statvfs(os.path.dirname(path))
        raise SegmentError(
            errno.ENOSPC,
            f"{os.path.dirname(path)} has no room for {size / 2**20:.1f} MiB of {holding} "
            f"({free.f_bavail * free.f_frsize / 2**20:.1f} MiB free); {remedy}",
        ) from error
