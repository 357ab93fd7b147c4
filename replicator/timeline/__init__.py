"""The timeline: what every process did when during run(), recorded as spans and merged into one Chrome trace.

`recorder` holds the spans (the core records into it only while a run records); `hooks` times the
forward and backward passes of the model; `trace` writes Chrome-trace JSON; `session` is what
run(timeline=...) hands off to: it starts the recording, then merges every process's spans.
"""

from replicator.timeline.recorder import Recorder, Span, active, clock, span

__all__ = ["Recorder", "Span", "active", "clock", "span"]
