"""``--rules FILE.yaml``: the user's layout rules read from a file, for
``jaxdist.parallel.state_shardings`` (path rules and logical-name overrides)."""

from __future__ import annotations

import pathlib

import yaml

from jaxdist.parallel.layout import LayoutError


def load_rules(path: str) -> tuple[list[tuple[str, tuple]], dict]:
    """``--rules file.yaml`` -> (path rules, the model's axis names -> mesh axes). The
    file is a list of ``[regex, [axis or null, ...]]`` pairs, or a mapping ``regex:
    [axes]``, or a mapping with ``paths:`` (either form) and ``axis_names:`` (``name: axis
    or null``; ``logical:`` is its older name)."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise LayoutError(f"--rules: no such file {path}")
    loaded = yaml.safe_load(file.read_text()) or []
    logical = {}
    if isinstance(loaded, dict) and set(loaded) <= {"paths", "logical", "axis_names"} and loaded:
        parts = [loaded.get("logical") or {}, loaded.get("axis_names") or {}]
        if not all(isinstance(part, dict) for part in parts):
            raise LayoutError(f"--rules {path}: axis_names: must map names to mesh axes")
        logical = {**parts[0], **parts[1]}
        loaded = loaded.get("paths") or []
    pairs = list(loaded.items()) if isinstance(loaded, dict) else loaded
    out = []
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2 or not isinstance(pair[0], str):
            raise LayoutError(f"--rules {path}: {pair!r} is not [regex, [axes...]]")
        out.append((pair[0], pair[1]))
    return out, logical
