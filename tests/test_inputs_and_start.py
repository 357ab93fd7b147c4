"""Input sharding, identical starts, and uneven inputs ending together."""

from __future__ import annotations

import torch

import replicator as rp
from replicator.testing import run_replicas

DATASET = 103  # not divisible by the replica count, on purpose


def sharded_indices() -> list[list[int]]:
    repl = rp.Replicator()

    def input_fn(ctx: rp.InputContext):
        data = torch.arange(DATASET)
        loader = torch.utils.data.DataLoader(data, batch_size=5, sampler=ctx.sampler(data, seed=7, drop_last=False))
        return loader

    inputs = repl.prepare_input(input_fn)
    return [sorted(torch.cat(list(inputs)).tolist()) for _ in range(2)]  # two epochs


def test_shards_are_disjoint_and_cover_the_data() -> None:
    for n in (2, 4):
        shards = run_replicas(sharded_indices, n)
        for epoch in range(2):
            seen = [set(s[epoch]) for s in shards]
            union = set().union(*seen)
            assert union == set(range(DATASET)), f"{n} replicas miss {set(range(DATASET)) - union}"
            per_replica = -(-DATASET // n)
            assert all(len(s[epoch]) == per_replica for s in shards)
            # Padding repeats at most n-1 samples to make shards equal; otherwise they are disjoint.
            overlap = sum(len(s) for s in seen) - len(union)
            assert overlap == per_replica * n - DATASET


def start_state() -> list[torch.Tensor]:
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(100 + repl.replica_id)  # every replica seeds differently
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
        model[1].running_mean.uniform_()  # buffers differ too
        repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return [t.clone() for t in model.state_dict().values()]


def test_identical_start_after_scope() -> None:
    states = run_replicas(start_state, 3)
    for other in states[1:]:
        for a, b in zip(states[0], other):
            assert torch.equal(a, b)
    torch.manual_seed(100)
    expected = torch.nn.Linear(5, 7).weight
    assert torch.equal(states[0][0], expected), "the common start is replica 0's"


def uneven_steps() -> int:
    repl = rp.Replicator()
    batches = [torch.ones(2, 1)] * (5 if repl.replica_id == 0 else 3)
    return len([step for step, _ in repl.run(lambda ctx, batch: ctx.all_sum(batch.sum()), batches)])


def test_uneven_inputs_stop_every_replica_at_the_same_step() -> None:
    assert run_replicas(uneven_steps, 2, timeout_s=60) == [3, 3]


def test_epochs_reshuffle_behind_a_batch_sampler() -> None:
    from replicator.inputs import ReplicatedInput

    def input_fn(ctx: rp.InputContext):
        data = torch.arange(40)
        batches = torch.utils.data.BatchSampler(ctx.sampler(data, seed=1), batch_size=4, drop_last=True)
        return torch.utils.data.DataLoader(data, batch_sampler=batches)

    context = rp.InputContext(num_replicas=2, replica_id=0, input_pipeline_id=0, num_input_pipelines=2)
    inputs = ReplicatedInput(input_fn, context, torch.device("cpu"))
    first, second = (torch.cat(list(inputs)).tolist() for _ in range(2))
    assert len(first) == len(second) == 20 and first != second  # a new epoch, a new order
