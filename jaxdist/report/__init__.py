"""``python -m jaxdist.report RUN_DIR [RUN_DIR ...] [--out report.html]``: one
self-contained HTML page comparing runs (loss against step and against tokens or
samples seen, throughput over time, step-time distribution, goodput bars, final figures
and config differences). The charts are also saved beside the page as PNGs. Works on a
run still in progress; a directory that is not a run is an error (exit 2)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxdist.report.reader import NotARunError, RunData, load

__all__ = ["NotARunError", "RunData", "build", "load", "main"]


def build(run_dirs: list[str | Path], out: str | Path) -> list[Path]:
    """Writes the page ``out`` and its PNGs beside it (``<stem>-<chart>.png``); returns
    the paths written. NotARunError before anything is written."""
    from jaxdist.report import charts, page

    runs = [load(path) for path in run_dirs]
    drawn = {
        "loss-step": charts.loss(runs, "step"),
        "loss-seen": charts.loss(runs, "seen"),
        "throughput": charts.throughput(runs),
        "step-time": charts.step_times(runs),
    }
    if any(r.goodput for r in runs):
        drawn["goodput"] = charts.goodput(runs)
    html = page.render(runs, drawn)  # before any file: a failure leaves no PNGs alone
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for name, png in drawn.items():
        path = out.with_name(f"{out.stem}-{name}.png")
        path.write_bytes(png)
        written.append(path)
    out.write_text(html, encoding="utf-8")
    return [out, *written]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxdist.report", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default="report.html", help="the HTML page (PNGs beside it)")
    args = parser.parse_args(argv)
    try:
        written = build(args.run_dirs, args.out)
    except NotARunError as err:
        print(f"jaxdist report: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written[0]} and {len(written) - 1} PNGs beside it")
    return 0
