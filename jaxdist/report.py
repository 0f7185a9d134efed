"""What a run shows and writes: metrics.jsonl, a progress bar on a terminal (plain log
lines otherwise), and a final summary. Only the main process writes or prints."""

from __future__ import annotations

import json
import sys
import time
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
    for name, fmt in [("eval_loss", ".4f"), ("eval_bpb", ".3f"), ("eval_accuracy", ".3f")]:
        if name in metrics:
            parts.append(f"{name} {metrics[name]:{fmt}}")
    return "  ".join(parts)


class Reporter:
    def __init__(self, run_dir: Path | None, total_steps: int, is_main: bool):
        self.is_main = is_main
        self.total_steps = total_steps
        self.metrics_file = None
        if is_main and run_dir is not None:
            self.metrics_file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self.progress = None
        self.started = time.perf_counter()
        if is_main and sys.stdout.isatty():
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
        if not self.is_main:
            return
        if self.progress is not None:
            self.progress.console.print(*args, highlight=False)
        else:
            print(*args, flush=True)

    def log(self, metrics: dict) -> None:
        if not self.is_main:
            return
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(metrics) + "\n")
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
