"""``metrics.jsonl``: one strict-JSON record per logged step (NaN and infinities as
null), opened at the first logged step, since the run directory is made only then."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from jaxdist.sinks import Sink
from jaxdist.sinks.events import StepMetrics


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

    def on_step_metrics(self, event: StepMetrics) -> None:
        if self.open_metrics is not None:  # the first step trained: now files may exist
            self.file = open(self.open_metrics(), "a", buffering=1)  # noqa: SIM115
            self.open_metrics = None
        self.file.write(json_line(event.values) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
