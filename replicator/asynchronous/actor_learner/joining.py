"""rp.join_actor: an actor that joins a running actor–learner job from outside its torch.distributed world.

A restarted actor, or one more machine's worth of actors, reaches the job through the store at
the job's MASTER_ADDR:MASTER_PORT alone: it finds the newest actor–learner job there, the run in
progress and the learners' published link addresses and token, connects, and streams its
transitions as the job's own actors do. It takes the place of actor `actor` (0 .. actors - 1):
a slot whose process died, or one that never started. The learners never stop for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from replicator import _env
from replicator.asynchronous.actor_learner import exchange
from replicator.asynchronous.actor_learner.actor import ActorContext, ActorLearnerError
from replicator.asynchronous.actor_learner.replay import Replay
from replicator.asynchronous.actor_learner.roles import Roles
from replicator.asynchronous.actor_learner.variables import VariableSink
from replicator.comm.peer_link import PeerLinkError
from replicator.errors import ReplicatorUsageError

__all__ = ["join_actor"]


def join_actor(actor_fn: Callable[[ActorContext], Any], modules: torch.nn.Module | Iterable[torch.nn.Module],
               replay: Replay, *, actor: int, address: str | None = None, update_period: int = 1,
               timeout_s: float | None = None) -> dict[str, Any]:
    """Run `actor_fn(actor_context)` as actor number `actor` of the running job at `address` ("host:port", default
    MASTER_ADDR:MASTER_PORT from the environment); return its figures once the learners finish.

    `modules` are built as the job's processes build them in `repl.scope()` (the weights the actor pulls land in
    them), and `replay` takes the job's arguments (its n_step, discount and seed shape the transitions).
    """
    address = address or f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ReplicatorUsageError(f"rp.join_actor(address={address!r}) needs 'host:port': the job's MASTER_ADDR and "
                                   "MASTER_PORT")
    timeout_s = _env.timeout_s() if timeout_s is None else timeout_s
    store = exchange.join_store(host, int(port), timeout_s)
    store.wait([exchange.Keys.shape, exchange.Keys.run])
    if store.check([exchange.Keys.transport]) and store.get(exchange.Keys.transport) == b"gloo":
        raise ReplicatorUsageError(
            f"rp.join_actor(address={address!r}): that job carries its actor–learner links over Gloo "
            "(REPLICATOR_PEER_LINK=0 on some process, or one that could not open a socket), and a Gloo link cannot "
            "take a process that joins later; run the job with sockets (unset REPLICATOR_PEER_LINK) to add actors")
    exchange.adopt(store)
    learners, actors, evaluator = (int(x) for x in store.get(exchange.Keys.shape).decode("ascii").split())
    if not 0 <= actor < actors:
        raise ReplicatorUsageError(f"rp.join_actor(actor={actor}): the job at {address} has actors 0 .. {actors - 1}")
    roles = Roles(learners, actors, bool(evaluator), rank=learners + actor)  # its slot's rank, to name it alike
    run = int(store.get(exchange.Keys.run).decode("ascii"))
    sink = VariableSink([modules] if isinstance(modules, torch.nn.Module) else list(modules))
    try:
        context = ActorContext(roles, replay, sink, update_period, run, timeout_s)
    except PeerLinkError as error:
        raise ActorLearnerError(f"{roles.describe()} could not join the job at {address}: {error}") from error
    torch.manual_seed(context.seed)
    try:
        context.update_weights()
        actor_fn(context)
    except BaseException:
        context.close()
        raise
    context.say_goodbye()
    return {"actor": actor, "run": run, "env_steps": context.env_steps, "version": context.version,
            "seconds": time.monotonic() - context.started, **context.figures}
