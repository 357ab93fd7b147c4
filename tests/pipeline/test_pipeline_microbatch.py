"""Micro-batches: split along dim 0 into exactly M pieces, non-tensors pass through, join back."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from replicator.pipeline.microbatch import gather, microbatch_sizes, scatter, shared_batch_size


def test_sizes_are_exactly_chunks_and_the_last_may_be_smaller() -> None:
    assert microbatch_sizes(8, 4) == [2, 2, 2, 2]
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch_sizes(5, 5) == [1] * 5
    assert microbatch_sizes(7, 1) == [7]
    with pytest.raises(ValueError, match="cannot be split into 4 micro-batches"):
        microbatch_sizes(3, 4)


def test_tensor_round_trip() -> None:
    x = torch.arange(30.0).reshape(10, 3)
    parts = scatter(x, 4)
    assert [p.shape[0] for p in parts] == [3, 3, 2, 2]
    assert parts[1].data_ptr() == x[3:].data_ptr()  # views, not copies
    assert torch.equal(gather(parts), x)


def test_structures_and_pass_through_values() -> None:
    Pair = namedtuple("Pair", "a b")
    batch = {
        "x": torch.randn(6, 2),
        "pair": Pair(torch.arange(6), [torch.ones(6, 1, 1), "tag"]),
        "scale": 0.5,
        "constant": torch.tensor(3.0),  # 0-dim: not split
    }
    parts = scatter(batch, 4)
    assert len(parts) == 4
    assert [p["x"].shape[0] for p in parts] == [2, 2, 1, 1]
    assert all(p["scale"] == 0.5 and p["pair"].b[1] == "tag" for p in parts)
    assert all(isinstance(p["pair"], Pair) for p in parts)
    assert all(p["constant"] is batch["constant"] for p in parts)
    joined = gather([{"x": p["x"], "pair": p["pair"], "scale": p["scale"]} for p in parts])
    assert torch.equal(joined["x"], batch["x"])
    assert torch.equal(joined["pair"].a, batch["pair"].a)
    assert joined["pair"].b[1] == "tag" and joined["scale"] == 0.5


def test_clear_errors() -> None:
    assert shared_batch_size({"a": "no tensors"}) is None
    with pytest.raises(ValueError, match="disagree on the batch size"):
        scatter((torch.zeros(4), torch.zeros(5)), 2)
    with pytest.raises(ValueError, match="holds no tensor"):
        scatter(["text", 3], 2)
    with pytest.raises(ValueError, match="batch of 2 sample"):
        scatter(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="differs between micro-batches"):
        gather([(torch.zeros(1), "a"), (torch.zeros(1), "b")])
    with pytest.raises(ValueError, match="0-dim"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(TypeError, match="structure differs"):
        gather([(torch.zeros(1),), (torch.zeros(1), torch.zeros(1))])
