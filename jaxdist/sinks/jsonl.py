"""``metrics.jsonl``: one strict-JSON record per logged step (NaN and infinities as
null), opened at the first logged step, since the run directory is made only then; and
an ``event`` record for a resume on changed data (``DataChanged``), before its steps."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from jaxdist.sinks import Sink
from jaxdist.sinks.events import DataChanged, StepMetrics


def json_line(record: dict) -> str:
    """One metrics.jsonl record, strict JSON: a NaN or infinite value (a step that
    ``--nan-policy skip`` left out) is written as null."""
    finite = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    return json.dumps(finite, allow_nan=False)


class MetricsFile(Sink):
    """``open_metrics()`` makes the run directory and returns the file's path; it is
    called at the first logged step."""

    def __init__(self, open_metrics: Callable[[], Path]):
        self.open_metrics: Callable[[], Path] | None = open_metrics
        self.file = None
        self.pending: list[dict] = []  # event records that come before the file is opened

    def on_data_changed(self, event: DataChanged) -> None:
        self.pending.append(event.record())  # written with the first step's record

    def on_step_metrics(self, event: StepMetrics) -> None:
        if self.open_metrics is not None:  # the first step trained: now files may exist
            self.path = self.open_metrics()
            self.file = open(self.path, "a", buffering=1)  # noqa: SIM115
            self.open_metrics = None
        for record in self.pending:
            self.file.write(json_line(record) + "\n")
        self.pending.clear()
        self.file.write(json_line(event.values) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
