"""TensorBoard event files, written with TensorBoard's own writer (no TensorFlow).

Tags: ``train/<metric>`` (loss, lr, grad_norm, skipped_steps and the loss function's own
metrics), ``perf/<figure>`` (step time, samples and tokens per second, MFU, data-wait
share, device memory in use), ``eval/<metric>``, and the resolved config as text. A
resumed run writes a new file in the same directory, starting with a ``SessionLog.START``
at its first step: TensorBoard then drops the earlier attempt's points from that step on,
so no step shows twice. ``tensorboard --logdir runs`` shows every run side by side.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util

from jaxdist.sinks import Sink
from jaxdist.sinks.events import EvalMetrics, Resumed, Started, StepMetrics

PERF = {
    "step_time_s",
    "samples_per_s",
    "tokens_per_s",
    "mfu",
    "data_wait_frac",
    "data_wait_s",
    "memory_gb",
}
NOT_PLOTTED = {"step"}
EVENT_FILES = "events.out.tfevents.*"


def tag(name: str) -> str:
    """metrics.jsonl key -> TensorBoard tag: the section groups the charts."""
    return f"perf/{name}" if name in PERF else f"train/{name}"


class TensorBoard(Sink):
    """Writes to ``log_dir`` (made at the first logged step). A run that is not resumed
    starts afresh: event files an earlier run left in ``log_dir`` are removed."""

    def __init__(self, log_dir: str | Path, flush_secs: float = 10.0):
        self.log_dir = self.path = Path(log_dir)
        self.flush_secs = flush_secs
        self.writer: EventFileWriter | None = None
        self.resumed_from: int | None = None
        self.config: dict | None = None

    def on_started(self, event: Started) -> None:
        self.config = event.config or None

    def on_resumed(self, event: Resumed) -> None:
        self.resumed_from = event.from_step

    def on_step_metrics(self, event: StepMetrics) -> None:
        values = {
            tag(k): v
            for k, v in event.values.items()
            if k not in NOT_PLOTTED and not k.startswith("eval_") and _is_number(v)
        }
        self.scalars(event.step, values)

    def on_eval_metrics(self, event: EvalMetrics) -> None:
        values = {f"eval/{k}": v for k, v in event.values.items() if _is_number(v)}
        self.scalars(event.step, values)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()
            ]
        )
        self._write(event_pb2.Event(step=step, summary=summary))

    def text(self, step: int, name: str, markdown: str) -> None:
        meta = text_metadata.create_summary_metadata(display_name=name, description="")
        tensor = tensor_util.make_tensor_proto(np.array(markdown, dtype=object))
        value = summary_pb2.Summary.Value(tag=name, metadata=meta, tensor=tensor)
        self._write(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value])))

    def _write(self, event: event_pb2.Event) -> None:
        if self.writer is None:
            self._open(event.step)
        event.wall_time = time.time()
        self.writer.add_event(event)

    def _open(self, step: int) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.resumed_from is None:
            for old in self.log_dir.glob(EVENT_FILES):
                old.unlink()
        else:
            _after_earlier_files(self.log_dir)
        self.writer = EventFileWriter(str(self.log_dir), flush_secs=self.flush_secs)
        if self.resumed_from is not None:  # drops the earlier attempt's later points
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self.writer.add_event(
                event_pb2.Event(wall_time=time.time(), step=step, session_log=start)
            )
        if self.config is not None:  # 4-space indent: a code block in markdown
            text = json.dumps(self.config, indent=2, default=str)
            self.text(step, "config", "\n".join("    " + x for x in text.splitlines()))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _after_earlier_files(log_dir: Path) -> None:
    """Waits, at most a second, until this second is past the newest event file's. TensorBoard
    reads a folder's event files in name order, and a name is the second it was made, then
    host, process and a counter: a resumed attempt's file made in the same second as the
    earlier one's could sort before it (counter 10 before 9), and the earlier attempt's
    points would then win over the resumed one's."""
    seconds = [int(f.name.split(".")[3]) for f in log_dir.glob(EVENT_FILES)]
    while seconds and time.time() < max(seconds) + 1:
        time.sleep(0.05)
