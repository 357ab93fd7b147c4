"""A parameter server steps the user's optimizer as torch does: the same bits, every step hook, the profiler's label."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import replicator as rp
from replicator.asynchronous.parameter_server import stepping
from replicator.testing import run_replicas

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def parameters_with_gradients(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(5, 3), (3,)]]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    return params


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_server_step_equals_torchs_step_bit_for_bit(name: str) -> None:
    ours, theirs = parameters_with_gradients(), parameters_with_gradients()
    ours_optimizer, theirs_optimizer = OPTIMIZERS[name](ours), OPTIMIZERS[name](theirs)
    for _ in range(3):
        stepping.step(ours_optimizer)
        theirs_optimizer.step()
    for got, want in zip(ours, theirs, strict=True):
        assert torch.equal(got, want)
    assert torch.is_grad_enabled()  # the optimizer's own grad-mode switch was undone


def test_on_this_torch_nothing_observes_a_plain_step_so_the_label_is_left_out() -> None:
    """The fast path is live on the pinned torch: its class's step is torch's wrapper and nothing listens."""
    optimizer = OPTIMIZERS["sgd-momentum"](parameters_with_gradients())
    assert stepping._TORCH_WRAPPER is not None
    assert type(optimizer).step.__code__ is stepping._TORCH_WRAPPER
    assert not stepping._observed(optimizer)


def test_step_hooks_of_the_optimizer_run_around_the_update() -> None:
    params = parameters_with_gradients()
    optimizer = OPTIMIZERS["sgd-momentum"](params)
    seen: list[tuple[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("pre", params[1].detach().clone())))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(("post", params[1].detach().clone())))
    before = params[1].detach().clone()
    stepping.step(optimizer)
    assert [when for when, _ in seen] == ["pre", "post"]
    assert torch.equal(seen[0][1], before) and torch.equal(seen[1][1], params[1].detach())
    assert not torch.equal(before, params[1].detach())


def test_a_global_step_hook_runs() -> None:
    calls: list[torch.optim.Optimizer] = []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    try:
        optimizer = OPTIMIZERS["adam"](parameters_with_gradients())
        stepping.step(optimizer)
    finally:
        handle.remove()
    assert calls == [optimizer]


def test_a_recording_profiler_sees_the_step_under_torchs_label() -> None:
    optimizer = OPTIMIZERS["sgd-momentum"](parameters_with_gradients())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        stepping.step(optimizer)
    assert "Optimizer.step#SGD.step" in {event.name for event in profile.events()}


def test_a_step_another_library_wrapped_runs_through_that_wrapper() -> None:
    class Wrapped(torch.optim.SGD):
        pass

    calls: list[str] = []
    optimizer = Wrapped(parameters_with_gradients(), lr=0.1)
    torchs = Wrapped.step  # torch's wrapper, which a profiler or tracer of another library wraps in turn

    @functools.wraps(torchs)
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append("outer")
        return torchs(*args, **kwargs)

    Wrapped.step = counted  # type: ignore[method-assign]
    stepping.step(optimizer)
    assert calls == ["outer"]


# -- on a real server ------------------------------------------------------------------------------


def train_with_a_step_hook(steps: int) -> dict[str, Any]:
    repl = rp.Replicator(mode=rp.ParameterServers(servers=1))
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        hooked: list[int] = []
        sgd.register_step_post_hook(lambda opt, args, kwargs: hooked.append(1))
        optimizer = repl.wrap_optimizer(sgd)

    def step_fn(ctx: rp.ReplicaContext, batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()

    inputs = repl.prepare_input(lambda ctx: [torch.full((3, 4), float(step)) for step in range(steps)])
    for _ in repl.run(step_fn, inputs, steps=steps, progress=False):
        pass
    figures = repl.last_run["asynchronous"]
    repl.close()
    return {"hooked": len(hooked), "role": figures.get("role"), "versions": figures.get("versions")}


def test_a_users_step_hook_runs_on_the_server_once_per_update() -> None:
    steps = 4
    results = run_replicas(train_with_a_step_hook, 3, steps)
    server = next(result for result in results if result["role"] == "server")
    assert server["versions"] == [2 * steps]  # both workers' updates, each applied once
    assert server["hooked"] == 2 * steps
