"""Fingerprints: the identity checks' hash, cached per tensor until the tensor changes in place."""

from __future__ import annotations

import zlib

import torch

from replicator.identity import Fingerprints, fingerprint


def test_a_fingerprint_is_the_crc_of_the_bytes_also_for_views_and_sparse_tensors() -> None:
    dense = torch.randn(5, 7)
    assert fingerprint(dense) == zlib.crc32(dense.numpy().tobytes())
    assert fingerprint(dense.t()) == zlib.crc32(dense.t().contiguous().numpy().tobytes())
    assert fingerprint(torch.tensor(3.0)) == zlib.crc32(torch.tensor([3.0]).numpy().tobytes())
    values = torch.tensor([1.0, 2.0])
    rows_0_2 = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (4,), check_invariants=True)
    rows_0_3 = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), values, (4,), check_invariants=True)
    assert fingerprint(rows_0_2) != fingerprint(rows_0_3)


def test_cached_fingerprints_follow_in_place_changes_and_never_outlive_their_tensor() -> None:
    cached = Fingerprints()
    weights = torch.randn(1 << 17)
    before = cached(weights)
    assert before == fingerprint(weights)
    with torch.no_grad():
        weights.add_(1.0)  # what an optimizer step does: the version counter moves
    assert cached(weights) == fingerprint(weights) != before
    replacement = weights.clone()
    del weights  # a new tensor, perhaps at the old one's id, is hashed afresh
    assert cached(replacement) == fingerprint(replacement)
