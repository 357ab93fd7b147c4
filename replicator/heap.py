"""glibc's heap for a sharded model: freed blocks go back to the system, so that sharding lowers resident memory."""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["HEAP_MARK", "USER_ALLOCATOR_SETTINGS", "return_freed_blocks"]

# Set by `replicator launch` beside the heap it keeps (replicator.launch.launcher.HEAP_KEPT): those settings are the
# launcher's, not the user's, and a sharded job may change them.
HEAP_MARK = "REPLICATOR_HEAP"
USER_ALLOCATOR_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_THRESHOLD = 128 * 1024  # glibc's own default, fixed: a block over it is a mapping of its own, unmapped when freed


def return_freed_blocks() -> bool:
    """Make this process's heap return freed blocks, unless the user chose allocator settings (then they win).

    shard="parameters" gathers and frees every unit's parameters and gradients each step: with
    a heap that keeps what it frees (`replicator launch`'s, for speed) or glibc's adaptive
    threshold, those blocks stay resident and a sharded replica holds more than an unsharded
    one (benchmarks/sharding_memory.py). True when the heap was set.
    """
    chose_own = any(name in os.environ for name in USER_ALLOCATOR_SETTINGS) and os.environ.get(HEAP_MARK) != "kept"
    if chose_own or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _THRESHOLD) == 1)
