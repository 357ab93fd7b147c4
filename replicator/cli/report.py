"""`replicator report RUN_DIR [RUN_DIR ...]`: summarize run records and plot them (replicator.report)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replicator.report.scaling import Link

__all__ = ["add_parser", "main"]


def _measure_link() -> Link:
    """This machine's loopback Gloo link, measured between 2 local processes (replicator.plan.calibrate)."""
    from replicator.plan.calibrate import calibrate
    from replicator.report.scaling import Link
    from replicator.testing import run_replicas

    print("replicator report: measuring this machine's all-reduce link for the planner (a few seconds)...",
          file=sys.stderr, flush=True)
    measured = calibrate(run_replicas)
    return Link(measured.alpha, measured.beta, "measured now between 2 local processes")


def main(options: argparse.Namespace) -> int:
    """Run `replicator report`; 0 on success, 2 on a path that is not a finished run record."""
    from replicator.report import ReportError, make_report

    try:
        report = make_report(options.runs, options.out, None if options.no_prediction else _measure_link,
                             options.recalibrate)
    except ReportError as error:
        print(f"replicator report: {error}", file=sys.stderr)
        return 2
    print("\n".join(report.lines))
    print("plots: " + ", ".join(str(path) for path in report.files))
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `replicator report` with its options; the parsed options run `main`."""
    parser = commands.add_parser(
        "report", help="summarize run records (throughput, efficiency, where time went) and plot them",
        description="Summarize the run records that repl.run() writes (runs/<time>-<name>) and plot loss, "
                    "throughput, the step-time breakdown per replica and, over runs at several replica counts, "
                    "the scaling efficiency against the ideal and the planner's prediction.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by repl.run()")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write every PNG here (default: each run's into its directory, the scaling plot "
                             "beside the runs)")
    parser.add_argument("--no-prediction", action="store_true",
                        help="leave out the planner's prediction (no measurement of this machine's link)")
    parser.add_argument("--recalibrate", action="store_true",
                        help="measure the link again instead of reading the stored calibration.json")
    parser.set_defaults(run=main)
