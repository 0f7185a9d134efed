"""Where a run's events go: ``Sinks([MetricsFile(...), Terminal(...), TensorBoard(...),
GoodputFile(...)])``. The loop only calls ``sinks.emit(event)``; a sink handles the kinds
it has an ``on_<kind>`` method for and ignores the rest.

In your own loop, TensorBoard takes three lines::

    sinks = jaxdist.sinks.Sinks([jaxdist.sinks.TensorBoard("runs/mine/tb")])
    sinks.log(step, dp.metrics(metrics))  # every step, or every N
    sinks.close()
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from jaxdist.checkpoint.io_errors import writing
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
    """Handles an event by its ``on_<kind>`` method, if it has one. ``background``: the
    sink may run on the reporting thread (``Sinks(..., background=True)``); a sink whose
    work must happen at the event's moment on the loop's thread (the profiler starting
    its trace before a step) says False."""

    background = True
    path: Path | None = None  # the file or directory it writes: named when a write fails

    def handle(self, event: Event) -> None:
        method = getattr(self, "on_" + event.kind, None)
        if method is not None:
            with writing("write", self.path):  # a full disk: one StorageError, named
                method(event)

    def close(self) -> None:
        """Flushes and releases files; called once, also after a failure."""


class Sinks:
    """The sinks of a run, called in order (a file sink before the terminal, so that a
    line printed about a step is already on disk).

    ``background=True`` (the trainer): events go to the ``background`` sinks through a
    queue, handled in order on one reporting thread, so that writing files and lines
    overlaps the devices' work instead of the loop's; ``close()`` handles every event
    still queued first. A sink's exception is raised on the loop's thread, by the next
    ``emit`` or by ``close``, and the events after it are dropped."""

    def __init__(self, sinks: list[Sink], *, background: bool = False):
        self.sinks = list(sinks)
        later = [s for s in self.sinks if background and s.background]
        self._now = [s for s in self.sinks if s not in later]
        self._later = later
        self._handled: dict[str, bool] = {}  # event kind -> does a later sink handle it
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # not yet raised on the loop's thread
        self._failed = False  # a sink failed: later events are dropped
        self._busy: tuple[Event, float] | None = None  # the event being handled, since
        self._closed = False
        if later:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._report, name="jaxdist-sinks", daemon=True)
            self._thread.start()

    def emit(self, event: Event) -> None:
        self._raise_error()
        for sink in self._now:
            sink.handle(event)
        if self._queue is not None and self._later_handles(event.kind):
            self._queue.put(event)

    def log(self, step: int, values: dict) -> None:
        """A logged step from a custom loop: ``values`` is a dict of Python numbers."""
        self.emit(StepMetrics(step, {"step": step, **values}))

    def close(self, *, failing: bool = False) -> None:
        """Handles the queued events, then closes every sink (once; later calls do
        nothing). ``failing``: the run is already ending on an error, which a sink's
        error must not replace."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)  # after every event already queued
            self._thread.join()
            self._thread = None
        first = None  # every sink closes, even after one failed
        for sink in self.sinks:
            try:
                with writing("write", sink.path):
                    sink.close()
            except Exception as err:  # noqa: BLE001 - raised below, unless already failing
                first = first or err
        if not failing:
            self._raise_error()
            if first is not None:
                raise first

    def _later_handles(self, kind: str) -> bool:
        if kind not in self._handled:
            self._handled[kind] = any(hasattr(s, "on_" + kind) for s in self._later)
        return self._handled[kind]

    def _report(self) -> None:
        while (event := self._queue.get()) is not None:
            if self._failed:
                continue  # a sink failed: the loop is told at its next emit
            self._busy = (event, time.monotonic())
            try:
                for sink in self._later:
                    sink.handle(event)
            except BaseException as err:  # noqa: BLE001 - raised on the loop's thread
                self._error, self._failed = err, True
            self._busy = None

    def in_flight(self) -> tuple[str, int, float, str] | None:
        """The reporting thread's write in progress: ("log", step, seconds, what), or
        None. Read by the watchdog: a file system that stops answering blocks it here."""
        busy = self._busy
        if busy is None:
            return None
        event, since = busy
        paths = ", ".join(str(s.path) for s in self._later if s.path is not None)
        what = f"the reporting thread is writing {event.kind} to {paths or 'its sinks'}"
        return "log", getattr(event, "step", 0), time.monotonic() - since, what

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def __getattr__(name: str):
    # The sinks that import heavier packages (rich, tensorboard, jax.profiler) load on use;
    # WandbRun imports wandb (an optional extra) only when a run starts.
    modules = {
        "MetricsFile": "jsonl",
        "json_line": "jsonl",
        "Terminal": "terminal",
        "TensorBoard": "tensorboard",
        "GoodputFile": "goodput",
        "Ledger": "goodput",
        "Profiler": "profiler",
        "Summary": "summary",
        "WandbRun": "wandb_run",
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
    "WandbRun",
    "json_line",
]
