"""Modes as config objects (rp.ParameterServers, rp.DiLoCo, rp.ActorLearner): the same job as the deprecated
keywords, chosen in one place, with the keywords warning and every mix of the two refused."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator.asynchronous.modes import training_mode
from replicator.testing import run_replicas

STEPS = 3


def outer_average(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


# Each mode in its two spellings: the config object, and the deprecated keywords it replaces.
FORMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "parameter servers": ({"mode": rp.ParameterServers(servers=1, sync_group_size=2, max_staleness=0)},
                          {"mode": "async", "parameter_servers": 1, "sync_group_size": 2, "max_staleness": 0}),
    "diloco": ({"mode": rp.DiLoCo(outer_every=2, sync_group_size=1, outer_optimizer=outer_average)},
               {"mode": "diloco", "outer_every": 2, "sync_group_size": 1, "outer_optimizer": outer_average}),
    "actor-learner": ({"mode": rp.ActorLearner(actors=1, evaluator=True)},
                      {"mode": "actor_learner", "actors": 1, "evaluator": True}),
}


def trained(arguments: dict[str, Any]) -> dict[str, Any]:
    """One process of a 3-process job in `arguments`' mode: the warnings its constructor gave, its role, and (where
    it trains) its parameters after STEPS steps of fixed batches."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repl = rp.Replicator(**arguments)
    found: dict[str, Any] = {"role": repl.role, "deprecated": [str(w.message) for w in caught
                                                                if issubclass(w.category, DeprecationWarning)],
                             "mesh": (repl.job.mesh.role_names, repl.job.mesh.serves)}
    if repl.role in ("learner", "actor", "evaluator"):
        repl.close()  # actor–learner: the roles are what this test compares (test_actor_learner.py trains it)
        return found
    with repl.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = repl.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def input_fn(ctx: rp.InputContext) -> list[Any]:
        generators = [torch.Generator().manual_seed(100 * step + ctx.input_pipeline_id) for step in range(STEPS)]
        return [(torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)) for g in generators]

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in repl.run(step_fn, repl.prepare_input(input_fn), steps=STEPS, record=False):
        pass
    found["params"] = [p.detach().clone() for p in model.parameters()]
    repl.close()
    return found


@pytest.mark.parametrize("mode", sorted(FORMS))
def test_a_config_object_runs_the_job_its_deprecated_keywords_ran(mode: str) -> None:
    config, keywords = FORMS[mode]
    world = 2 if mode == "diloco" else 3
    new = run_replicas(trained, world, config, timeout_s=180)
    old = run_replicas(trained, world, keywords, timeout_s=180)
    assert [r["role"] for r in new] == [r["role"] for r in old]
    assert all(not r["deprecated"] for r in new)
    assert all(r["deprecated"] and "is deprecated: pass mode=rp." in r["deprecated"][0] for r in old)
    for got, expected in zip(new, old):
        assert ("params" in got) == ("params" in expected)
        for g, e in zip(got.get("params", []), expected.get("params", [])):
            assert torch.equal(g, e)  # the same regime, the same arithmetic
    if mode == "parameter servers":
        assert [r["role"] for r in new] == ["worker", "worker", "server"]
        assert [r["mesh"] for r in new] == [(("worker", "parameter server"), serves) for serves in (False, False, True)]
    if mode == "actor-learner":  # the mesh names its roles: actors are not its "servers"
        assert [r["role"] for r in new] == ["learner", "actor", "evaluator"]
        assert [r["mesh"] for r in new] == [(("learner", "actor"), serves) for serves in (False, True, True)]


@pytest.fixture
def three_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's variables of rank 0 in a job of 3: modes are checked before any process group exists."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")


@pytest.mark.usefixtures("three_processes")
@pytest.mark.parametrize("mode", sorted(FORMS))
def test_both_spellings_make_the_same_mode(mode: str) -> None:
    config, keywords = FORMS[mode]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = training_mode(config["mode"], 1, {})
    with pytest.warns(DeprecationWarning, match=r"is deprecated: pass mode=rp\.\w+\(\.\.\.\)"):
        old = training_mode(keywords["mode"], 1, {k: v for k, v in keywords.items() if k != "mode"})
    assert new.config == old.config and new.name == old.name and new.job_shape() == old.job_shape()


@pytest.mark.usefixtures("three_processes")
@pytest.mark.parametrize(("mode", "deprecated", "error", "message"), [
    (rp.DiLoCo(outer_every=4), {"outer_every": 4}, rp.ReplicatorUsageError,
     r"outer_every= cannot be given beside mode=DiLoCo\(outer_every=4.*set them inside rp\.DiLoCo"),
    (rp.ParameterServers(), {"actors": 1}, rp.ReplicatorUsageError, r"actors= cannot be given beside"),
    ("sync", {"sync_group_sise": 2}, TypeError, r"unexpected keyword argument 'sync_group_sise'"),
    (rp.ParameterServers(servers=0), {}, rp.ReplicatorUsageError, r"mode='async' needs servers >= 1, got 0"),
    (rp.ParameterServers(servers=3), {}, rp.ReplicatorUsageError, r"servers=3 leaves no worker in a job of 3"),
    (rp.ActorLearner(actors=0), {}, rp.ReplicatorUsageError, r"needs actors >= 1, got actors=0"),
    ("async", {"parameter_servers": rp.ParameterServers()}, rp.ReplicatorUsageError,
     r"parameter_servers must be a number of servers, got ParameterServers\(.*pass a config object as "
     r"mode=rp\.ParameterServers"),
    # The deprecated keywords' refusals, word for word as before.
    ("sync", {"outer_every": 2}, rp.ReplicatorUsageError,
     r"^outer_every only apply to mode='diloco' \(sync_group_size also to mode='async'; raised on rank 0\): pass the "
     r"mode too, or leave them out$"),
    ("sync", {"parameter_servers": 1}, rp.ReplicatorUsageError,
     r"^parameter_servers and max_staleness belong to the parameter-server regime: pass mode='async' with them$"),
    ("diloco", {"actors": 2}, rp.ReplicatorUsageError,
     r"^actors=2 and evaluator=False belong to mode='actor_learner': pass the mode too$"),
])
def test_mixed_or_bad_mode_arguments_are_refused(mode: Any, deprecated: dict[str, Any], error: type[Exception],
                                                 message: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(error, match=message):
            training_mode(mode, 1, deprecated)
