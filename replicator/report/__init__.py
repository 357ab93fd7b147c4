"""`replicator report`'s core: read run records, summarize them, plot them, and compare scaling with the planner."""

from replicator.report.compose import Report, make_report
from replicator.report.runs import ReportError, Run, load_run

__all__ = ["Report", "make_report", "Run", "load_run", "ReportError"]
