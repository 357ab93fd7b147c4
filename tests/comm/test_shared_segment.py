"""SharedSegment: made private, opened only when it is a private segment of this user of the agreed size."""

from __future__ import annotations

import os

import pytest
import torch

from replicator.comm.shared_segment import SHARED_MEMORY_DIR, SegmentError, SharedSegment, shared_memory_writable

pytestmark = pytest.mark.skipif(shared_memory_writable() is not None, reason="no writable /dev/shm")


def test_both_ends_share_the_bytes_and_the_name_goes_once_unlinked() -> None:
    made = SharedSegment.create(1000)
    path = os.path.join(SHARED_MEMORY_DIR, made.name)
    assert os.stat(path).st_mode & 0o777 == 0o600
    opened = SharedSegment.open(made.name, 1000)
    opened.unlink()
    made.unlink()  # the second removal finds nothing, and says nothing
    assert not os.path.exists(path)
    made.bytes[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert opened.bytes[:4].tolist() == [1, 2, 3, 4]  # the mapping outlives the name


def test_a_name_that_is_not_a_private_segment_of_the_agreed_size_is_refused() -> None:
    with pytest.raises(SegmentError, match="not the name"):
        SharedSegment.open("../../etc/passwd", 10)
    made = SharedSegment.create(64)
    try:
        with pytest.raises(SegmentError, match="not the agreed 65"):
            SharedSegment.open(made.name, 65)
        os.chmod(os.path.join(SHARED_MEMORY_DIR, made.name), 0o644)
        with pytest.raises(SegmentError, match="not a private file"):
            SharedSegment.open(made.name, 64)
    finally:
        made.unlink()
    with pytest.raises(SegmentError, match="cannot open"):  # gone: nothing is created in its place
        SharedSegment.open(made.name, 64)
    planted = os.path.join(SHARED_MEMORY_DIR, "replicator-peer-" + "0" * 32)
    os.symlink("/etc/hostname", planted)
    try:
        with pytest.raises(SegmentError, match="cannot open"):  # O_NOFOLLOW: a planted link is not followed
            SharedSegment.open(os.path.basename(planted), 64)
    finally:
        os.unlink(planted)
