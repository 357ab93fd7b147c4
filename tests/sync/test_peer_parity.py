"""What DDP and Horovod users do in their first week: double backward, sparse embeddings, a lone backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.testing import ReplicaFailure, run_replicas

from _numerics import assert_within, training_bound

STEPS = 3
BATCH = 8  # global
# The longest sum behind one gradient element in a step: the batch's 8 rows (x 3 tokens of a bag), the widest
# fan-in (8) crossed twice by a gradient penalty's double backward, plus the loss's mean and the update.
LENGTH = BATCH * 3 + 2 * 8 + 4


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 2, generator=generator)


def my_share(replica: int, replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = slice(replica * BATCH // replicas, (replica + 1) * BATCH // replicas)
    return [tuple(t[rows] for t in global_batch(step)) for step in range(STEPS)]  # type: ignore[misc]


def params_of(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def assert_close_lists(results: list[list[torch.Tensor]], expected: list[torch.Tensor], what: str) -> None:
    tolerance = training_bound(torch.float32, [e.to_dense() for e in expected], LENGTH, STEPS)
    for replica, got in enumerate(results):
        assert len(got) == len(expected)
        for index, (g, e) in enumerate(zip(got, expected)):
            assert g.layout == e.layout, f"{what}: replica {replica} tensor {index} is {g.layout}, not {e.layout}"
            g, e = g.to_dense(), e.to_dense()
            assert_within(g, e, tolerance, f"{what}: replica {replica} tensor {index}")


# -- loss.backward(create_graph=True): a gradient penalty (DDP's test_ddp_create_graph) ---------
def penalty_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def penalized_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor) -> torch.Tensor:
    """The gradient's squared norm as a penalty, read from .grad after a create_graph backward."""
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward(create_graph=True)
    penalty = sum((p.grad**2).sum() for p in model.parameters())
    (0.5 * penalty).backward()
    optimizer.step()
    return loss.detach()


def create_graph_reference() -> list[torch.Tensor]:
    model = penalty_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        penalized_step(model, optimizer, *global_batch(step))
    return params_of(model)


def create_graph_replicated() -> list[torch.Tensor]:
    repl = rp.Replicator()
    with repl.scope():
        model = penalty_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step_fn(ctx: rp.ReplicaContext, batch):
        return ctx.all_mean(penalized_step(model, optimizer, *batch))

    list(repl.run(step_fn, my_share(repl.replica_id, repl.num_replicas)))
    return params_of(model)


# torch's own advice about create_graph=True (a reference cycle through .grad): the scenario is DDP's test's.
@pytest.mark.numerics  # double backward on shards against the whole batch
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_gradient_penalty_through_create_graph_matches_one_process() -> None:
    results = run_replicas(create_graph_replicated, 2, timeout_s=90)
    expected = create_graph_reference()
    assert_close_lists(results, expected, "create_graph")
    torch.manual_seed(0)
    without_penalty = penalty_model()
    plain = torch.optim.SGD(without_penalty.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = global_batch(step)
        plain.zero_grad()
        F.mse_loss(without_penalty(x), y).backward()
        plain.step()
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(params_of(without_penalty), expected)), (
        "the penalty must change the result, or the test proves nothing about its gradient")


# -- sparse gradients: nn.Embedding(sparse=True) with SGD or SparseAdam ------------------------
VOCABULARY = 12


class Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCABULARY, 3, sparse=True)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(70 + step)
    # Replicas see different rows, some rows twice, and row 11 never.
    return torch.randint(0, VOCABULARY - 1, (BATCH, 3), generator=generator), torch.randn(BATCH, 2, generator=generator)


def sparse_optimizers(case: str, model: Bag) -> list[torch.optim.Optimizer]:
    if case == "sparse_adam":
        return [torch.optim.SparseAdam(model.embedding.parameters(), lr=0.05),
                torch.optim.Adam(model.head.parameters(), lr=0.05)]
    return [torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)]


def sparse_train(model: Bag, optimizers: list[torch.optim.Optimizer], batches) -> list[torch.Tensor]:
    gradients = []
    for tokens, target in batches:
        for optimizer in optimizers:
            optimizer.zero_grad()
        F.mse_loss(model(tokens), target).backward()
        gradients = [model.embedding.weight.grad.clone(), model.head.weight.grad.clone()]
        for optimizer in optimizers:
            optimizer.step()
    return gradients


def sparse_reference(case: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Bag()
    last_gradients = sparse_train(model, sparse_optimizers(case, model), [token_batch(s) for s in range(STEPS)])
    if case == "as_dense":
        last_gradients[0] = last_gradients[0].to_dense()
    return [*params_of(model), *(g.coalesce() if g.is_sparse else g for g in last_gradients)]


def sparse_replicated() -> dict[str, list[torch.Tensor]]:
    results = {}
    for case in ("sgd", "sparse_adam", "as_dense"):
        repl = rp.Replicator(sparse_as_dense=case == "as_dense")
        with repl.scope():
            torch.manual_seed(0)
            model = Bag()
            optimizers = [repl.wrap_optimizer(o) for o in sparse_optimizers(case, model)]
        rows = slice(repl.replica_id * BATCH // 2, (repl.replica_id + 1) * BATCH // 2)
        batches = [tuple(t[rows] for t in token_batch(s)) for s in range(STEPS)]
        gradients: list[torch.Tensor] = []

        def step_fn(ctx: rp.ReplicaContext, batch, model=model, optimizers=optimizers, gradients=gradients):
            gradients[:] = sparse_train(model, optimizers, [batch])

        list(repl.run(step_fn, batches))
        results[case] = [*params_of(model), *gradients]
    return results


def test_sparse_gradients_are_gathered_or_densified_as_one_process_would_have_them() -> None:
    results = run_replicas(sparse_replicated, 2, timeout_s=120)
    for case in ("sgd", "sparse_adam", "as_dense"):
        assert_close_lists([r[case] for r in results], sparse_reference(case), case)


# -- one replica's forward and backward alone ----------------------------------------------
def lone_setup() -> tuple[rp.Replicator, torch.nn.Module, torch.optim.Optimizer]:
    repl = rp.Replicator()
    with repl.scope():
        model = penalty_model()
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return repl, model, optimizer


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    optimizer.zero_grad()
    loss = F.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss.detach()


def saliency(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    model(x).sum().backward()  # also leaves gradients in the parameters: replica-local ones
    assert x.grad is not None
    return x.grad


def lone_backwards_stay_local() -> list[torch.Tensor]:
    """Replica 0 alone computes saliency between run()'s steps and, in eval mode, after it; all train on."""
    repl, model, optimizer = lone_setup()
    batches = my_share(repl.replica_id, repl.num_replicas)
    for step, _ in repl.run(lambda ctx, batch: plain_step(model, optimizer, batch), batches[:2]):
        if repl.replica_id == 0 and step == 0:
            saliency(model, batches[0][0])  # in training mode: between steps, training belongs in step_fn
    if repl.replica_id == 0:
        model.eval()
        saliency(model, batches[0][0])
        model.train()
    repl.barrier()
    # The last step by hand, in eval mode on every replica (frozen statistics, say): its backward
    # stays local too, and step() averages what it left.
    model.eval()
    plain_step(model, optimizer, batches[2])
    return params_of(model)


def test_one_replicas_backward_between_steps_or_in_eval_mode_stays_local(
        run_failing_fast: Callable[..., Any]) -> None:
    results = run_failing_fast(lone_backwards_stay_local, 2, timeout_s=90, collective_timeout_s=15)
    model = penalty_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        plain_step(model, optimizer, global_batch(step))
    assert_close_lists(results, params_of(model), "lone backward")


def lone_backward_inside_step_fn() -> None:
    repl, model, optimizer = lone_setup()

    def step_fn(ctx: rp.ReplicaContext, batch):
        loss = plain_step(model, optimizer, batch)
        if ctx.replica_id == 0:
            saliency(model, batch[0])  # inside step_fn: a gradient sync the other replica never joins
        return loss

    list(repl.run(step_fn, my_share(repl.replica_id, repl.num_replicas)))


def test_one_replicas_backward_inside_step_fn_fails_on_every_replica_naming_it(
        run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(lone_backward_inside_step_fn, 2, timeout_s=90, collective_timeout_s=30)
    errors = caught.value.errors
    assert [e.rank for e in errors] == [0, 1], caught.value
    for error in errors:
        assert error.kind == "ReplicaMismatchError", error
        assert "gradient sync of optimizer 0" in error.message and "in saliency" in error.message, error.message
