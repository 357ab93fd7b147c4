"""Collectives whose replicas hold different numbers of rows: all_gather of an uneven last batch
(Horovod's allgather_variable_size) and all_to_all with split sizes (mixture-of-experts dispatch).

Values and gradients are compared with one process that holds every replica's rows and
differentiates the total loss Σ_r L_r, where replica r's loss weighs what it received by its
own weights; small tensors travel over the node's link, large ones over Gloo.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import replicator as rp
from replicator.comm import collectives
from replicator.errors import ReplicaMismatchError, ReplicatorUsageError
from replicator.testing import run_replicas

from _numerics import assert_within, bound

REPLICAS = 2
WIDE = collectives.LINK_BYTES // 4  # float32s per row: one row of these is past what the link carries
# Rows per replica for each gather, and (for all_to_all) rows replica r sends to each replica.
GATHER_ROWS = {"small": [3, 1], "empty": [0, 2], "large": [2, 1]}
SENDS = [[1, 4], [3, 0]]


def _rows(case: str, replica: int) -> torch.Tensor:
    width = WIDE if case == "large" else 3
    generator = torch.Generator().manual_seed(10 * replica + len(case))
    return torch.randn(GATHER_ROWS[case][replica], width, generator=generator, dtype=torch.float64)


def _weights(shape: torch.Size, replica: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + replica), dtype=torch.float64)


def _dispatched(replica: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7 + replica)
    return torch.randn(sum(SENDS[replica]), 2, generator=generator, dtype=torch.float64)


def uneven_results() -> dict[str, Any]:
    repl = rp.Replicator()
    ctx, me = repl.context, repl.replica_id
    out: dict[str, Any] = {}
    for case in GATHER_ROWS:
        rows = _rows(case, me).requires_grad_(True)
        gathered = ctx.all_gather(rows)
        (_weights(gathered.shape, me) * gathered).sum().backward()
        out[case], out[f"{case}_grad"] = gathered.detach(), rows.grad
    # An integer tensor of an uneven batch (predicted labels), and replicas that agree again afterwards.
    out["labels"] = ctx.all_gather(torch.arange(GATHER_ROWS["small"][me]) + 10 * me)
    out["even"] = ctx.all_gather(torch.full((2, 2), float(me)))

    sends = SENDS[me]
    received_from = [SENDS[source][me] for source in range(REPLICAS)]
    for name, splits in {"worked_out": {"input_split_sizes": sends},
                         "given": {"input_split_sizes": torch.tensor(sends), "output_split_sizes": received_from}
                         }.items():
        tokens = _dispatched(me).requires_grad_(True)
        received = ctx.all_to_all(tokens, **splits)
        (_weights(received.shape, me) * received).sum().backward()
        out[f"a2a_{name}"], out[f"a2a_{name}_grad"] = received.detach(), tokens.grad
    return out


def _single_process_gather(case: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    rows = [_rows(case, replica).requires_grad_(True) for replica in range(REPLICAS)]
    gathered = torch.cat(rows)
    sum((_weights(gathered.shape, replica) * gathered).sum() for replica in range(REPLICAS)).backward()
    return gathered.detach(), [r.grad for r in rows]


def _single_process_all_to_all() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tokens = [_dispatched(replica).requires_grad_(True) for replica in range(REPLICAS)]
    pieces = [tokens[source].split(SENDS[source]) for source in range(REPLICAS)]
    received = [torch.cat([pieces[source][target] for source in range(REPLICAS)]) for target in range(REPLICAS)]
    sum((_weights(r.shape, replica) * r).sum() for replica, r in enumerate(received)).backward()
    return [r.detach() for r in received], [t.grad for t in tokens]


@pytest.mark.parametrize("link", ["1", "0"], ids=["link", "gloo"])
def test_uneven_gather_and_all_to_all_match_one_process(link: str) -> None:
    results = run_replicas(uneven_results, REPLICAS, env={"REPLICATOR_LOCAL_LINK": link})
    for case in GATHER_ROWS:
        gathered, grads = _single_process_gather(case)
        # A row's gradient sums every replica's weight for it (REPLICAS terms, float64) in the backend's order.
        weights = max(float(_weights(gathered.shape, q).abs().max()) for q in range(REPLICAS))
        tolerance = bound(torch.float64, REPLICAS * weights, REPLICAS)
        for replica, got in enumerate(results):
            assert torch.equal(got[case], gathered), (case, replica)
            assert got[f"{case}_grad"].shape == grads[replica].shape
            assert_within(got[f"{case}_grad"], grads[replica], tolerance, f"{case}: replica {replica}'s gradient")
    received, grads = _single_process_all_to_all()
    for replica, got in enumerate(results):
        assert torch.equal(got["labels"], torch.tensor([0, 1, 2, 10]))
        assert torch.equal(got["even"], torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        for name in ("worked_out", "given"):
            assert torch.equal(got[f"a2a_{name}"], received[replica]), (name, replica)
            # Bit for bit: each row sent goes to one replica, so its gradient is that replica's one weight.
            assert torch.equal(got[f"a2a_{name}_grad"], grads[replica]), (name, replica)


def wrong_uneven_calls() -> list[str]:
    """Each wrong call must raise on every replica (and leave them in step for the next)."""
    repl = rp.Replicator()
    ctx, me = repl.context, repl.replica_id
    calls = {
        # Replica 1 expects 3 rows from replica 0, which sends it 4.
        "output splits": lambda: ctx.all_to_all(_dispatched(me), SENDS[me],
                                                [1, 3] if me == 0 else [3, 0]),
        # Replica 0's splits add up to 4 of its 5 rows.
        "input splits": lambda: ctx.all_to_all(_dispatched(me), [1, 3] if me == 0 else SENDS[me]),
        "trailing shape": lambda: ctx.all_gather(torch.zeros(2, 3 + me)),
        "no dimension": lambda: ctx.all_gather(torch.tensor(1.0)),
        # The new collectives are agreed on like the others: replicas at different ones fail together.
        "different collectives": lambda: (ctx.all_to_all(_dispatched(me), SENDS[me]) if me == 0
                                          else ctx.broadcast_object("config")),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
        except (ReplicatorUsageError, ReplicaMismatchError, ValueError) as error:
            messages.append(f"{name}: {error}")
        else:
            messages.append(f"{name}: no error")
        ctx.all_sum(torch.ones(1))
    return messages


def test_inconsistent_uneven_calls_raise_on_every_replica(run_failing_fast: Any) -> None:
    for replica, messages in enumerate(run_failing_fast(wrong_uneven_calls, REPLICAS)):
        output, inputs, trailing, scalar, different = messages
        assert "replica 1 expects [3, 0]" in output and "send it [4, 0]" in output, (replica, output)
        assert "replica 0's input_split_sizes" in inputs, (replica, inputs)
        if replica == 0:
            assert "add up to 4 rows, but the tensor has 5" in inputs
        assert "shape=(*, 3)" in trailing and "shape=(*, 4)" in trailing, (replica, trailing)
        assert "at least one dimension" in scalar, (replica, scalar)
        assert "ctx.all_to_all" in different and "ctx.broadcast_object" in different, (replica, different)
