"""Sharded checkpoints cross replica counts and shard levels, and training resumes from them exactly (issue 29, item 5).

The matrix: a checkpoint saved at N = 4 with shard="optimizer" restores at N = 1, 2, 3 with shard=None and
shard="parameters"; checkpoints saved there, at each of those levels, restore at N = 4 with shard="optimizer".
AdamW and SGD with momentum both cross it in both directions (KIND_AT).

What a restore must give, and why each reference is honest:

- The restored state (parameters, every optimizer state tensor, step counts, hyperparameters), gathered whole
  and keyed by parameter name, equals bit for bit the state the saving run held: the checkpoint is layout-free.
- Training resumed from it equals bit for bit an uninterrupted run at the restoring N and level that passes
  through the same state. A run at N' cannot train its way into a state computed at N = 4 (its gradient sums
  run in another order), so that run is handed the saved state in memory, through torch alone: copies into the
  parameters, torch's own Optimizer.load_state_dict, DTensor's distribute_tensor for FSDP2's shards. No
  replicator checkpoint code touches it. At N = 4 the reference is shard=None, which shard="optimizer" equals
  bit for bit at the same N (tests/sync/test_sharding.py), so not even ShardedOptimizer.load_state_dict is in it.
- At the same N and level, a run that saves at step SAVED_AT and goes on, and another run restoring that
  save, agree bit for bit from there on: the plain resume.
- Across different N only rounding separates runs: every one stays within ONE_PROCESS_ATOL of one process.

Each (N, role) is one run_replicas call whose processes run every trajectory of that cell one after another.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

import replicator as rp
from replicator.checkpoint import CheckpointError
from replicator.testing import run_replicas

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4
SAVED_AT = 2  # the step a checkpoint is written after
STEPS = 4
LRS = (0.02, 0.05)  # small enough that the bound below is inside the promised 1e-6
EPS = torch.finfo(torch.float32).eps
# Against one process: every update moves a parameter by at most lr (Adam's |m / sqrt(v)| <= ~1; SGD's
# |grad| < 1 here), in a direction that differs from one process's by the roundings on its way, bounded by
# 32 ulps relative: the batch sum in another order (log2(GLOBAL_BATCH) < 4), the sum over replicas (<= 2),
# the moments, root and quotient (~10), doubled for the momentum that carries earlier steps'. STEPS updates
# add up; a run that changes N at SAVED_AT has rounded differently on each side, inside the same bound
# (the derivation of tests/sync/test_sharding.py). 7.6e-7 here, within the 1e-6 that sharding promises.
ONE_PROCESS_ATOL = STEPS * max(LRS) * 32 * EPS
assert ONE_PROCESS_ATOL <= 1e-6
FOUR = 4
FEWER = (1, 2, 3)
LEVELS = (None, "parameters")  # restored from N = 4's shard="optimizer", and saved for the way back
KIND_AT = {1: "adamw", 2: "sgd", 3: "adamw"}  # the optimizer each smaller N trains
KINDS = ("adamw", "sgd")
TIMEOUT_S = 300  # generous: the machine running the suite may be shared


class Net(torch.nn.Module):
    """Tensors that split unevenly over 3 and 4 replicas, and one of a single element (fewer than the replicas)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(5, 7)
        self.head = torch.nn.Linear(7, 5)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x))) * self.scale


class OwnAdamW(torch.optim.AdamW):
    """An optimizer of the user's own (outside torch.optim): restore cannot predict the state it keeps."""


def make_optimizer(kind: str, model: Net) -> torch.optim.Optimizer:
    """Two parameter groups with different learning rates, interleaved in the buckets' order."""
    groups = [{"params": [model.embed.weight, model.head.bias], "lr": LRS[0]},
              {"params": [model.embed.bias, model.head.weight, model.scale], "lr": LRS[1]}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=LRS[0], momentum=0.9, weight_decay=0.01)
    return (OwnAdamW if kind == "own" else torch.optim.AdamW)(groups, lr=LRS[0], weight_decay=0.1)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 5, generator=generator), torch.randn(GLOBAL_BATCH, 5, generator=generator)


def my_batch(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    share = GLOBAL_BATCH // replicas
    return x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole on every replica: FSDP2's shards gathered (a collective: every replica calls it alike)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_state(model: Net, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters and optimizer state, whole and by parameter name: what a layout-free checkpoint must carry."""
    names = {id(param): name for name, param in model.named_parameters()}
    listed = [param for group in optimizer.param_groups for param in group["params"]]
    saved = optimizer.state_dict()  # shard="optimizer": the whole state, gathered from every replica
    return {
        "params": {name: whole(param) for name, param in model.named_parameters()},
        "state": {names[id(listed[int(number)])]: {key: whole(value) if isinstance(value, torch.Tensor) else value
                                                   for key, value in entry.items()}
                  for number, entry in saved["state"].items()},
        "groups": [{**{k: v for k, v in group.items() if k != "params"},
                    "params": [names[id(listed[number])] for number in group["params"]]}
                   for group in saved["param_groups"]],
    }


def laid_out_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (whole) laid out as `param`: this replica's FSDP2 shard of it, cut locally, or a copy."""
    if isinstance(param, DTensor) and tuple(value.shape) == tuple(param.shape):
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value.clone()


def hand_over(model: Net, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a saved state into a fresh model and torch optimizer with torch alone (no replicator checkpoint code)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(laid_out_like(param, state["params"][name]))
    order = [name for group in state["groups"] for name in group["params"]]
    listed = [param for group in optimizer.param_groups for param in group["params"]]
    assert [id(params[name]) for name in order] == [id(param) for param in listed]  # numbered alike
    optimizer.load_state_dict({
        "state": {order.index(name): {key: laid_out_like(params[name], value) if isinstance(value, torch.Tensor)
                                      else value for key, value in entry.items()}
                  for name, entry in state["state"].items()},
        "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                          "params": [order.index(name) for name in group["params"]]} for group in state["groups"]],
    })


def trajectory(shard: str | None, kind: str, start: str | dict[str, Any] | None = None,
               save_to: str | None = None) -> dict[str, Any]:
    """Inside a replica: train to STEPS with `shard`, from scratch, from a checkpoint (a path) or from a state handed
    over in memory (a dict, as of step SAVED_AT); save at SAVED_AT to `save_to`. What it held along the way."""
    repl = rp.Replicator(shard=shard)
    with repl.scope():
        torch.manual_seed(0 if start is None else 1)  # other initial values where a start must replace them
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer(kind, model))
    found: dict[str, Any] = {"losses": {}}
    first = 0
    if isinstance(start, str):
        repl.restore(start)
        found["restored"] = full_state(model, optimizer)
    elif start is not None:
        hand_over(model, optimizer, start)
        first = SAVED_AT  # this run's step 0 is the uninterrupted run's step SAVED_AT

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> torch.Tensor:
        x, y = batch
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    batches = [my_batch(step, repl.replica_id, repl.num_replicas) for step in range(first, STEPS)]
    for step, loss in repl.run(step_fn, batches, steps=STEPS - first, record=False):
        found["losses"][first + step] = float(loss)
        if save_to is not None and repl.global_step == SAVED_AT:
            repl.save(save_to)
            found["saved"] = full_state(model, optimizer)
    found["final"] = full_state(model, optimizer)
    repl.close()
    return found


def at_four(directory: str) -> dict[str, dict[str, Any]]:
    """N = 4, shard="optimizer": each optimizer's uninterrupted run, saving at SAVED_AT."""
    return {kind: trajectory("optimizer", kind, save_to=f"{directory}/four-{kind}") for kind in KINDS}


def at_fewer(directory: str, replicas: int, saved_at_four: dict[str, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """N = 1, 2 or 3, each level: the uninterrupted run saving for the way back, its plain resume, and N = 4's
    checkpoint restored beside the run handed N = 4's saved state."""
    kind = KIND_AT[replicas]
    found = {}
    for level in LEVELS:
        own = f"{directory}/n{replicas}-{level}"
        found[level] = {"uninterrupted": trajectory(level, kind, save_to=own),
                        "resumed": trajectory(level, kind, start=own),
                        "from_four": trajectory(level, kind, start=f"{directory}/four-{kind}"),
                        "handed_four": trajectory(level, kind, start=saved_at_four[kind])}
    return found


def back_at_four(directory: str, saved: dict[tuple[int, str | None], dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """N = 4, shard="optimizer": every smaller N's checkpoint restored beside shard=None handed the same state,
    and N = 4's own checkpoint resumed."""
    found: dict[Any, dict[str, Any]] = {}
    for (replicas, level), state in saved.items():
        kind = KIND_AT[replicas]
        path = f"{directory}/n{replicas}-{level}"
        found[(replicas, level)] = {"from_fewer": trajectory("optimizer", kind, start=path),
                                    "handed_fewer": trajectory(None, kind, start=state)}
    for kind in KINDS:
        found[kind] = {"resumed": trajectory("optimizer", kind, start=f"{directory}/four-{kind}")}
    return found


def one_process(kind: str) -> dict[str, torch.Tensor]:
    """The whole batch each step, in plain torch."""
    torch.manual_seed(0)
    model = Net()
    optimizer = make_optimizer(kind, model)
    for step in range(STEPS):
        x, y = global_batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def same(a: Any, b: Any, where: str) -> None:
    """Bit for bit: the same keys, dtypes and values throughout."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        for key in a:
            same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def near_one_process(params: dict[str, torch.Tensor], kind: str, where: str) -> None:
    for name, expected in one_process(kind).items():
        gap = (params[name] - expected).abs().max()
        assert gap <= ONE_PROCESS_ATOL, f"{where}: {name} is {gap} from one process"


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded_checkpoints")


@pytest.fixture(scope="module")
def four(directory: Path) -> list[dict[str, dict[str, Any]]]:
    return run_replicas(at_four, FOUR, str(directory), timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def fewer(directory: Path, four: list[dict[str, dict[str, Any]]]) -> dict[int, list[dict[Any, dict[str, Any]]]]:
    handed = {kind: four[0][kind]["saved"] for kind in KINDS}
    return {replicas: run_replicas(at_fewer, replicas, str(directory), replicas, handed, timeout_s=TIMEOUT_S)
            for replicas in FEWER}


def test_four_replicas_sharding_the_optimizer_restore_on_fewer_unsharded_and_on_fsdp2(
        four: list[dict[str, dict[str, Any]]], fewer: dict[int, list[dict[Any, dict[str, Any]]]]) -> None:
    for replicas, results in fewer.items():
        kind = KIND_AT[replicas]
        saved = four[0][kind]["saved"]
        for replica, by_level in enumerate(results):
            for level, runs in by_level.items():
                where = f"N=4 {kind} shard='optimizer' -> N={replicas} shard={level!r}, replica {replica}"
                same(runs["from_four"]["restored"], saved, f"{where}: restored state")
                same(runs["handed_four"]["losses"], runs["from_four"]["losses"], f"{where}: losses")
                same(runs["handed_four"]["final"], runs["from_four"]["final"], f"{where}: final state")
                near_one_process(runs["from_four"]["final"]["params"], kind, where)


def test_checkpoints_of_fewer_replicas_restore_on_four_sharding_the_optimizer(
        directory: Path, four: list[dict[str, dict[str, Any]]],
        fewer: dict[int, list[dict[Any, dict[str, Any]]]]) -> None:
    saved = {(replicas, level): results[0][level]["uninterrupted"]["saved"]
             for replicas, results in fewer.items() for level in LEVELS}
    for replica, by_source in enumerate(run_replicas(back_at_four, FOUR, str(directory), saved, timeout_s=TIMEOUT_S)):
        for (replicas, level), state in saved.items():
            runs = by_source[(replicas, level)]
            kind = KIND_AT[replicas]
            where = f"N={replicas} {kind} shard={level!r} -> N=4 shard='optimizer', replica {replica}"
            same(runs["from_fewer"]["restored"], state, f"{where}: restored state")
            same(runs["handed_fewer"]["losses"], runs["from_fewer"]["losses"], f"{where}: losses")
            same(runs["handed_fewer"]["final"], runs["from_fewer"]["final"], f"{where}: final state")
            near_one_process(runs["from_fewer"]["final"]["params"], kind, where)
        for kind in KINDS:  # and N = 4's own checkpoint, resumed where it was written
            where = f"N=4 {kind} shard='optimizer' resumed, replica {replica}"
            resumed, uninterrupted = by_source[kind]["resumed"], four[replica][kind]
            same(resumed["restored"], uninterrupted["saved"], f"{where}: restored state")
            same(resumed["losses"], {s: v for s, v in uninterrupted["losses"].items() if s >= SAVED_AT}, where)
            same(resumed["final"], uninterrupted["final"], f"{where}: final state")
            near_one_process(uninterrupted["final"]["params"], kind, where)


def test_training_resumed_at_the_same_replica_count_and_level_is_bit_equal_to_the_uninterrupted_run(
        fewer: dict[int, list[dict[Any, dict[str, Any]]]]) -> None:
    for replicas, results in fewer.items():
        for replica, by_level in enumerate(results):
            for level, runs in by_level.items():
                where = f"N={replicas} shard={level!r}, replica {replica}"
                uninterrupted, resumed = runs["uninterrupted"], runs["resumed"]
                same(resumed["restored"], uninterrupted["saved"], f"{where}: restored state")
                after = {step: loss for step, loss in uninterrupted["losses"].items() if step >= SAVED_AT}
                same(resumed["losses"], after, f"{where}: losses")
                same(resumed["final"], uninterrupted["final"], f"{where}: final state")
                near_one_process(uninterrupted["final"]["params"], KIND_AT[replicas], where)


# -- a checkpoint whose layout cannot be read --------------------------------------------------------------------
# Damages of the optimizer's state, made before saving (an entry without exp_avg_sq; exp_avg saved as a replica's
# slice, as a sharded run that forgot to gather would; the same with an optimizer of the user's own), and of the
# files, made by the test after (a data file cut short, a record and DCP's .metadata overwritten).
DAMAGES = {"incomplete": "adamw", "slice": "adamw", "own_slice": "own", "cut": "adamw", "record": "adamw",
           "index": "adamw"}


def damaged_checkpoints(directory: str, kind: str) -> None:
    """Inside one process: `kind` for SAVED_AT steps, then a checkpoint for each damage made with `kind`."""
    repl = rp.Replicator()
    with repl.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = repl.wrap_optimizer(make_optimizer(kind, model))

    def step_fn(ctx: rp.ReplicaContext, batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    for _ in repl.run(step_fn, [my_batch(step, 0, 1) for step in range(SAVED_AT)], record=False):
        pass
    state = optimizer.state[model.head.weight]
    whole_state = dict(state)
    for damage in (damage for damage, by in DAMAGES.items() if by == kind):
        if damage == "incomplete":
            del state["exp_avg_sq"]
        elif damage.endswith("slice"):
            state["exp_avg"] = whole_state["exp_avg"].reshape(-1)[:12].clone()
        repl.save(f"{directory}/{damage}")
        state.clear()
        state.update(whole_state)
    repl.close()


def restore_damaged(directory: str, shard: str) -> dict[str, str]:
    """Inside a replica: restore each damaged checkpoint with `shard`; the error each raised (its type and message)."""
    found = {}
    for damage, kind in DAMAGES.items():
        repl = rp.Replicator(shard=shard)
        with repl.scope():
            model = Net()
            repl.wrap_optimizer(make_optimizer(kind, model))
        try:
            repl.restore(f"{directory}/{damage}")
            found[damage] = "restored"
        except CheckpointError as error:
            found[damage] = f"{type(error).__name__}: {error}"
        repl.close()
    return found


def test_a_checkpoint_whose_optimizer_layout_cannot_be_read_is_named_with_its_file_and_key_on_every_replica(
        tmp_path: Path) -> None:
    for kind in set(DAMAGES.values()):
        run_replicas(damaged_checkpoints, 1, str(tmp_path), kind, timeout_s=TIMEOUT_S)
    (data,) = (tmp_path / "cut").glob("*.distcp")
    os.truncate(data, data.stat().st_size // 2)  # a copy interrupted half-way
    (tmp_path / "record" / "stage0.json").write_text('{"optimizers": [')
    (tmp_path / "index" / ".metadata").write_bytes(b"\x80\x04 not a pickle any more")
    expected = {
        "incomplete": [f"{tmp_path / 'incomplete' / '.metadata'} lists _optim/model.head.weight/exp_avg_sq",
                       f"{tmp_path / 'incomplete' / 'stage0.json'}", "has no exp_avg_sq"],
        "slice": [f"_optim/model.head.weight/exp_avg (in {tmp_path / 'slice'}/__", "has shape (12,)",
                  "keeps exp_avg of shape (5, 7) for model.head.weight"],
        "cut": [f"{data} ends at byte {data.stat().st_size}", "the checkpoint's entry "],
        "record": [f"checkpoint file {tmp_path / 'record' / 'stage0.json'} cannot be read (JSONDecodeError"],
        "index": [f"{tmp_path / 'index' / '.metadata'} (DCP's index of the checkpoint's tensors) cannot be read"],
    }
    # What OwnAdamW keeps is not predicted: shard="parameters" refuses a state tensor not shaped as its parameter
    # (FSDP2 cuts shards from those only) while planning the load, shard="optimizer" while taking its slices.
    own_slice = {"parameters": [f"_optim/model.head.weight/exp_avg (in {tmp_path / 'own_slice'}/__",
                                "has shape (12,)"],
                 "optimizer": [f"checkpoint {tmp_path / 'own_slice'}: optimizer 0 (OwnAdamW) cannot take",
                               "state 'exp_avg' of Net.head.weight has shape (12,), neither its parameter's (5, 7)"]}
    for replicas, shard in ((FOUR, "optimizer"), (2, "parameters")):
        for replica, found in enumerate(run_replicas(restore_damaged, replicas, str(tmp_path), shard,
                                                     timeout_s=TIMEOUT_S)):
            for damage, parts in {**expected, "own_slice": own_slice[shard]}.items():
                where = f"{damage}, shard={shard!r}, replica {replica} of {replicas}: {found[damage]}"
                assert found[damage].startswith(("CheckpointError", "CheckpointMismatchError")), where
                assert all(part in found[damage] for part in parts), where
