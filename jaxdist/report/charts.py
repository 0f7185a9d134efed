"""The report's charts, drawn with matplotlib's object API (no pyplot: no global state,
no display needed) and returned as PNG bytes. Runs are overlaid, one colour each."""

from __future__ import annotations

import io

import numpy as np
from matplotlib.figure import Figure

from jaxdist.report.reader import RunData
from jaxdist.sinks.goodput import PARTS

SIZE = (6.4, 3.4)  # inches at 100 dpi: 640 x 340 pixels, a few tens of kB each
PART_COLOURS = {
    "startup_s": "#9e9e9e",
    "compile_s": "#ffb74d",
    "productive_s": "#43a047",
    "data_wait_s": "#e53935",
    "eval_s": "#1e88e5",
    "checkpoint_s": "#8e24aa",
    "recomputed_s": "#6d4c41",
    "other_s": "#cfd8dc",
}


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def _axes(title: str, xlabel: str, ylabel: str):
    fig = Figure(figsize=SIZE)
    ax = fig.subplots()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _colour(i: int) -> str:
    return f"C{i % 10}"


def loss(runs: list[RunData], against: str) -> bytes:
    """Training loss (lines) and eval loss (dots) against step, or against "seen":
    tokens (language models) or samples consumed."""
    unit = "tokens" if all(r.unit == "tokens" for r in runs) else "samples"
    xlabel = "step" if against == "step" else f"{unit} seen"
    fig, ax = _axes(f"loss against {xlabel}", xlabel, "loss")
    for i, run in enumerate(runs):
        scale = 1.0 if against == "step" else _per_step(run, unit)
        steps = np.array([r["step"] for r in run.records], float)
        losses = [_number(r.get("loss")) for r in run.records]
        ax.plot(steps * scale, losses, color=_colour(i), label=run.name)
        evals = [(r["step"], r["eval_loss"]) for r in run.records if "eval_loss" in r]
        if evals:
            x, y = np.array(evals, float).T
            ax.plot(x * scale, y, "o--", color=_colour(i), ms=4, label=f"{run.name} (eval)")
    ax.legend(fontsize=8)
    return _png(fig)


def _per_step(run: RunData, unit: str) -> float:
    if unit == run.unit:
        return run.per_step()
    return run.last["samples_per_s"] * run.last["step_time_s"]


def throughput(runs: list[RunData]) -> bytes:
    """Throughput against training time (the sum of step times: compilation, evaluation
    and saves left out)."""
    unit = "tokens" if all(r.unit == "tokens" for r in runs) else "samples"
    fig, ax = _axes(f"{unit} per second", "training time (s)", f"{unit}/s")
    for i, run in enumerate(runs):
        timed, between = run.timed(), run.steps_between()
        if not timed:
            continue
        elapsed = np.cumsum([n * r["step_time_s"] for n, r in zip(between, timed, strict=False)])
        ax.plot(elapsed, [r[f"{unit}_per_s"] for r in timed], color=_colour(i), label=run.name)
    ax.legend(fontsize=8)
    return _png(fig)


def step_times(runs: list[RunData]) -> bytes:
    """Distribution of step times in ms (each logged interval weighted by its steps)."""
    fig, ax = _axes("step time", "step time (ms)", "steps")
    values = [[r["step_time_s"] * 1e3 for r in run.timed()] for run in runs]
    everything = [v for vs in values for v in vs]
    if everything:
        bins = np.linspace(min(everything), max(everything) * 1.001 + 1e-9, 30)
        for i, (run, vs) in enumerate(zip(runs, values, strict=True)):
            weights = run.steps_between()[: len(vs)]
            ax.hist(vs, bins=bins, weights=weights, alpha=0.5, color=_colour(i), label=run.name)
    ax.legend(fontsize=8)
    return _png(fig)


def goodput(runs: list[RunData]) -> bytes:
    """One stacked bar per run: where its wall time went (all attempts together)."""
    with_goodput = [r for r in runs if r.goodput]
    fig = Figure(figsize=(SIZE[0], 0.6 + 0.45 * max(len(with_goodput), 1)))
    ax = fig.subplots()
    ax.set(title="where the wall time went", xlabel="seconds")
    for row, run in enumerate(with_goodput):
        left = 0.0
        for part in PARTS:
            width = max(run.goodput.get(part, 0.0), 0.0)
            label = part.removesuffix("_s") if row == 0 else None
            ax.barh(row, width, left=left, color=PART_COLOURS[part], label=label)
            left += width
    ax.set_yticks(range(len(with_goodput)), [r.name for r in with_goodput], fontsize=8)
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    return _png(fig)


def _number(value) -> float:
    return float("nan") if value is None else float(value)
