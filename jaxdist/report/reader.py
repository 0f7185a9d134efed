"""A run directory as the report reads it: ``metrics.jsonl`` (required), ``config.yaml``
and ``goodput.json`` (when there). A run still in progress is read as far as it got (a
torn last line is left out)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from jaxdist.errors import JaxdistError


class NotARunError(JaxdistError):
    """A path given to the report that is not a run directory (exit 2)."""


@dataclass
class RunData:
    name: str
    path: Path
    records: list[dict]  # metrics.jsonl, by step
    config: dict = field(default_factory=dict)
    goodput: dict = field(default_factory=dict)

    @property
    def last(self) -> dict:
        return self.records[-1]

    @property
    def unit(self) -> str:
        """What a step consumes: "tokens" for a language model, else "samples"."""
        return "tokens" if "tokens_per_s" in self.last else "samples"

    def per_step(self) -> float:
        """Tokens or samples per step: throughput x step time (the global batch)."""
        r = self.last
        return r[f"{self.unit}_per_s"] * r["step_time_s"]

    def timed(self) -> list[dict]:
        """Records after the first (whose step time includes compilation)."""
        return [r for r in self.records[1:] if r.get("step_time_s")]

    def steps_between(self) -> list[int]:
        """Steps each record's step time averages over."""
        steps = [r["step"] for r in self.records]
        return [b - a for a, b in zip(steps, steps[1:], strict=False)]

    def planned_steps(self) -> int | None:
        return self.config.get("train", {}).get("steps")


def load(path: str | Path) -> RunData:
    """Reads a run directory; NotARunError naming the path and what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise NotARunError(f"{path}: no such directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise NotARunError(
            f"{path} is not a run directory: it has no metrics.jsonl (a run writes one "
            "once its first step has trained)"
        )
    records = _records(metrics)
    if not records:
        raise NotARunError(f"{path}: metrics.jsonl holds no logged step yet")
    config = {}
    if (path / "config.yaml").is_file():
        config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    goodput = {}
    if (path / "goodput.json").is_file():
        try:
            goodput = json.loads((path / "goodput.json").read_text())
        except ValueError:
            goodput = {}
    return RunData(path.resolve().name, path, records, config, goodput)


def _records(metrics: Path) -> list[dict]:
    by_step: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # the last line of a run killed or still writing
            continue
        if not isinstance(record, dict) or "event" in record:  # e.g. a resume on changed data
            continue
        if isinstance(record.get("step"), int):
            by_step[record["step"]] = record  # a resumed run's later record wins
    return [by_step[s] for s in sorted(by_step)]


def config_differences(runs: list[RunData]) -> dict[str, list]:
    """``section.key`` -> each run's value, for the keys whose values differ (run_dir
    left out: it always differs)."""
    flat = [_flatten(r.config) for r in runs]
    keys = sorted(set().union(*flat))
    out = {}
    for key in keys:
        values = [f.get(key, "-") for f in flat]
        if key != "train.run_dir" and len({json.dumps(v, default=str) for v in values}) > 1:
            out[key] = values
    return out


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
