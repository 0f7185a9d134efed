"""The report as one self-contained HTML page: the charts as embedded PNGs (also saved
beside the page), the runs' final figures and their config differences."""

from __future__ import annotations

import base64
import html

from jaxdist.report.reader import RunData, config_differences

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:right}th:first-child,td:first-child{text-align:left}img{margin:4px;
border:1px solid #eee}.note{color:#666}"""


def final_figures(run: RunData) -> dict[str, str]:
    """A run's figures for the table: step reached, losses, speed, MFU, goodput."""
    last, timed = run.last, run.timed()
    planned = run.planned_steps()
    rows = {"steps": f"{last['step']}" + (f" of {planned}" if planned else "")}
    rows["final loss"] = _fmt(last.get("loss"), ".4f")
    evals = [r for r in run.records if "eval_loss" in r]
    rows["final eval loss"] = _fmt(evals[-1]["eval_loss"] if evals else None, ".4f")
    if timed:
        between = run.steps_between()
        seconds = sum(n * r["step_time_s"] for n, r in zip(between, timed, strict=False))
        rows[f"{run.unit}/s"] = _fmt(sum(between) * run.per_step() / seconds, ",.0f")
        rows["mean step time"] = _fmt(seconds / sum(between) * 1e3, ".2f") + " ms"
    mfus = [r["mfu"] for r in run.records if r.get("mfu") is not None]
    rows["MFU (last)"] = _fmt(mfus[-1] if mfus else None, ".1%")
    rows["goodput"] = _fmt(run.goodput.get("goodput"), ".1%")
    rows["wall time"] = _fmt(run.goodput.get("wall_s"), ".1f") + (" s" if run.goodput else "")
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure_rows(figures: list[dict[str, str]]) -> list[list[str]]:
    """One row per figure any run has, in first-seen order; "-" where a run lacks it
    (runs differ: a language model's tokens/s, a classifier's samples/s)."""
    labels = list(dict.fromkeys(label for f in figures for label in f))
    return [[label, *(f.get(label, "-") for f in figures)] for label in labels]


def render(runs: list[RunData], charts: dict[str, bytes]) -> str:
    names = [r.name for r in runs]
    final = _table(["", *names], _figure_rows([final_figures(r) for r in runs]))
    diffs = config_differences(runs)
    if diffs:
        config = _table(["config", *names], [[k, *map(str, v)] for k, v in diffs.items()])
    else:
        config = '<p class="note">No config differences (or a single run).</p>'
    images = "".join(
        f'<img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}">'
        for name, png in charts.items()
    )
    paths = "".join(f"<li>{html.escape(str(r.path))}</li>" for r in runs)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>jaxdist report</title>"
        f"<style>{STYLE}</style></head><body><h1>jaxdist report</h1><ul>{paths}</ul>"
        f"<h2>Final figures</h2>{final}<h2>Charts</h2>{images}"
        f"<h2>Config differences</h2>{config}</body></html>\n"
    )
