"""The matrix's cells as markdown (experiments/matrix.py ``--out``), and read back from
that markdown, so that the rows of one run replace or join those of a table written
before (``--merge``)."""

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


def split(text: str) -> tuple[str, str]:
    """(what precedes the table, the table and its notes) of a page ``table`` wrote into."""
    at = text.find(HEADER)
    if at < 0 or (at and text[at - 1] != "\n"):
        raise ValueError("no matrix table (a line beginning '| layout | ')")
    return text[:at], text[at:]


def read_cells(text: str, why_not) -> list[Cell]:
    """The cells of ``table``'s markdown (in a page: the first table's), each with its
    note's detail; an n/a cell (whose reason ``table`` lists once) with ``why_not(layout,
    feature)``'s."""
    lines = split(text)[1].splitlines()
    features = [f.strip() for f in lines[0].strip().strip("|").split("|")[1:]]
    notes = {}
    for line in lines:
        if line.startswith("- ") and not line.startswith("- n/a: "):
            layout, _, rest = line[2:].partition(" / ")
            feature, status, detail = rest.split(": ", 2)
            notes[layout, feature] = (status, detail)
    cells = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        layout, *marks = (x.strip() for x in line.strip().strip("|").split("|"))
        for feature, mark in zip(features, marks, strict=True):
            if mark:
                status, detail = notes.get((layout, feature), (mark, ""))
                if mark == "n/a" and not detail:
                    detail = why_not(layout, feature)
                cells.append(Cell(layout, feature, status, detail))
    return cells


def merged(old: list[Cell], new: list[Cell], layouts: list[str], features: list[str]):
    """``old`` with ``new``'s cells in place of theirs, in the order of ``layouts`` and
    ``features`` (names neither lists after them, as they came)."""
    at = {(c.layout, c.feature): c for c in old} | {(c.layout, c.feature): c for c in new}
    order_l = {name: i for i, name in enumerate(dict.fromkeys([*layouts, *(k[0] for k in at)]))}
    order_f = {name: i for i, name in enumerate(dict.fromkeys([*features, *(k[1] for k in at)]))}
    return sorted(at.values(), key=lambda c: (order_l[c.layout], order_f[c.feature]))
