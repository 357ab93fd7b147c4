"""ctx.all_gather_object and ctx.broadcast_object: configs, metrics and strings between replicas,
through a JSON encoding that keeps tuples, non-string keys and bytes, and never unpickles."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import replicator as rp
from replicator.comm import collectives, objects
from replicator.testing import run_replicas


def _metrics(replica: int) -> dict[Any, Any]:
    return {"replica": replica, "loss": 0.25 * replica, "best": (replica, -0.0), 7: [None, True, "ünï"],
            ("lr", 0): 1e-3, "raw": bytes([replica, 255]), "nan": float("nan"), "inf": -math.inf}


CONFIG = {"model": "resnet", "widths": (64, 128), "seed": 2**70, "notes": "x" * collectives.LINK_BYTES}


def _same(a: Any, b: Any) -> bool:
    """Equality with NaN equal to itself, and types compared too (a tuple is not a list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and str(a) == str(b)  # str: -0.0 is not 0.0


def object_results() -> dict[str, Any]:
    repl = rp.Replicator()
    ctx, me = repl.context, repl.replica_id
    out: dict[str, Any] = {
        "gathered": ctx.all_gather_object(_metrics(me)),
        "config": ctx.broadcast_object(CONFIG if me == 1 else None, source=1),  # large: over Gloo
        "word": ctx.broadcast_object(f"from {me}"),
        "lengths": ctx.all_gather_object("y" * (5 + 70_000 * me)),  # past the link's size on replica 1 only
    }
    errors = []
    for call in (lambda: ctx.all_gather_object({"loss": torch.tensor(1.0)} if me == 1 else {"loss": 1.0}),
                 lambda: ctx.broadcast_object(object() if me == 0 else "fine", source=0)):
        try:
            call()
            errors.append("no error")
        except objects.UnencodableError as error:
            errors.append(str(error))
    out["errors"] = errors
    out["in_step"] = int(ctx.all_sum(torch.ones(1)))
    return out


def test_objects_travel_between_replicas_as_they_left() -> None:
    results = run_replicas(object_results, 2)
    for replica, got in enumerate(results):
        assert _same(got["gathered"], [_metrics(0), _metrics(1)]), (replica, got["gathered"])
        assert _same(got["config"], CONFIG)
        assert got["word"] == "from 0"
        assert got["lengths"] == ["y" * 5, "y" * 70_005]
        gathered, broadcast = got["errors"]
        assert "replica(s) [1]" in gathered and "value['loss'] is a torch.Tensor" in gathered, gathered
        assert ".item()" in gathered
        assert "value of replica 0" in broadcast and "builtins.object" in broadcast, broadcast
        assert got["in_step"] == 2


def test_one_replica_encodes_as_many_do() -> None:
    ctx = rp.Replicator().context
    assert _same(ctx.all_gather_object(_metrics(0)), [_metrics(0)])
    assert _same(ctx.broadcast_object(CONFIG), CONFIG)
    with pytest.raises(objects.UnencodableError, match=r"value\['model'\]\[1\] is a .*Linear"):
        ctx.broadcast_object({"model": [1, torch.nn.Linear(1, 1)]})


def test_decoding_builds_nothing_but_plain_values() -> None:
    for payload in (b'{"__reduce__": []}', b'[1, 2]', b'{"list": 3}', b"\x80\x04K\x01."):  # the last: a pickle
        with pytest.raises(ValueError):
            objects.decode(payload)
