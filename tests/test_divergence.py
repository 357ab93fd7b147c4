"""No silent divergence: a forgotten wrap_optimizer, different models, late parameters, optimizer state, lazy layers."""

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
GLOBAL_BATCH = 8
# The longest sum behind one gradient element in a step: the batch's 8 rows (4 per replica, summed and averaged
# across them), the widest fan-in of the backward (4), plus the loss's mean and the optimizer's update.
LENGTH = GLOBAL_BATCH + 4 + 4


def _assert_trains_alike(got: list[torch.Tensor], want: list[torch.Tensor], steps: int, replica: int) -> None:
    tolerance = training_bound(torch.float32, want, LENGTH, steps)
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert_within(mine, theirs, tolerance, f"replica {replica} tensor {index}")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(STEPS, GLOBAL_BATCH, 4, generator=generator)
    return inputs, torch.randn(STEPS, GLOBAL_BATCH, 2, generator=generator)


def _shard(repl: rp.Replicator, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's rows of global batch `step`: N replicas together see what one process sees."""
    share = GLOBAL_BATCH // repl.num_replicas
    rows = slice(repl.replica_id * share, (repl.replica_id + 1) * share)
    x, y = _data()
    return x[step][rows], y[step][rows]


def _train(repl: rp.Replicator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **run: Any) -> None:
    def step_fn(ctx: rp.ReplicaContext, step: int) -> torch.Tensor:
        x, y = _shard(repl, step)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in repl.run(step_fn, list(range(STEPS)), progress=False, **run):
        pass


def _everyone_raised(caught: pytest.ExceptionInfo[ReplicaFailure], replicas: int, kind: str,
                     *fragments: str) -> list[str]:
    errors = caught.value.errors
    assert [e.rank for e in errors] == list(range(replicas)), f"not every replica raised: {caught.value}"
    for error in errors:
        assert error.kind == kind, error
        for fragment in fragments:
            assert fragment in error.message, f"{fragment!r} missing from: {error.message}"
    return [error.message for error in errors]


# -- a forgotten wrap_optimizer (issue 14, item 3) ---------------------------------------------------------
def _forgets_wrap_optimizer() -> None:
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # never given to repl.wrap_optimizer

    def step_fn(ctx: rp.ReplicaContext, step: int) -> torch.Tensor:
        x, y = _shard(repl, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()  # the gradients are gone again by the time step_fn returns
        return loss.detach()

    for _ in repl.run(step_fn, list(range(STEPS)), progress=False):
        pass


def test_forgetting_wrap_optimizer_raises_on_every_replica_naming_the_parameters(
        run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_forgets_wrap_optimizer, 2)
    _everyone_raised(caught, 2, "ReplicatorUsageError",
                     "Sequential.0.weight, Sequential.0.bias, Sequential.1.weight, Sequential.1.bias got",
                     "by step 0", "repl.wrap_optimizer(")


def test_forgetting_wrap_optimizer_on_one_replica_trains_and_warns() -> None:
    with pytest.warns(UserWarning, match="Sequential.0.weight.*with several replicas"):
        _forgets_wrap_optimizer()


def _trains_the_head_only() -> list[torch.Tensor]:
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        # The body gets gradients (nobody froze it) but no optimizer updates it: it stays identical.
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model[2].parameters(), lr=0.1))
    _train(repl, model, optimizer)
    return [p.detach().clone() for p in model.parameters()]


def test_gradients_of_a_body_that_no_optimizer_updates_are_fine_as_under_ddp() -> None:
    expected = _trains_the_head_only()
    for replica, got in enumerate(run_replicas(_trains_the_head_only, 2)):
        _assert_trains_alike(got, expected, STEPS, replica)


# -- replicas that drift apart during a run (issue 14, item 3) ---------------------------------------------
def _drifts(directory: str | None) -> None:
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(4, 2)
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def step_fn(ctx: rp.ReplicaContext, step: int) -> None:
        x, y = _shard(repl, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if ctx.replica_id == 1 and step == 0:
            with torch.no_grad():  # an edit on one replica only, e.g. a weight tied by hand on one branch
                model.bias.mul_(1.5)

    checkpoints = {"checkpoint_every": 2, "checkpoint_dir": directory} if directory else {}
    for _ in repl.run(step_fn, list(range(STEPS)), progress=False, **checkpoints):
        pass


@pytest.mark.parametrize("at_a_checkpoint", [False, True], ids=["at-the-end", "at-a-checkpoint"])
def test_parameters_that_drift_apart_are_named_at_the_end_and_at_checkpoints(
        run_failing_fast: Callable[..., Any], tmp_path: Any, at_a_checkpoint: bool) -> None:
    where = "before saving a checkpoint at step 2" if at_a_checkpoint else "at the end of run()"
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_drifts, 2, str(tmp_path) if at_a_checkpoint else None)
    _everyone_raised(caught, 2, "ReplicaMismatchError", f"different values {where}",
                     "replica 1 differs from replica 0 in Linear.bias\n")
    assert not list(tmp_path.iterdir()), "a diverged model was checkpointed"


# -- different models on different replicas (issue 15, item 9; issue 14, item 6) ------------------------------
def _builds_per_replica() -> None:
    repl = rp.Replicator()
    with repl.scope():
        if repl.replica_id == 1:  # sizes that differ: Gloo used to abort this process in scope()'s broadcast
            model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 1))
        elif repl.replica_id == 2:  # the same sizes in another shape: used to be "different collectives, crc ..."
            model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 3), torch.nn.Linear(2, 2))
        else:
            model = torch.nn.Sequential(torch.nn.Linear(6, 2), torch.nn.Linear(2, 1))
        repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_replicas_that_build_different_models_name_the_first_differing_parameter(
        run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_builds_per_replica, 3)
    # Caught where the optimizer is wrapped, before its reducer allocates buckets: there, replicas with other
    # models disagreed on the number of buckets and one of them met the others' exit (1 run in ~16 under load).
    _everyone_raised(
        caught, 3, "ReplicaMismatchError", "when optimizer 0 (SGD) was wrapped",
        "replica 1 has Sequential.0.weight (4, 6) float32 where replica 0 has Sequential.0.weight (2, 6) float32",
        "replica 2 has Sequential.0.weight (3, 4) float32 where replica 0 has Sequential.0.weight (2, 6) float32",
        "Every replica must build the same model",
    )


def _swaps_a_layer_on_one_replica() -> None:
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if repl.replica_id == 1:
        model[1] = torch.nn.Linear(3, 5)  # after scope(): no copy, no check, until run() starts
    _train(repl, model, optimizer)


def test_a_model_changed_after_scope_on_one_replica_is_named_at_the_start_of_run(
        run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_swaps_a_layer_on_one_replica, 2)
    messages = _everyone_raised(
        caught, 2, "ReplicaMismatchError", "at the start of run()",
        "replica 1 has Sequential.1.weight (5, 3) float32 where replica 0 has Sequential.1.weight (2, 3) float32")
    assert all("crc" not in message for message in messages), messages


# -- parameters added after wrapping (issue 15, item 1) -------------------------------------------------------
def _fine_tunes() -> list[torch.Tensor]:
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    _train(repl, model, optimizer)
    # Fine-tuning: a new head, built apart on every replica (here from different seeds), joins the optimizer.
    torch.manual_seed(100 + repl.replica_id)
    model[2] = torch.nn.Linear(3, 2)
    optimizer.add_param_group({"params": model[2].parameters(), "lr": 0.05})
    _train(repl, model, optimizer, steps=2 * STEPS)
    return [p.detach().clone() for p in model.parameters()]


def test_a_parameter_group_added_after_wrapping_trains_like_one_process() -> None:
    expected = _fine_tunes()
    for replica, got in enumerate(run_replicas(_fine_tunes, 2)):
        _assert_trains_alike(got, expected, STEPS + 2 * STEPS, replica)


def _appends_to_param_groups_by_hand() -> None:
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))
    optimizer.param_groups[0]["params"].extend(model[1].parameters())  # not add_param_group: nobody is told
    _train(repl, model, optimizer)


def test_a_parameter_put_into_param_groups_by_hand_is_refused_at_the_first_step(
        run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_appends_to_param_groups_by_hand, 2)
    _everyone_raised(caught, 2, "ReplicatorUsageError", "Sequential.1.weight, Sequential.1.bias joined optimizer 0",
                     "optimizer.add_param_group(")


# -- optimizer state loaded on replica 0 only (issue 15, item 2) -----------------------------------------------
def _pretrained() -> tuple[dict[str, Any], dict[str, Any]]:
    """What a checkpoint file would hold: a model and its Adam state after a few steps (another lr, too)."""
    torch.manual_seed(7)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    x, y = _data()
    for step in range(2):
        optimizer.zero_grad()
        F.mse_loss(model(x[step]), y[step]).backward()
        optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def _resumes_the_horovod_way(broadcast: bool) -> list[torch.Tensor]:
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Linear(4, 2)
        optimizer = repl.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    weights, state = _pretrained()
    if broadcast:
        if repl.replica_id == 0:  # Horovod's recipe: only rank 0 reads the checkpoint ...
            model.load_state_dict(weights)
            optimizer.load_state_dict(state)
        repl.broadcast_state(model, optimizer)  # ... then hands it to everyone
    else:
        model.load_state_dict(weights)  # the weights everywhere, the optimizer state on replica 0 only
        if repl.replica_id == 0:
            optimizer.load_state_dict(state)
    _train(repl, model, optimizer)
    return [p.detach().clone() for p in model.parameters()] + [optimizer.state[model.weight]["exp_avg"].clone()]


def test_optimizer_state_loaded_on_replica_zero_only_is_refused_naming_broadcast_state(
        run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_resumes_the_horovod_way, 2, False)
    _everyone_raised(caught, 2, "ReplicaMismatchError", "at the start of run()",
                     "replica 1 lacks optimizer 0 (Adam) state 'exp_avg' of Linear.weight (2, 4) float32",
                     "repl.broadcast_state(model, optimizer)")


def test_broadcast_state_after_loading_on_replica_zero_trains_like_one_process() -> None:
    expected = _resumes_the_horovod_way(True)
    for replica, got in enumerate(run_replicas(_resumes_the_horovod_way, 2, True)):
        _assert_trains_alike(got, expected, STEPS, replica)


# -- lazy modules without a dummy forward (issue 15, item 12) --------------------------------------------------
def _lazy(repl: rp.Replicator) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, optimizer


def test_a_lazy_module_on_one_replica_trains_as_plain_pytorch_does() -> None:
    repl = rp.Replicator()
    model, optimizer = _lazy(repl)
    _train(repl, model, optimizer)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = _data()
    for step in range(STEPS):
        plain_optimizer.zero_grad()
        F.mse_loss(plain(x[step]), y[step]).backward()
        plain_optimizer.step()
    for mine, want in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine, want), (mine, want)


def _lazy_on_two_replicas() -> None:
    _lazy(rp.Replicator())


def test_a_lazy_module_on_several_replicas_asks_for_one_forward_inside_scope(
        run_failing_fast: Callable[..., Any]) -> None:
    with pytest.raises(ReplicaFailure) as caught:
        run_failing_fast(_lazy_on_two_replicas, 2)
    _everyone_raised(caught, 2, "ReplicatorUsageError", "Sequential.0.weight", "no shape yet",
                     "run one forward inside repl.scope()")
