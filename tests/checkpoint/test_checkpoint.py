"""Checkpoints: a restored run continues exactly, reshards across replica counts and stages, refuses bad input."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import replicator as rp
from replicator import checkpoint
from replicator.checkpoint import CheckpointError, CheckpointMismatchError, Layout
from replicator.testing import run_replicas

from _numerics import assert_within, training_bound

GLOBAL_BATCH = 16
# The longest sum behind one gradient element in a step: the batch's 16 rows (in 4, 2 or 1 shards, or in 2 chunks
# of a pipeline), the widest fan-in of the backward (16), plus the loss's mean and the optimizer's update.
LENGTH = GLOBAL_BATCH + 16 + 4


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


class Trainer:
    """One process's model, Adam, StepLR and a training step that uses every generator."""

    def __init__(self, seed: int = 0, model: torch.nn.Module | None = None, repl: rp.Replicator | None = None) -> None:
        torch.manual_seed(seed)
        self.model = model if model is not None else small_model()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        if repl is not None:
            repl.wrap_optimizer(self.optimizer)  # before the scheduler, which wraps optimizer.step too
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        if repl is not None:
            repl.wrap_scheduler(self.scheduler)

    def objects(self) -> dict:
        return {"modules": self.model, "optimizers": [self.optimizer], "schedulers": [self.scheduler]}

    def step(self, step: int, share: slice = slice(None), noise: bool = True) -> None:
        x, y = batch(step)
        x = x[share]
        if noise:  # draws from the Python and NumPy streams, which a restore must bring back too
            x = x + 0.01 * random.random() + 0.01 * float(np.random.rand())
        loss = F.cross_entropy(self.model(x), y[share])  # dropout: the torch stream
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()

    def snapshot(self) -> dict[str, torch.Tensor]:
        state = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for number, entry in self.optimizer.state_dict()["state"].items():
            state.update({f"optim.{number}.{k}": v.clone() for k, v in entry.items()})
        return state


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_a_restored_run_continues_exactly_as_an_uninterrupted_one(tmp_path: Path) -> None:
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    trainer = Trainer()
    for step in range(3):
        trainer.step(step)
    checkpoint.save(tmp_path / "ck", **trainer.objects(), step=3, input_state={"epoch": 1, "batches": 3},
                    extra={"note": "hi"})
    for step in range(3, 6):
        trainer.step(step)
    uninterrupted = trainer.snapshot()

    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # everything a fresh process could differ in
    fresh = Trainer(seed=1)
    restored = checkpoint.restore(tmp_path / "ck", **fresh.objects())
    assert (restored.step, restored.input_state, restored.extra) == (3, {"epoch": 1, "batches": 3}, {"note": "hi"})
    assert restored.rng_restored
    for step in range(restored.step, 6):
        fresh.step(step)
    assert_identical(fresh.snapshot(), uninterrupted)
    assert fresh.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()


def test_an_interrupted_save_leaves_the_previous_checkpoint_in_use(tmp_path: Path) -> None:
    trainer = Trainer()
    saved = {}
    for step in range(1, 5):
        trainer.step(step)
        checkpoint.save(checkpoint.step_path(tmp_path, step), **trainer.objects(), step=step, keep=2)
        saved[step] = trainer.snapshot()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000003", "step_000000004"]

    trainer.step(5)

    def crash(partial: Path) -> None:
        raise KeyboardInterrupt("killed while writing")  # what a process sees of SIGKILL: nothing after this

    checkpoint._after_write = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save(checkpoint.step_path(tmp_path, 5), **trainer.objects(), step=5, keep=2)
    finally:
        checkpoint._after_write = None
    assert (tmp_path / "step_000000005.partial").is_dir()
    assert checkpoint.latest(tmp_path) == checkpoint.step_path(tmp_path, 4)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checkpoint.restore(tmp_path / "step_000000005.partial", **Trainer().objects())
    fresh = Trainer(seed=3)
    assert checkpoint.restore(checkpoint.latest(tmp_path), **fresh.objects()).step == 4
    assert_identical(fresh.snapshot(), saved[4])

    # The next save clears the abandoned directory.
    checkpoint.save(checkpoint.step_path(tmp_path, 6), **trainer.objects(), step=6, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004", "step_000000006"]


def test_a_different_model_fails_with_the_keys_that_differ(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.step(0)
    checkpoint.save(tmp_path, **trainer.objects(), step=1)
    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with pytest.raises(CheckpointMismatchError) as caught:
        checkpoint.restore(tmp_path, modules=other)
    message = str(caught.value)
    assert "missing from the checkpoint: model.2.bias, model.2.weight" in message
    assert "in the checkpoint but not in the model: model.1.bias" in message and "model.4.weight" in message
    assert "model.0.weight (checkpoint (16, 6), model (8, 6))" in message

    same = Trainer()
    sgd = torch.optim.SGD(same.model.parameters(), lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="optimizer 0 is a SGD but .* from a Adam"):
        checkpoint.restore(tmp_path, modules=same.model, optimizers=[sgd])


class _Exploit:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch pwned",))


def test_loading_never_unpickles_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer()
    checkpoint.save(tmp_path, **trainer.objects(), step=0)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        checkpoint.restore(tmp_path, **Trainer().objects())
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(CheckpointError, match="JSON values"):
        checkpoint.save(tmp_path / "b", modules=trainer.model, extra={"callback": print})


# -- resharding: 4 replicas write, 2 and 1 read ------------------------------------------
def replicated(directory: str, saved_steps: int, more_steps: int) -> dict[str, torch.Tensor]:
    """Restore `directory` if it holds a checkpoint, else train `saved_steps` and save; then train `more_steps`."""
    repl = rp.Replicator()
    with repl.scope():
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        trainer = Trainer(model=model, repl=repl)
    share = repl.context.num_replicas
    rows = slice(repl.replica_id * GLOBAL_BATCH // share, (repl.replica_id + 1) * GLOBAL_BATCH // share)
    layout = Layout(repl.replica_id, repl.num_replicas)
    if checkpoint.latest(directory) is None:
        for step in range(saved_steps):
            trainer.step(step, rows, noise=False)
        checkpoint.save(checkpoint.step_path(directory, saved_steps), **trainer.objects(), step=saved_steps,
                        layout=layout, group=repl.groups.control)
        start = saved_steps
    else:
        restored = checkpoint.restore(checkpoint.latest(directory), **trainer.objects(), layout=layout,
                                      group=repl.groups.control)
        start = restored.step
    for step in range(start, start + more_steps):
        trainer.step(step, rows, noise=False)
    return trainer.snapshot()


def test_four_replicas_restore_on_two_and_on_one(tmp_path: Path) -> None:
    four = run_replicas(replicated, 4, str(tmp_path), 3, 2, timeout_s=180)[0]
    two = run_replicas(replicated, 2, str(tmp_path), 3, 2, timeout_s=180)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000000003"]  # the 2-replica run restored, wrote nothing
    # Both go on from the same saved bits for 2 steps, their batches cut in 4 and in 2.
    tolerance = training_bound(torch.float32, list(four.values()), LENGTH, steps=2)
    for key in four:
        assert_within(two[0][key], four[key], tolerance, key)
        assert torch.equal(two[0][key], two[1][key])

    # One process, as for evaluation: the parameters are exactly those saved, and training on goes on alike.
    alone = Trainer(seed=5, model=torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))
    restored = checkpoint.restore(checkpoint.latest(tmp_path), **alone.objects())
    assert restored.saved_layout.num_replicas == 4 and restored.rng_restored  # replica 0's streams
    for step in range(3, 5):
        alone.step(step, noise=False)
    for key, value in alone.snapshot().items():
        assert_within(value, four[key], tolerance, key)


# -- pipelines: a 2-stage checkpoint restores into the unsplit model ----------------------------
def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]


def pipeline_stage(directory: str) -> dict[str, torch.Tensor]:
    repl = rp.Replicator(stages=2, chunks=2)
    with repl.scope():
        pipe = repl.pipeline(layers(), balance=[2, 3])
        optimizer = repl.wrap_optimizer(torch.optim.Adam(pipe.parameters(), lr=0.01))
    layout = Layout(repl.replica_id, repl.num_replicas, repl.stage_id, repl.num_stages)

    def train(step: int) -> None:
        x, y = batch(step)
        optimizer.zero_grad()
        pipe.train_step(x, y, F.cross_entropy)
        optimizer.step()

    for step in range(2):
        train(step)
    checkpoint.save(directory, modules={"model": pipe.module}, optimizers=[optimizer], step=2, layout=layout,
                    group=repl.groups.control)
    train(2)
    params = {f"model.{k}": v.detach().clone() for k, v in pipe.module.state_dict().items()}
    # Only stage 1 restores the wrong model: both stages must raise, neither may wait for the other.
    wrong = pipe.module if repl.stage_id == 0 else torch.nn.Sequential(torch.nn.Linear(2, 2))
    try:
        checkpoint.restore(directory, modules={"model": wrong}, layout=layout, group=repl.groups.control)
    except CheckpointError as error:
        return params, f"{type(error).__name__}: {error}"
    return params, "restored"


def test_a_pipeline_checkpoint_restores_into_the_unsplit_model(tmp_path: Path) -> None:
    results = run_replicas(pipeline_stage, 2, str(tmp_path), timeout_s=180)
    stages = [params for params, _ in results]
    assert results[0][1].startswith("CheckpointError: another process could not restore")
    assert results[1][1].startswith("CheckpointMismatchError:")
    assert "model.0.weight (checkpoint (16, 6), model (2, 2))" in results[1][1]
    assert {k for stage in stages for k in stage} == {f"model.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}
    model = torch.nn.Sequential(*layers())
    torch.nn.init.zeros_(model[0].weight)  # anything: the checkpoint overwrites it
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    restored = checkpoint.restore(tmp_path, modules=model, optimizers=[optimizer])
    assert restored.step == 2 and restored.saved_layout.num_stages == 2
    x, y = batch(2)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # Adam's moments came from the two stages: otherwise this step would differ
    # From the same saved bits, one step: the whole batch at once here, in 2 chunks on the stages.
    tolerance = training_bound(torch.float32, [v for stage in stages for v in stage.values()], LENGTH, steps=1)
    for stage in stages:
        for key, value in stage.items():
            assert_within(model.state_dict()[key[len("model."):]], value, tolerance, key)


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.Adafactor(params, lr=0.01),  # factored second moments: (rows, 1) and (1, cols)
    lambda params: torch.optim.ASGD(params, lr=0.01),  # scalar tensors beside the parameter-shaped one
    lambda params: torch.optim.Adam(params, lr=0.01, amsgrad=True),  # a key that an option adds
    lambda params: torch.optim.SGD(params, lr=0.01),  # no state at all
    lambda params: torch.optim.Rprop(params, lr=0.01),
], ids=["adafactor", "asgd", "adam-amsgrad", "sgd-no-momentum", "rprop"])
def test_every_torch_optimizer_state_restores_past_the_check_of_its_keys_and_shapes(tmp_path: Path, make: Any) -> None:
    """restore() predicts the state each torch optimizer keeps to refuse a checkpoint missing part of it: the
    prediction must accept every legitimate state, whatever its shapes."""
    def trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        optimizer = make(model.parameters())
        for step in range(steps):
            x, y = batch(step)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        return model, optimizer

    model, optimizer = trained(0, 2)
    checkpoint.save(tmp_path / "ck", modules=model, optimizers=[optimizer], step=2)
    fresh_model, fresh_optimizer = trained(1, 0)
    checkpoint.restore(tmp_path / "ck", modules=fresh_model, optimizers=[fresh_optimizer])
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["state"].keys() == restored["state"].keys()
    for number, entry in saved["state"].items():
        assert entry.keys() == restored["state"][number].keys()
        for key, value in entry.items():
            got = restored["state"][number][key]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, (number, key)
