"""How long each phase of a process may take before the watchdog declares a hang:
``--step-timeout`` for a training step or an evaluation batch (0: automatic, from the
run's own step times), ``--slow-phase-timeout`` for set-up, the steps that compile and
checkpoint saves, and how long a peer may be silent before it counts as frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

SLOW_PHASES = ("setup", "save")  # always on the slow deadline
AUTO_FLOOR_S = 300.0  # --step-timeout 0 (auto): max(5 minutes, 20 x the median step)
AUTO_FACTOR = 20
WARMUP_STEPS = 5  # completions not in the median (compilation, caches warming up)


@dataclass(frozen=True)
class Deadlines:
    step_s: float = 0.0  # 0: auto
    slow_s: float = 1800.0
    silent_s: float = 50.0  # a peer that has not reported for this long is frozen

    def describe(self) -> str:
        step = f"{self.step_s:g}s" if self.step_s else (
            f"auto (max({AUTO_FLOOR_S:g}s, {AUTO_FACTOR} x the median step time after "
            f"{WARMUP_STEPS} steps))"
        )  # fmt: skip
        return (
            f"--step-timeout {step}, --slow-phase-timeout {self.slow_s:g}s (set-up, "
            f"compilation, checkpoints); a process silent for {self.silent_s:g}s is frozen"
        )
