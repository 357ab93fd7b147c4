"""StageHooks around train_step, recompute= and its deprecated name, one bubble for simulated and measured."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from replicator.pipeline import PipelineError, PipelineStage, StageHooks, build_pipeline
from replicator.pipeline.outcome import Outcome
from replicator.pipeline.schedule import make_schedule, simulated_bubble, timed_simulation
from replicator.pipeline.timeline import events_from_simulation, measured_bubble


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)]


def recording_hooks(calls: list[str]) -> StageHooks:
    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        calls.append("hold")
        try:
            yield
        finally:
            calls.append("leave hold")

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        calls.append("no_sync")
        yield

    def agree(failure: str | None) -> list[Outcome]:
        calls.append("agree: succeeded" if failure is None else f"agree: {failure}")
        return [] if failure is None else [Outcome(replica=0, stage=0, failure=failure)]

    return StageHooks(no_sync=no_sync, hold_gradients=hold, agree_on_outcome=agree,
                      release_gradients=lambda: calls.append("release"),
                      abandon_gradients=lambda: calls.append("abandon"))


def test_hooks_run_in_the_order_the_facade_needs() -> None:
    calls: list[str] = []
    pipe = build_pipeline(layers(), stage_id=0, num_stages=1, chunks=3, hooks=recording_hooks(calls))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    pipe.train_step(x, y, F.cross_entropy)
    assert calls == ["hold", "no_sync", "no_sync", "leave hold", "agree: succeeded", "release"]

    calls.clear()
    with pytest.raises(PipelineError, match="failed on every replica alike: .*loss_fn must return a scalar") as caught:
        pipe.train_step(x, y, lambda output, target: output)
    # Every process hears of the failure; the held averaging is dropped, never released.
    assert calls == ["hold", "leave hold", f"agree: {caught.value.reason}", "abandon"]
    assert caught.value.reason.startswith("stage 0 of 1 (rank 0) failed: ValueError: loss_fn must return")


def test_no_sync_keyword_folds_into_the_hooks() -> None:
    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        yield

    pipe = build_pipeline(layers(), stage_id=0, num_stages=1, no_sync=quiet)
    assert pipe.hooks.no_sync is quiet and pipe.hooks.hold_gradients is None
    with pytest.raises(ValueError, match="not both"):
        PipelineStage(nn.Sequential(*layers()), stage_id=0, num_stages=1, no_sync=quiet,
                      hooks=StageHooks(no_sync=contextlib.nullcontext))


def test_checkpoint_keyword_still_works_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="recompute="):
        pipe = build_pipeline(layers(), stage_id=0, num_stages=1, checkpoint="always")
    assert pipe.recompute == "always"
    with pytest.warns(DeprecationWarning):
        stage = PipelineStage(nn.Sequential(*layers()), stage_id=0, num_stages=1, checkpoint="never")
    assert stage.recompute == "never"
    with pytest.raises(ValueError, match="recompute must be one of"):
        build_pipeline(layers(), stage_id=0, num_stages=1, recompute="sometimes")
    with pytest.warns(DeprecationWarning, match="RECOMPUTE_MODES"):
        from replicator.pipeline import CHECKPOINT_MODES
    assert CHECKPOINT_MODES == ("always", "except_last", "never")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_and_measured_bubble_agree_on_the_same_intervals(name: str) -> None:
    placed = timed_simulation(make_schedule(name, 3, 5), 1.0, 2.0)
    assert measured_bubble(events_from_simulation(placed)) == simulated_bubble(placed)
    assert simulated_bubble(placed) > 0
