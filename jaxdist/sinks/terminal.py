"""What a person sees: a progress bar on a terminal (one plain line per logged step
otherwise), notes, and at the end the ``done:`` line and the summary table."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from jaxdist.sinks import Sink
from jaxdist.sinks.events import Compiled, Note, Started, StepMetrics, Stopped
from jaxdist.sinks.summary import Summary

FIELDS = [  # (key, how it is shown); a figure the record lacks is left out
    ("loss", "loss {:.4f}"),
    ("lr", "lr {:.2e}"),
    ("grad_norm", "grad_norm {:.3f}"),
    ("tokens_per_s", "{:,.0f} tok/s"),
    ("samples_per_s", "{:,.0f} samples/s"),
    ("mfu", "mfu {:.1%}"),
    ("data_wait_frac", "data wait {:.0%}"),
    ("skipped_steps", "skipped {}"),
    ("eval_loss", "eval_loss {:.4f}"),
    ("eval_bpb", "eval_bpb {:.3f}"),
    ("eval_accuracy", "eval_accuracy {:.3f}"),
]


def line(metrics: dict) -> str:
    """A logged step's figures, as the progress bar and the plain lines show them."""
    shown = dict(metrics)
    if "tokens_per_s" in shown:  # a language model: tokens, not samples
        shown.pop("samples_per_s", None)
    if not shown.get("skipped_steps"):
        shown.pop("skipped_steps", None)
    return "  ".join(
        fmt.format(shown[k]) for k, fmt in FIELDS if isinstance(shown.get(k), int | float)
    )


class Terminal(Sink):
    """``goodput``: the goodput sink, for the summary's goodput (None: left out)."""

    def __init__(self, goodput=None):
        self.summary = Summary(goodput)
        self.progress: Progress | None = None
        self.total_steps = 0
        self.first_step = 1
        self.started_s = 0.0

    def handle(self, event) -> None:
        self.summary.handle(event)
        super().handle(event)

    def on_note(self, event: Note) -> None:
        self.print(event.text)

    def on_started(self, event: Started) -> None:
        self.total_steps, self.first_step = event.total_steps, event.first_step
        self.started_s = event.time_s
        if sys.stdout.isatty():
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=20),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            done = event.first_step - 1
            self.task = self.progress.add_task(
                "train", total=event.total_steps, completed=done, info="compiling"
            )
            self.progress.start()

    def on_compiled(self, event: Compiled) -> None:
        flops = event.flops
        if flops is None or not (flops.xla or flops.analytic):
            return
        counts = [f"XLA cost analysis {flops.xla:.3g}" if flops.xla else ""]
        counts.append(f"{flops.formula} {flops.analytic:.3g}" if flops.analytic else "")
        peak = f"peak {flops.peak_flops_per_s:.3g} FLOP/s" if flops.peak_flops_per_s else "no peak"
        kind = f" ({flops.device_kind})" if flops.device_kind else ""
        self.print(f"FLOPs per step: {', '.join(c for c in counts if c)}; {peak}{kind}")

    def on_step_metrics(self, event: StepMetrics) -> None:
        step = event.step
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=line(event.values))
            return
        done = step - self.first_step + 1
        eta = (event.time_s - self.started_s) / done * (self.total_steps - step)
        print(f"step {step}/{self.total_steps}  {line(event.values)}  eta {eta:.0f}s", flush=True)

    def on_stopped(self, event: Stopped) -> None:
        self.close()
        s = self.summary
        if s.first is None:
            self.print(f"done: already trained to step {event.step}")
            return
        figures = s.figures()
        self.print(
            f"done: {event.step} steps in {figures.get('wall_s', 0.0):.1f}s (first step, "
            f"with compilation: {s.compile_s:.1f}s); loss {s.first['loss']:.4f} -> "
            f"{s.last['loss']:.4f}; skipped_steps {s.last.get('skipped_steps', 0)}"
        )
        self.print(s.table())

    def print(self, *args) -> None:
        if self.progress is not None:
            self.progress.console.print(*args, highlight=False)
        else:
            print(*args, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
