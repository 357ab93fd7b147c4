"""The Gantt chart's legend names every kind of bar it draws."""

from __future__ import annotations

from pathlib import Path

import pytest

from replicator.pipeline import make_schedule
from replicator.pipeline.timeline import events_from_simulation, plot_gantt


def test_the_legend_names_sends_as_well_as_receives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    labels: list[str] = []
    draw_legend = Axes.legend

    def legend(self: Axes, *args: object, handles: list, **kwargs: object) -> object:
        labels.extend(handle.get_label() for handle in handles)
        return draw_legend(self, *args, handles=handles, **kwargs)

    monkeypatch.setattr(Axes, "legend", legend)
    events = events_from_simulation(make_schedule("1f1b", 2, 4))
    assert {e.op for e in events} >= {"send_activation", "send_gradient"}, "the chart draws send bars"
    plot_gantt(events, tmp_path / "gantt.png", time_unit="time units")
    assert labels == ["forward", "backward", "receive (waiting)", "send"]
    labels.clear()
    plot_gantt(events, tmp_path / "compute.png", show_communication=False, time_unit="time units")
    assert labels == ["forward", "backward"]
