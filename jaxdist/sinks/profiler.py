"""``--profile START:STOP``: a ``jax.profiler`` trace of steps START to STOP (both
included) in ``RUN_DIR/profile``, for TensorBoard's profile plugin or Perfetto.

The trace is written to a temporary directory and moved into the run directory at its
end, so a run that fails before its first step leaves no run directory behind."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import jax

from jaxdist.sinks import Sink
from jaxdist.sinks.events import StepMetrics, StepStarting, Stopped


class Profiler(Sink):
    """Traces steps ``start`` to ``stop`` into ``log_dir`` (``log_dir/plugins/profile/<time>``
    holds the ``.xplane.pb`` and ``.trace.json.gz`` files). Runs on the loop's thread:
    the trace starts before the first traced step is dispatched."""

    background = False

    def __init__(self, log_dir: str | Path, start: int, stop: int):
        self.log_dir, self.start, self.stop = Path(log_dir), start, stop
        self.tmp: str | None = None  # while tracing
        self.trained = False  # a step finished: the run directory may exist

    def on_step_starting(self, event: StepStarting) -> None:
        if self.tmp is None and self.start <= event.step <= self.stop:
            self.tmp = tempfile.mkdtemp(prefix="jaxdist-profile-")
            jax.profiler.start_trace(self.tmp)
        elif self.tmp is not None and event.step > self.stop:
            self._finish(keep=True)

    def on_step_metrics(self, event: StepMetrics) -> None:
        self.trained = True

    def on_stopped(self, event: Stopped) -> None:
        self._finish(keep=True)

    def close(self) -> None:
        self._finish(keep=self.trained)

    def _finish(self, keep: bool) -> None:
        if self.tmp is None:
            return
        # Dispatch is asynchronous: wait for the traced steps' results (every live array)
        # so the trace holds their device work to the end.
        jax.block_until_ready(jax.live_arrays())
        jax.profiler.stop_trace()
        if keep:
            shutil.copytree(self.tmp, self.log_dir, dirs_exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None
