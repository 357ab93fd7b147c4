"""A pipeline stage's recomputed forward that raises leaves no saved-tensor hooks behind, whatever the torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from replicator.pipeline import recompute


class Raising(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in forward")


@pytest.fixture
def leaky_checkpoint(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch.utils.checkpoint as torch 2.11 behaves when the forward raises: its saved-tensor hooks stay pushed
    (there, until the error is freed). Returns how many tensors those hooks were handed."""
    packed: list[int] = []

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t)
        hooks.__enter__()
        output = function(*args)  # an exception leaves the hooks pushed, as that torch's generator did
        hooks.__exit__(None, None, None)
        return output

    monkeypatch.setattr(recompute, "checkpoint", checkpoint)
    return packed


def test_a_raising_recomputed_forward_raises_its_error_and_leaves_no_hooks_pushed(leaky_checkpoint: list[int]
                                                                                    ) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="boom in forward") as caught:  # `caught` keeps the error alive, as a
        recompute.run_forward(Raising(), x, recompute=True)                # failed pipeline step keeps its error
    leaky_checkpoint.clear()
    (x * x).sum().backward()  # mul saves its inputs: into the failed frame's hooks, were they still pushed
    assert leaky_checkpoint == [], caught.value


def test_a_recomputed_forward_that_raises_in_backward_still_raises_there() -> None:
    calls = {"n": 0}

    class FailsOnRecompute(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            if recompute.is_recomputing():
                raise RuntimeError("boom in recomputation")
            return torch.tanh(x)

    x = torch.randn(3, 4, requires_grad=True)
    output = recompute.run_forward(FailsOnRecompute(), x, recompute=True)
    with pytest.raises(RuntimeError, match="boom in recomputation"):
        output.sum().backward()
    assert calls["n"] == 2
