"""Where a run's events go: ``Sinks([MetricsFile(...), Terminal(...), TensorBoard(...),
GoodputFile(...)])``. The loop only calls ``sinks.emit(event)``; a sink handles the kinds
it has an ``on_<kind>`` method for and ignores the rest.

In your own loop, TensorBoard takes three lines::

    sinks = jaxdist.sinks.Sinks([jaxdist.sinks.TensorBoard("runs/mine/tb")])
    sinks.log(step, dp.metrics(metrics))  # every step, or every N
    sinks.close()
"""

from __future__ import annotations

from jaxdist.sinks.events import (
    CheckpointSaved,
    Compiled,
    EvalMetrics,
    Event,
    Note,
    Resumed,
    Started,
    StepFlops,
    StepMetrics,
    StepStarting,
    Stopped,
)


class Sink:
    """Handles an event by its ``on_<kind>`` method, if it has one."""

    def handle(self, event: Event) -> None:
        method = getattr(self, "on_" + event.kind, None)
        if method is not None:
            method(event)

    def close(self) -> None:
        """Flushes and releases files; called once, also after a failure."""


class Sinks:
    """The sinks of a run, called in order (a file sink before the terminal, so that a
    line printed about a step is already on disk)."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            sink.handle(event)

    def log(self, step: int, values: dict) -> None:
        """A logged step from a custom loop: ``values`` is a dict of Python numbers."""
        self.emit(StepMetrics(step, {"step": step, **values}))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def __getattr__(name: str):
    # The sinks that import heavier packages (rich, tensorboard, jax.profiler) load on use.
    modules = {
        "MetricsFile": "jsonl",
        "json_line": "jsonl",
        "Terminal": "terminal",
        "TensorBoard": "tensorboard",
        "GoodputFile": "goodput",
        "Ledger": "goodput",
        "Profiler": "profiler",
        "Summary": "summary",
    }
    if name not in modules:
        raise AttributeError(f"module 'jaxdist.sinks' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"jaxdist.sinks.{modules[name]}"), name)


__all__ = [
    "CheckpointSaved",
    "Compiled",
    "EvalMetrics",
    "Event",
    "GoodputFile",
    "Ledger",
    "MetricsFile",
    "Note",
    "Profiler",
    "Resumed",
    "Sink",
    "Sinks",
    "Started",
    "StepFlops",
    "StepMetrics",
    "StepStarting",
    "Stopped",
    "Summary",
    "TensorBoard",
    "Terminal",
    "json_line",
]
