"""Fingerprints: the identity checks' hash, cached per tensor until the tensor changes in place."""

from __future__ import annotations

import zlib

import torch

from replicator.identity import _BLOCK_WORDS, Fingerprints, fingerprint


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


def test_a_large_tensor_s_digest_changes_with_any_word_and_is_the_same_on_every_machine() -> None:
    # Above 256 KB the identity checks use a block digest (3x a CRC's speed); one flipped bit
    # anywhere, in the first or last word of a block or in the bytes after the last whole word,
    # must change it, and equal bytes must give equal digests whatever the tensor's layout.
    block = 4 * _BLOCK_WORDS  # float16 elements per block of 8-byte words
    values = torch.randn(3 * block + 3, dtype=torch.float16)  # 3 blocks, then 6 bytes
    reference = fingerprint(values)
    assert fingerprint(values.clone()) == reference
    assert fingerprint(values.reshape(3, -1).t().contiguous().t()) == reference  # same values, another layout
    words = values.numel() * 2 // 8
    for element in (0, 3, block - 1, block, 4 * words - 1, 4 * words, values.numel() - 1):
        flipped = values.clone()
        flipped.view(torch.int16)[element] ^= 1
        assert fingerprint(flipped) != reference, element
    # Integer arithmetic modulo 2**64 on fixed multipliers: a constant across machines and numpy
    # versions (replicas on different hosts compare these digests).
    assert fingerprint(torch.arange(3 * _BLOCK_WORDS + 1, dtype=torch.int64)) == 1441151950
