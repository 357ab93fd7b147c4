"""shard="parameters" returns freed heap blocks to the system, unless the user chose allocator settings of their own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from replicator.launch import heap_kept_environment

PROBE = "from replicator.heap import return_freed_blocks; print(return_freed_blocks())"


def probe(extra: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "REPLICATOR_HEAP"))}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **extra}, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_launchers_kept_heap_and_glibcs_default_give_way_to_a_returning_heap() -> None:
    assert heap_kept_environment()["REPLICATOR_HEAP"] == "kept"
    assert probe(heap_kept_environment()) == "True"
    assert probe({}) == "True"


def test_allocator_settings_of_the_users_own_win() -> None:
    assert probe({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}) == "False"
    assert probe({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == "False"
