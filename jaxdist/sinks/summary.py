"""The figures of the final summary, gathered from events: steps, samples or tokens,
wall and compile time, mean and p90 step time, throughput, MFU, goodput, checkpoints,
final loss and eval loss. ``table()`` lays them out for the terminal."""

from __future__ import annotations

import numpy as np

from jaxdist.sinks import Sink
from jaxdist.sinks.events import (
    CheckpointSaved,
    Compiled,
    EvalMetrics,
    Started,
    StepFlops,
    StepMetrics,
    Stopped,
)


def weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` each repeated ``weights`` times (a logged
    interval of k steps counts k times its mean step time)."""
    order = np.argsort(values)
    v, w = np.asarray(values)[order], np.asarray(weights, dtype=float)[order]
    cumulative = np.cumsum(w)
    return float(v[np.searchsorted(cumulative, q * cumulative[-1])])


class Summary(Sink):
    """``goodput``: an object with ``report()`` (the goodput sink), or None."""

    def __init__(self, goodput=None):
        self.goodput = goodput
        self.started: Started | None = None
        self.compile_s = 0.0
        self.flops: StepFlops | None = None
        self.first: dict | None = None  # the first logged record
        self.last: dict | None = None
        self.eval: dict | None = None
        self.step_times: list[float] = []  # per-step mean of each timed interval
        self.step_counts: list[int] = []
        self.timed_s = 0.0
        self.checkpoints = 0
        self.stopped: Stopped | None = None

    def on_started(self, event: Started) -> None:
        self.started = event

    def on_compiled(self, event: Compiled) -> None:
        self.compile_s, self.flops = event.seconds, event.flops

    def on_step_metrics(self, event: StepMetrics) -> None:
        self.first = self.first or event.values
        self.last = event.values
        if not event.compiling and event.steps:
            self.step_times.append(event.timed_s / event.steps)
            self.step_counts.append(event.steps)
            self.timed_s += event.timed_s

    def on_eval_metrics(self, event: EvalMetrics) -> None:
        self.eval = event.values

    def on_checkpoint_saved(self, event: CheckpointSaved) -> None:
        self.checkpoints += 1

    def on_stopped(self, event: Stopped) -> None:
        self.stopped = event

    def figures(self) -> dict:
        """Every figure that exists for this run (no MFU without a known peak, no tokens
        for a classifier, no eval loss without evaluation)."""
        out: dict = {}
        if self.last is None:
            return out
        step = self.last["step"]
        start = self.started or Started(total_steps=step)
        out["steps"] = step
        if start.tokens_per_step:
            out["tokens"] = step * start.tokens_per_step
        elif start.samples_per_step:
            out["samples"] = step * start.samples_per_step
        if self.stopped is not None and self.started is not None:
            out["wall_s"] = self.stopped.time_s - self.started.time_s
        out["compile_s"] = self.compile_s
        steps = sum(self.step_counts)
        if steps:
            out["step_time_mean_s"] = self.timed_s / steps
            out["step_time_p90_s"] = weighted_quantile(self.step_times, self.step_counts, 0.9)
            per_s = steps / self.timed_s
            if start.tokens_per_step:
                out["tokens_per_s"] = per_s * start.tokens_per_step
            elif start.samples_per_step:
                out["samples_per_s"] = per_s * start.samples_per_step
            mfu = self.flops.mfu(self.timed_s / steps) if self.flops else None
            if mfu is not None:
                out["mfu"] = mfu
        if self.goodput is not None:
            out["goodput"] = self.goodput.report()["goodput"]
        out["checkpoints"] = self.checkpoints
        out["loss"] = self.last.get("loss")
        if self.eval is not None:
            out["eval_loss"] = self.eval.get("loss")
        return out

    def table(self) -> str:
        """Two columns, one figure a line; a resumed run's labels say which figures are
        for the whole run and which for this attempt."""
        resumed = self.started is not None and self.started.first_step > 1
        rows = [
            (LABELS[k][0] + (f" ({SCOPE[k]})" if resumed and k in SCOPE else ""), LABELS[k][1](v))
            for k, v in self.figures().items()
            if k in LABELS
        ]
        width = max((len(name) for name, _ in rows), default=0)
        return "\n".join(f"  {name:<{width}}  {text}" for name, text in rows)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


# What each figure of a resumed run covers: the run since step 1, or this attempt.
SCOPE = {
    **dict.fromkeys(("steps", "samples", "tokens", "goodput"), "whole run"),
    **dict.fromkeys(
        (
            "wall_s",
            "compile_s",
            "step_time_mean_s",
            "step_time_p90_s",
            "samples_per_s",
            "tokens_per_s",
            "mfu",
            "checkpoints",
        ),
        "this attempt",
    ),  # fmt: skip
}
LABELS = {
    "steps": ("steps", str),
    "samples": ("samples", lambda v: f"{v:,}"),
    "tokens": ("tokens", lambda v: f"{v:,}"),
    "wall_s": ("wall time (loop)", lambda v: f"{v:.1f} s"),
    "compile_s": ("first step (compile)", lambda v: f"{v:.1f} s"),
    "step_time_mean_s": ("step time, mean", _ms),
    "step_time_p90_s": ("step time, p90", _ms),
    "samples_per_s": ("throughput", lambda v: f"{v:,.0f} samples/s"),
    "tokens_per_s": ("throughput", lambda v: f"{v:,.0f} tokens/s"),
    "mfu": ("MFU", lambda v: f"{v:.1%}"),
    "goodput": ("goodput", lambda v: f"{v:.1%}"),
    "checkpoints": ("checkpoints written", str),
    "loss": ("final loss", _number),
    "eval_loss": ("final eval loss", _number),
}
