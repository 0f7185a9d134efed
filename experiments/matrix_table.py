"""The matrix's cells as markdown (experiments/matrix.py ``--out``)."""

from __future__ import annotations

from dataclasses import dataclass

HEADER = "| layout | "


@dataclass
class Cell:
    layout: str
    feature: str
    status: str  # "ok", "refused", "FAILED", "n/a" (the feature needs another layout)
    detail: str
    seconds: float = 0.0


def table(cells: list[Cell]) -> str:
    """Markdown: a row per layout, a column per feature, each cell its status; the
    details of every cell that is not plainly ok below."""
    layouts = list(dict.fromkeys(c.layout for c in cells))
    features = list(dict.fromkeys(c.feature for c in cells))
    at = {(c.layout, c.feature): c for c in cells}
    lines = [HEADER + " | ".join(features) + " |", "|---" * (len(features) + 1) + "|"]
    for layout in layouts:
        marks = [at[layout, f].status if (layout, f) in at else "" for f in features]
        lines.append(f"| {layout} | " + " | ".join(marks) + " |")
    notes = [f"- {c.layout} / {c.feature}: {c.status}: {c.detail}" for c in cells]
    if any(c.status == "n/a" for c in cells):  # one line per reason
        notes = [n for n in notes if ": n/a: " not in n]
        reasons = dict.fromkeys(c.detail for c in cells if c.status == "n/a")
        notes += [f"- n/a: {why}" for why in reasons]
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
