"""What a run shows and writes: metrics.jsonl, a progress bar on a terminal (plain log
lines otherwise), and a final summary. Only the main process writes or prints; the
metrics file is opened at the first logged step (the first step is always logged); its
records are strict JSON, NaN and infinities written as null."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _fmt(metrics: dict) -> str:
    parts = [f"loss {metrics['loss']:.4f}", f"lr {metrics['lr']:.2e}"]
    parts.append(f"grad_norm {metrics['grad_norm']:.3f}")
    if "tokens_per_s" in metrics:
        parts.append(f"{metrics['tokens_per_s']:,.0f} tok/s")
    else:
        parts.append(f"{metrics['samples_per_s']:,.0f} samples/s")
    if "data_wait_frac" in metrics:
        parts.append(f"data wait {metrics['data_wait_frac']:.0%}")
    if metrics.get("skipped_steps"):
        parts.append(f"skipped {metrics['skipped_steps']}")
    for name, fmt in [("eval_loss", ".4f"), ("eval_bpb", ".3f"), ("eval_accuracy", ".3f")]:
        if name in metrics:
            parts.append(f"{name} {metrics[name]:{fmt}}")
    return "  ".join(parts)


def json_line(record: dict) -> str:
    """One metrics.jsonl record, strict JSON: a NaN or infinite value (a step that
    ``--nan-policy skip`` left out) is written as null."""
    finite = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    return json.dumps(finite, allow_nan=False)


class Reporter:
    """``open_metrics()`` makes the run directory and returns the metrics file's path; it
    is called at the first ``log`` (None: write no files, e.g. on processes other than 0).
    ``show``: print progress and lines (the main process, unless quiet)."""

    def __init__(self, open_metrics: Callable[[], Path] | None, total_steps: int, show: bool):
        self.show = show
        self.total_steps = total_steps
        self.open_metrics = open_metrics
        self.metrics_file = None
        self.progress = None
        self.started = time.perf_counter()
        if show and sys.stdout.isatty():
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=20),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.progress.add_task("train", total=total_steps, info="compiling")
            self.progress.start()

    def print(self, *args) -> None:
        if not self.show:
            return
        if self.progress is not None:
            self.progress.console.print(*args, highlight=False)
        else:
            print(*args, flush=True)

    def log(self, metrics: dict) -> None:
        if self.open_metrics is not None:  # the first step trained: now files may exist
            self.metrics_file = open(self.open_metrics(), "a", buffering=1)  # noqa: SIM115
            self.open_metrics = None
        if self.metrics_file is not None:
            self.metrics_file.write(json_line(metrics) + "\n")
        if not self.show:
            return
        step = metrics["step"]
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=_fmt(metrics))
        else:
            elapsed = time.perf_counter() - self.started
            eta = elapsed / step * (self.total_steps - step)
            print(f"step {step}/{self.total_steps}  {_fmt(metrics)}  eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.metrics_file is not None:
            self.metrics_file.close()
