"""Where process 0's wall time went, and goodput = productive time / wall time.

Parts of one attempt (a process lifetime), from its clock start (the process's start for
the command) to its last event:
  startup_s      initialisation, data preparation, building the state: up to ``Started``
  compile_s      the first step: compilation, its input and its run (``Compiled``)
  productive_s   later steps, less their data waits and less recomputed steps
  data_wait_s    steps waiting for their input
  eval_s         evaluations
  checkpoint_s   time a checkpoint save blocked the loop
  recomputed_s   steps (restored step, last step an earlier attempt reached] done again
  other_s        the rest: logging, writing files, shutdown (small; tests bound it)
A resumed run's ``goodput.json`` keeps the earlier attempts; goodput is over all of them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from jaxdist.sinks import Sink
from jaxdist.sinks.events import (
    CheckpointSaved,
    Compiled,
    EvalMetrics,
    Event,
    Resumed,
    Started,
    StepMetrics,
)

PARTS = (
    "startup_s",
    "compile_s",
    "productive_s",
    "data_wait_s",
    "eval_s",
    "checkpoint_s",
    "recomputed_s",
    "other_s",
)
FILE = "goodput.json"


def process_clock_start() -> float:
    """This process's start as a ``time.perf_counter()`` reading, so that start-up
    counts the interpreter and imports too (Linux: /proc; elsewhere: now)."""
    now = time.perf_counter()
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22, starttime: clock ticks after boot
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age_s if 0 <= age_s < 86400 * 365 else now


class Ledger(Sink):
    """One attempt's accounting, from events only. ``clock_start``: the
    ``time.perf_counter()`` reading where its wall time begins (default: now)."""

    def __init__(self, clock_start: float | None = None):
        self.clock_start = time.perf_counter() if clock_start is None else clock_start
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.last_time_s = self.clock_start
        self.recompute = (0, 0)  # steps (from, to] computed a second time
        self.last_step = 0
        self.checkpoints = 0

    def handle(self, event: Event) -> None:
        self.last_time_s = max(self.last_time_s, event.time_s)
        super().handle(event)

    def on_started(self, event: Started) -> None:
        self.parts["startup_s"] = event.time_s - self.clock_start

    def on_resumed(self, event: Resumed) -> None:
        self.recompute = (event.from_step, max(event.from_step, event.earlier_last_step))

    def on_compiled(self, event: Compiled) -> None:
        self.parts["compile_s"] += event.seconds

    def on_step_metrics(self, event: StepMetrics) -> None:
        self.last_step = max(self.last_step, event.step)
        if event.compiling:  # counted by Compiled
            return
        self.parts["data_wait_s"] += event.data_wait_s
        busy_s = event.timed_s - event.data_wait_s
        low, high = self.recompute
        first = event.step - event.steps  # the steps (first, step]
        again = max(0, min(event.step, high) - max(first, low))
        self.parts["recomputed_s"] += busy_s * again / event.steps
        self.parts["productive_s"] += busy_s * (event.steps - again) / event.steps

    def on_eval_metrics(self, event: EvalMetrics) -> None:
        self.parts["eval_s"] += event.eval_s

    def on_checkpoint_saved(self, event: CheckpointSaved) -> None:
        self.parts["checkpoint_s"] += event.blocked_s
        self.checkpoints += 1

    def attempt(self, now: float | None = None) -> dict:
        """This attempt's record: wall time, its parts (other_s: the rest), last step."""
        wall_s = max(self.last_time_s if now is None else now, self.last_time_s)
        wall_s -= self.clock_start
        parts = dict(self.parts)
        parts["other_s"] = wall_s - sum(v for k, v in parts.items() if k != "other_s")
        record = {"wall_s": wall_s, **parts, "last_step": self.last_step}
        return {**record, "checkpoints": self.checkpoints}

    def report(self, now: float | None = None) -> dict:
        return totals([self.attempt(now)])


def totals(attempts: list[dict]) -> dict:
    """goodput.json: the sum of the attempts' parts, goodput, and the attempts."""
    wall_s = sum(a["wall_s"] for a in attempts)
    parts = {k: sum(a.get(k, 0.0) for a in attempts) for k in PARTS}
    goodput = parts["productive_s"] / wall_s if wall_s > 0 else 0.0
    last_step = max((a.get("last_step", 0) for a in attempts), default=0)
    return {
        "goodput": goodput,
        "wall_s": wall_s,
        **parts,
        "checkpoints": sum(a.get("checkpoints", 0) for a in attempts),
        "last_step": last_step,
        "attempts": attempts,
    }


class GoodputFile(Ledger):
    """A ``Ledger`` that keeps ``run_dir/goodput.json`` current: written at the first
    logged step (the run directory exists then), every ``every_s`` seconds, at a
    checkpoint and at the end. After ``Resumed`` the file's earlier attempts are kept."""

    def __init__(self, run_dir: Path, clock_start: float | None = None, every_s: float = 30.0):
        super().__init__(clock_start)
        self.path = Path(run_dir) / FILE
        self.every_s = every_s
        self.earlier: list[dict] = []  # attempts before this one (a resumed run)
        self.written_at: float | None = None
        self.stopped = False

    def on_resumed(self, event: Resumed) -> None:
        super().on_resumed(event)
        self.earlier = read(self.path.parent).get("attempts", [])

    def on_step_metrics(self, event: StepMetrics) -> None:
        super().on_step_metrics(event)
        if self.written_at is None or event.time_s - self.written_at >= self.every_s:
            self.write(event.time_s)

    def on_checkpoint_saved(self, event: CheckpointSaved) -> None:
        super().on_checkpoint_saved(event)
        if self.written_at is not None:
            self.write(event.time_s)

    def on_stopped(self, event) -> None:
        self.stopped = True
        if self.written_at is not None:
            self.write(event.time_s)

    def close(self) -> None:  # after a failure: the time until now is accounted too
        if self.written_at is not None and not self.stopped:
            self.write(time.perf_counter())

    def report(self, now: float | None = None) -> dict:
        return totals([*self.earlier, self.attempt(now)])

    def write(self, now: float) -> None:
        """Atomically (a reader never sees half a file): a temporary file, then rename."""
        tmp = self.path.with_name(FILE + ".tmp")
        tmp.write_text(json.dumps(self.report(now), indent=1) + "\n")
        os.replace(tmp, self.path)
        self.written_at = now


def read(run_dir: Path) -> dict:
    """``run_dir/goodput.json``, or {} when there is none (or it cannot be read)."""
    try:
        return json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return {}


def earlier_last_step(run_dir: Path) -> int:
    """The last step earlier attempts in ``run_dir`` reached (0: none), from
    ``goodput.json`` and ``metrics.jsonl``: for ``Resumed``, read before the resumed run
    trims ``metrics.jsonl`` to its restored step."""
    last = read(run_dir).get("last_step", 0)
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line).get("step", 0)))
            except (ValueError, TypeError, AttributeError):
                continue  # a torn last line of a killed process
    return last
