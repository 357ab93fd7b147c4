"""shard="parameters" on replicator's own collectives: FSDP2's all-gathers and reduce-scatters through shared memory
(one node) or a Gloo ring (across nodes), each agreed on by the replicas first.

Equivalence with plain FSDP2 on Gloo, bit for bit: an all-gather only copies, and a reduce-scatter's sum is the same
arithmetic when its terms are added in the same order. At two replicas any order gives the same bits (one
rounding), and the average halves the sum exactly. At three and four, the shared-memory sum adds the replicas'
slices in the order Gloo's ring all-reduce does (replicator.sync.reducers.shm.sum_in_ring_order); the send/recv
ring adds them the other way round its ring, which at three replicas is the same sum (its first two terms swap).
Against one process the batch is summed in another order: within the rounding bound test_shard_parameters.py
derives (ONE_PROCESS_ATOL, under 1e-6). Three replicas also make the shards uneven (FSDP2 pads dimension 0).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_shard_parameters import (
    ONE_PROCESS_ATOL,
    STEPS,
    Net,
    make_optimizer,
    my_batch,
    plain_fsdp2,
    reference,
    whole,
)

import replicator as rp
from replicator.sync.fsdp_collectives import _Group
from replicator.testing import run_replicas

# Collectives per step of Net's four units (embed, hidden, head and the root, which holds `scale`): an all-gather
# of each in forward, again of the three inner ones in backward (FSDP2 keeps the root's gathered between the two),
# and a reduce-scatter of each.
COLLECTIVES_PER_STEP = 4 + 3 + 4


def train(kind: str, with_fsdp2: bool, variant: str) -> dict[str, Any]:
    """Inside a replica: shard="parameters" for STEPS steps; what it ended with, what carried its collectives, and
    (`with_fsdp2`) what plain FSDP2 ends with in the same processes. `variant` "unreserved" drops the
    shared-memory transport's areas (every collective takes the path of one larger than any unit at sharding
    time); "native" runs the backend's own collectives after each check (what NCCL gets), here Gloo's."""
    repl = rp.Replicator(shard="parameters")
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer(kind, model.parameters()))
    collectives = repl.models.collectives
    assert collectives is not None
    if variant == "unreserved":
        collectives.transport.areas = None  # type: ignore[attr-defined]
    if variant == "native":
        collectives.close()
        collectives.transport = _Group(gloo=False)

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    batches = [my_batch(step, repl.replica_id, repl.num_replicas) for step in range(STEPS)]
    for _ in repl.run(step_fn, batches, record=False):
        pass
    result = {"params": [whole(p) for p in model.parameters()], "transport": collectives.transport.name,
              "checks": collectives.checks, "fsdp2": plain_fsdp2(kind, "plain") if with_fsdp2 else None}
    repl.close()
    return result


def train_both(with_fsdp2: bool, variant: str) -> dict[str, Any]:
    return {kind: train(kind, with_fsdp2, variant) for kind in ("sgd", "adamw")}


@pytest.mark.parametrize(("replicas", "per_node", "transport", "variant"),
                         [(3, 3, "shm", "default"), (4, 4, "shm", "default"), (3, 3, "shm", "unreserved"),
                          (3, 1, "ring", "default"), (2, 1, "ring", "default"), (2, 2, "native", "native")])
def test_sharded_units_on_our_collectives_match_fsdp2_bit_for_bit_and_one_process(replicas: int, per_node: int,
                                                                                  transport: str,
                                                                                  variant: str) -> None:
    results = run_replicas(train_both, replicas, True, variant, timeout_s=300, local_world_size=per_node)
    for kind in ("sgd", "adamw"):
        expected = reference(kind, "plain")
        for replica, by_kind in enumerate(results):
            got, where = by_kind[kind], f"{kind}, {transport}, replica {replica} of {replicas}"
            assert got["transport"] == transport, where
            assert got["checks"] == STEPS * COLLECTIVES_PER_STEP, where  # every collective was ours, and agreed
            for a, b in zip(got["params"], expected, strict=True):
                assert torch.allclose(a, b, atol=ONE_PROCESS_ATOL, rtol=0), f"{where}: {(a - b).abs().max()}"
            assert all(torch.equal(a, b) for a, b in zip(got["params"], got["fsdp2"], strict=True)), where


class Branching(Net):
    """Net whose forward skips its hidden unit on a batch flagged by a huge first input (data-dependent control)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        if not bool(x[:, 0].abs().max() > 1e3):
            h = torch.tanh(self.hidden(h))
        return self.head(h) * self.scale


def diverge() -> str:
    """Inside a replica: at step 1 the last replica's batch takes the branch that skips a unit; what each raises."""
    repl = rp.Replicator(shard="parameters")
    with repl.scope():
        torch.manual_seed(0)
        model = Branching()
        optimizer = repl.wrap_optimizer(make_optimizer("sgd", model.parameters()))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = my_batch(step, repl.replica_id, repl.num_replicas)
        if step == 1 and repl.replica_id == repl.num_replicas - 1:
            x = x.clone()
            x[0, 0] = 1e4
        return x, y

    try:
        for _ in repl.run(step_fn, [batch(step) for step in range(3)], record=False):
            pass
    except rp.ReplicaMismatchError as error:
        return str(error)
    finally:
        repl.close()
    return "nothing raised"


def test_a_replica_whose_batch_skips_a_unit_raises_on_every_replica_naming_the_units() -> None:
    messages = run_replicas(diverge, 2, timeout_s=120)
    for replica, message in enumerate(messages):
        assert "replicas diverged" in message, (replica, message)
        # Replica 0 gathers the hidden unit's parameters where replica 1, which skipped it, gathers the head's.
        assert "replica(s) 0: FSDP2 all-gather of the parameters of Branching.hidden" in message, message
        assert "replica(s) 1: FSDP2 all-gather of the parameters of Branching.head" in message, message
        assert "test_fsdp_collectives.py" in message, message  # the user's line (the model's call in step_fn)
    assert messages[0].split("\n")[1:] == messages[1].split("\n")[1:]  # the same report on both

