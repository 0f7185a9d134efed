"""``Sinks(..., background=True)``, as the trainer uses them: background sinks handle
every event, in order, on one reporting thread, and are done when ``close()`` returns;
a sink that must act at the event's moment (``background = False``: the profiler) runs
on the caller's thread; a sink's error reaches the caller."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from jaxdist.checkpoint import StorageError
from jaxdist.sinks import Note, Sink, Sinks, StepMetrics


class Recorder(Sink):
    def __init__(self, slow_s: float = 0.0):
        self.seen: list[tuple[int, str]] = []
        self.slow_s = slow_s

    def on_step_metrics(self, event):
        time.sleep(self.slow_s)  # a slow disk: the caller must not wait for it
        self.seen.append((event.step, threading.current_thread().name))


class AtOnce(Recorder):
    background = False


class Failing(Sink):
    path = Path("runs/x/metrics.jsonl")

    def on_note(self, event):
        raise OSError(28, "No space left on device")


def test_background_sinks_get_every_event_in_order_off_the_callers_thread():
    later, now = Recorder(slow_s=0.01), AtOnce()
    sinks = Sinks([later, now], background=True)
    started = time.perf_counter()
    for step in range(1, 21):
        sinks.emit(StepMetrics(step, {"step": step}))
    emitted_s = time.perf_counter() - started
    assert [s for s, _ in now.seen] == list(range(1, 21))  # at once, on this thread
    assert {name for _, name in now.seen} == {threading.current_thread().name}
    assert emitted_s < 20 * 0.01 / 2  # the slow sink did not hold the caller
    sinks.close()
    assert [s for s, _ in later.seen] == list(range(1, 21))  # all of them, in order
    assert {name for _, name in later.seen} == {"jaxdist-sinks"}


def test_without_background_every_sink_runs_on_the_callers_thread():
    sink = Recorder()
    sinks = Sinks([sink])
    sinks.emit(StepMetrics(1, {"step": 1}))
    assert sink.seen == [(1, threading.current_thread().name)]
    sinks.close()


def test_a_background_sinks_error_reaches_the_caller():
    sinks = Sinks([Failing()], background=True)
    sinks.emit(Note("first"))  # fails on the reporting thread
    deadline = time.monotonic() + 10
    # named: the operation, the sink's file and the cause (a full disk ends the run, 74)
    with pytest.raises(StorageError, match="cannot write runs/x/metrics.jsonl: no space left"):
        while time.monotonic() < deadline:  # raised by the first emit after it failed
            sinks.emit(Note("next"))
            time.sleep(0.01)
    sinks.close()  # reported once; closing after it is quiet


def test_close_raises_a_pending_error_unless_the_run_is_already_failing():
    for failing in (False, True):
        sinks = Sinks([Failing()], background=True)
        sinks.emit(Note("fails"))
        if failing:
            sinks.close(failing=True)
        else:
            with pytest.raises(StorageError):
                sinks.close()
        sinks.close()  # a second close does nothing
