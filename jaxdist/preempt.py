"""Stop cleanly when the scheduler says so.

SLURM's ``--signal=USR1@120`` sends SIGUSR1 two minutes before the end of the allocation.
The handler only sets a flag; processes agree on it at the next check (an all-gather),
so every process stops after the same step and exits 75. SIGTERM is not a stop request:
it ends a process of a group at once with 143 (``jaxdist.process``), which is what a
launcher ending its group, ``scancel`` or ``kill`` mean. ``jaxdist.launch`` reports exit
75 as a preemption, not a failure, and lets the other processes stop by themselves.
"""

from __future__ import annotations

import signal

import jax
import numpy as np

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again later (slurm/8node.sh requeues on it)


class StopFlag:
    def __init__(self, signum: int = signal.SIGUSR1):
        self.raised = False
        self.signum = signum
        signal.signal(signum, self._set)

    def _set(self, signum, frame) -> None:
        self.raised = True

    def agreed(self) -> bool:
        """True on every process if any process got the signal (a collective: call it at
        the same step on every process)."""
        if jax.process_count() == 1:
            return self.raised
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.array(self.raised))
        return bool(np.any(flags))
