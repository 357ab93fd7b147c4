"""A report over run records: the runs read and checked, a summary per run, its plots, and the scaling series."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from replicator.report import plots
from replicator.report.runs import ReportError, Run, load_run
from replicator.report.scaling import Link, ScalingSeries, cached_link, predicted_efficiency, scaling_series
from replicator.report.summary import describe_run, describe_scaling

__all__ = ["Report", "make_report"]


@dataclass
class Report:
    """What `replicator report` prints (`lines`) and the PNGs it wrote (`files`)."""

    runs: list[Run]
    series: list[ScalingSeries]
    lines: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


def _destination(out: Path | None, run: Run, name: str) -> Path:
    return run.path / name if out is None else out / f"{run.name}-{name}"


def make_report(paths: Sequence[str | Path], out: str | Path | None = None,
                measure_link: Callable[[], Link] | None = None, recalibrate: bool = False) -> Report:
    """Read the run records at `paths` (ReportError on the first that is not a finished one), summarize each and
    plot it into its directory (or `out`); for runs of one configuration at several replica counts, plot the
    scaling efficiency beside the planner's prediction on this machine's link (stored, or `measure_link()`;
    without either, no prediction)."""
    seen: dict[Path, Run] = {}
    for path in paths:
        run = load_run(path)
        seen.setdefault(run.path.resolve(), run)
    runs = list(seen.values())
    destination = None if out is None else Path(out)
    if destination is not None:
        try:
            destination.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ReportError(f"{destination}: cannot create the output directory ({error})") from None
    report = Report(runs, scaling_series(runs))
    member_of = {id(run): series for series in report.series for run in series.runs.values()}
    for run in runs:
        report.lines += describe_run(run, member_of.get(id(run)))
        for plot, name in ((plots.plot_loss, "loss.png"), (plots.plot_throughput, "throughput.png"),
                           (plots.plot_breakdown, "breakdown.png")):
            written = plot(run, _destination(destination, run, name))
            if written is not None:
                report.files.append(written)
    for series in report.series:
        if len(series.runs) < 2:
            continue
        where = destination or series.baseline.path.resolve().parent
        link = cached_link(where, measure_link, recalibrate)
        if link is not None:
            series.predicted = predicted_efficiency(series, link)
        report.lines += describe_scaling(series)
        if link is not None:
            report.lines.append(f"  planner: flat ring all-reduce over this machine's link (alpha "
                                f"{link.alpha * 1e6:.1f} us, beta {link.beta / 1e9:.2f} GB/s; {link.source})")
        name = "scaling.png" if len(report.series) == 1 else f"scaling-{series.baseline.name}.png"
        report.files.append(plots.plot_scaling(series, where / name))
    return report
