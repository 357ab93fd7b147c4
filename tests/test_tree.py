"""Nested batches and outputs: every walk reaches the same tensors the hand-written walkers did."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from replicator import _tree
from replicator.errors import ReplicatorUsageError
from replicator.loop import check_output
from replicator.pipeline.microbatch import gather, scatter


class Batch(dict):
    """A dict subclass of the kind data libraries return (pytree alone takes it for one leaf)."""


class Pair(tuple):
    pass


Sample = namedtuple("Sample", "image label")


def test_walks_go_into_containers_pytree_does_not_know() -> None:
    batch = Batch(x=torch.ones(4, 2), rest=[Pair((torch.zeros(4), 7)), None])
    assert [tuple(t.shape) for t in _tree.tensors(batch)] == [(4, 2), (4,)]
    assert _tree.leading_size(batch) == 4
    moved = _tree.to_device(batch, torch.device("cpu"))
    assert isinstance(moved, dict) and torch.equal(moved["rest"][0][0], torch.zeros(4)) and moved["rest"][0][1] == 7
    paths = [path for path, _ in _tree.leaves_with_paths(batch, "batch")]
    assert paths == ["batch['x']", "batch['rest'][0][0]", "batch['rest'][0][1]", "batch['rest'][1]"]


def test_the_loops_batch_size_rule_reads_the_first_non_empty_tensor() -> None:
    assert _tree.leading_size((torch.empty(0, 3), torch.ones(5))) == 5
    assert _tree.leading_size({"scalar": torch.tensor(1.0)}) == 1
    assert _tree.leading_size(["no tensors", 3]) == 0
    assert _tree.leading_size(Sample(torch.ones(2, 8), torch.ones(2))) == 2


def test_outputs_may_nest_numbers_and_tensors_in_any_container() -> None:
    check_output(Batch(loss=torch.tensor(1.0), parts=Pair((1, 2.5, True, None))))
    check_output(Sample(torch.ones(1), 3))
    with pytest.raises(ReplicatorUsageError, match=r"a str at the output\['name'\]"):
        check_output({"loss": torch.tensor(0.0), "name": "x"})


def test_micro_batches_of_a_dict_subclass_split_and_join() -> None:
    batch = Batch(x=torch.arange(8.0).reshape(4, 2), y=torch.arange(4))
    parts = scatter(batch, 2)
    assert [tuple(part["x"].shape) for part in parts] == [(2, 2), (2, 2)]
    joined = gather(parts)
    assert torch.equal(joined["x"], batch["x"]) and torch.equal(joined["y"], batch["y"])
