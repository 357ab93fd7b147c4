"""Model-state bytes per replica, counted from the local tensors, against the formulas of every shard level.

fp32 AdamW holds per parameter element 4 bytes of value, 4 of gradient and 8 of moments: 16Ψ
per replica without sharding; "optimizer" 4Ψ + 4Ψ + 8Ψ/N; "gradients" 4Ψ + 4Ψ/N + 8Ψ/N;
"parameters" 16Ψ/N plus the largest unit, gathered whole while it runs. These are the figures the
planner prints (replicator.plan.memory.shard_memory), so the test holds the planner to what the
replicas really keep.

Counted at the fullest moment of a step, between backward and the optimizer's step (the
gradients are there, the moments of the previous step too), from the tensors themselves: each
parameter (its local shard under "parameters"), each `.grad` (or the slices of the averaged
gradient that "gradients" keeps instead), each optimizer state tensor (the shard optimizer's
under "optimizer"/"gradients"; AdamW's scalar `step` counters left out, as the formula leaves
them). "Up to padding" is exact here: a slice of a bucket is its T = (elements + one presence slot
per tensor) elements cut at T*r//N, so it differs from Ψ/N by at most the presence slots and one
element of rounding; FSDP2 cuts dimension 0 in chunks of ceil(rows/N) rows (torch.chunk: the
last replicas get what is left), so a shard differs from 1/N of a tensor by less than N - 1 rows.
Each replica's figures are checked against those bounds, and the replicas' sum against the
whole, to the byte.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import replicator as rp
from replicator.plan.memory import shard_memory
from replicator.testing import run_replicas

REPLICAS = 3  # uneven: Ψ is not a multiple of 3, and one tensor has fewer elements than 3
LEVELS = (None, "optimizer", "gradients", "parameters")


class Gate(torch.nn.Module):
    """One parameter of one element, in a module of its own (so that the root holds no parameter of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Net(torch.nn.Module):
    """Four units of different sizes under shard="parameters" (the default policy: the direct children)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.hidden = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 16))
        self.head = torch.nn.Linear(16, 7)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.head(torch.tanh(self.hidden(torch.tanh(self.embed(x))))))


LARGEST_UNIT = 16 * 33 + 33 + 33 * 16 + 16  # hidden's elements


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nbytes(tensors: Any) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def count(shard: str | None) -> dict[str, Any]:
    """Inside a replica: three AdamW steps with `shard`; the model state this replica holds, counted at step 2."""
    repl = rp.Replicator(shard=shard)
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = repl.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    seen: dict[str, Any] = {"gathered_forward": 0}

    def note_gathered(module: torch.nn.Module, args: Any) -> None:
        # After FSDP2's own pre-forward hook (registered first): the parameters gathered whole while this runs.
        gathered = [p for p in model.parameters() if not isinstance(p, DTensor)]
        if shard == "parameters" and repl.num_replicas > 1:  # on one replica nothing is sharded, nor gathered
            seen["gathered_forward"] = max(seen["gathered_forward"], nbytes(gathered))

    for unit in model.children():
        unit.register_forward_pre_hook(note_gathered)

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if ctx.step == 2:  # the moments of steps 0 and 1 exist; this step's gradients too
            params = list(model.parameters())
            sharded = repl.optimizers.wrapped[0].sharded
            state = optimizer.state if sharded is None else sharded.shard.state
            slices = sharded.slices.values() if sharded is not None else []
            seen["parameter_bytes"] = nbytes(params)
            seen["gradient_bytes"] = nbytes(p.grad for p in params if p.grad is not None) + nbytes(slices)
            seen["optimizer_bytes"] = nbytes(v for entry in state.values() for k, v in entry.items() if k != "step")
        optimizer.step()

    generator = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 7, generator=generator)) for _ in range(3)]
    for _ in repl.run(step_fn, batches, record=False):
        pass
    params = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    seen["elements"] = sum(p.numel() for p in params)
    seen["tensors"] = len(params)
    seen["row_elements"] = sum(p[0].numel() if p.dim() else 1 for p in params)
    repl.close()
    return seen


def every_level() -> dict[str | None, dict[str, Any]]:
    return {shard: count(shard) for shard in LEVELS}


KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")


def test_model_state_per_replica_equals_the_formula_of_every_shard_level() -> None:
    results = run_replicas(every_level, REPLICAS, timeout_s=300)
    psi = results[0][None]["elements"]
    assert psi % REPLICAS != 0
    for shard in LEVELS:
        level = shard or "none"
        formula = shard_memory(level, psi, REPLICAS, "adam", largest_unit=LARGEST_UNIT)
        for replica, by_level in enumerate(results):
            got = by_level[shard]
            where = f"shard={shard!r}, replica {replica} of {REPLICAS}"
            # How far 1/N of a kind of state may lie from Ψ/N, in elements (see the module's docstring).
            slack = (REPLICAS - 1) * got["row_elements"] if shard == "parameters" else got["tensors"] + 1
            for kind, per_element in zip(KINDS, (4, 4, 8), strict=True):
                expected = getattr(formula, kind)
                if expected == per_element * psi:  # not sharded at this level: the whole, to the byte
                    assert got[kind] == expected, (where, kind, got[kind], expected)
                else:
                    assert abs(got[kind] - expected) <= per_element * slack, (where, kind, got[kind], expected)
            total = sum(got[kind] for kind in KINDS) + got["gathered_forward"]
            assert abs(total - formula.total) <= 16 * slack, (where, total, formula.total)
            # "parameters": while a unit runs, it and nothing else is gathered whole; the largest is the formula's.
            assert got["gathered_forward"] == formula.gathered_bytes, (where, got["gathered_forward"])
        # The replicas' slices together are the whole state, once.
        for kind, per_element in zip(KINDS, (4, 4, 8), strict=True):
            replicas_hold = sum(r[shard][kind] for r in results)
            copies = 1 if getattr(formula, kind) < per_element * psi else REPLICAS
            assert replicas_hold == copies * per_element * psi, (shard, kind, replicas_hold)
    # Each level saves on the one before, every replica: 16Ψ > 8Ψ + 8Ψ/N > 4Ψ + 12Ψ/N. ("parameters" adds the
    # largest unit whole: here, a model of few units, that is most of the model, and it saves less.)
    for by_level in results:
        totals = [sum(by_level[shard][kind] for kind in KINDS) for shard in LEVELS[:3]]
        assert totals[0] > totals[1] > totals[2], totals


def test_one_replica_holds_the_whole_state_at_every_level() -> None:
    psi = None
    for got in run_replicas(every_level, 1, timeout_s=120)[0].values():
        psi = psi or got["elements"]
        assert (got["parameter_bytes"], got["gradient_bytes"], got["optimizer_bytes"]) == (4 * psi, 4 * psi, 8 * psi)
        assert got["gathered_forward"] == 0
