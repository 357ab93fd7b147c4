"""Checkpoint formats: values are the codec's tagged JSON, and checkpoints of format 1 still restore."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
import torch

from replicator import checkpoint, codec
from replicator.checkpoint import CheckpointError

# Written by replicator's format 1 (before values became replicator.codec's): the training below, saved at step 2.
FORMAT_1 = Path(__file__).parent / "data" / "format1"
INPUT = {"epoch": 1, "position": (3, 4), "seen": {7: "seven"}}
EXTRA = {"counts": collections.Counter({"a": 2, (1, 2): 3}), "note": "format 1"}


def trained(steps: int) -> tuple[torch.nn.Linear, torch.optim.SGD, torch.optim.lr_scheduler.StepLR]:
    """The fixture's training: element-wise arithmetic on set values only, so every CPU computes the same bits."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3) / 8)
        model.bias.copy_(torch.tensor([0.5, -0.25]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.875)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(steps):
        for param in model.parameters():
            param.grad = torch.full_like(param, 0.125 * (step + 1))
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def assert_restores_the_training(path: Path) -> None:
    expected_model, expected_optimizer, expected_scheduler = trained(2)
    model, optimizer, scheduler = trained(0)
    restored = checkpoint.restore(path, modules=model, optimizers=[optimizer], schedulers=[scheduler], rng=False)
    assert restored.step == 2
    assert restored.input_state == INPUT and type(restored.input_state["position"]) is tuple
    assert restored.extra == EXTRA and type(restored.extra["counts"]) is collections.Counter
    for got, want in zip(model.parameters(), expected_model.parameters()):
        assert torch.equal(got, want)
    for got, want in zip(optimizer.state.values(), expected_optimizer.state.values()):
        assert torch.equal(got["momentum_buffer"], want["momentum_buffer"])
    assert optimizer.param_groups[0]["lr"] == expected_optimizer.param_groups[0]["lr"] == 0.125
    assert scheduler.last_epoch == expected_scheduler.last_epoch == 2


def test_a_format_1_checkpoint_still_restores() -> None:
    assert json.loads((FORMAT_1 / "replicator.json").read_text())["format"] == 1
    assert_restores_the_training(FORMAT_1)


def test_values_are_written_as_the_codecs_tagged_json(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained(2)
    checkpoint.save(tmp_path, modules=model, optimizers=[optimizer], schedulers=[scheduler], step=2,
                    input_state=INPUT, extra=EXTRA)
    job = json.loads((tmp_path / "replicator.json").read_text())
    assert job["format"] == 2
    assert job["extra"] == codec.tagged(EXTRA)
    assert {key: codec.untagged(value) for key, value in job["input"].items()} == INPUT
    assert_restores_the_training(tmp_path)


def test_a_checkpoint_of_an_unknown_format_is_refused_naming_its_file(tmp_path: Path) -> None:
    shutil.copytree(FORMAT_1, tmp_path / "newer")
    job_file = tmp_path / "newer" / "replicator.json"
    job_file.write_text(json.dumps({**json.loads(job_file.read_text()), "format": 99}))
    model, optimizer, scheduler = trained(0)
    with pytest.raises(CheckpointError, match=r"newer/replicator.json has checkpoint format 99; this replicator reads"):
        checkpoint.restore(tmp_path / "newer", modules=model, optimizers=[optimizer], schedulers=[scheduler])


@pytest.mark.parametrize("payload", [b'{"dict": [[1]]}', b'{"set": [1]}', b'[1, 2]', b'{"dict": [[[1], 2]]}'])
def test_the_codec_refuses_what_it_did_not_write(payload: bytes) -> None:
    with pytest.raises(ValueError, match="not a value encoded by replicator"):
        codec.decode(payload)


def test_the_codec_round_trips_every_type_it_writes() -> None:
    value = {"a": [1, 2.5, None, True], (1, "x"): (b"\x00\xff", {"n": float("inf")}), 3: collections.Counter("aab")}
    back = codec.decode(codec.encode(value))
    assert back == value and type(back[3]) is collections.Counter and type(back[(1, "x")]) is tuple
