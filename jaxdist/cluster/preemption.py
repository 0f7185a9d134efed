"""Stop cleanly when the scheduler says so: SIGUSR1 or SIGTERM -> every process stops
after the same step, the trainer saves a checkpoint and exits 75.

SLURM's ``--signal=USR1@120`` sends SIGUSR1 two minutes before the end of the allocation;
SLURM's own end, ``scancel`` and Kubernetes send SIGTERM. The handler only sets a flag
(it is installed right after the process group forms, before data is prepared, so a
signal during set-up stops too). A second SIGTERM exits at once with 143.

Agreement, through the coordination service, off the loop's path: after dispatching
step j and checking step j - 1, the loop reads the poll it started at step j - 1 (a ~0.1 ms
round trip made by a background thread meanwhile) and starts the next. The first process
to see its flag proposes "stop after step k + 3", k the step it has just dispatched, and
the first proposal stands (``set_first``). Why + 3: another process B cannot have checked
past step k - 1 (its check of step k needs this process's part of step k), so it is at most
at step k + 1. Its poll started after checking step k + 1 (at step k + 2) runs after this
process dispatched step k + 1, hence after the proposal: B reads it at step k + 3 at the
latest, before going past it. Every process thus knows the stop step before reaching it.
One process needs no agreement: it stops at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from jaxdist.cluster import failures, peers, shutdown, store

STOP_KEY = "jaxdist/stop_after_step"
MARGIN_STEPS = 3


class StopFlag:
    def __init__(self):
        self.signal_name = ""  # the first stop signal this process got
        self.stop_step: int | None = None  # agreed: stop after this step
        self.requested_by = ""  # "SIGTERM to process 1"
        self._proposed = False
        self._last_poll: float | None = None  # when the loop last called stop_after
        self._longest_gap_s = 0.0  # the longest time between two such calls
        self._paused = 0  # inside `busy()`: evaluating or saving, not stepping
        self._poller: ThreadPoolExecutor | None = None  # reads the store off the loop's path
        self._poll: Future | None = None  # started at the previous step
        self._sigterm_at: float | None = None  # the first SIGTERM (one process, no group)
        signal.signal(signal.SIGUSR1, self._set)
        if shutdown.sigterm_watched():  # in a group: the watcher thread calls us first
            shutdown.stop_on_sigterm(self._group_sigterm)
        else:
            signal.signal(signal.SIGTERM, self._sigterm)

    def _set(self, signum, frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def _sigterm(self, signum, frame) -> None:
        now = time.monotonic()
        if self._sigterm_at is not None and now - self._sigterm_at < shutdown.MERGE_S:
            return  # the same request (a group-wide kill: the launcher's forward)
        if self._sigterm_at is not None:  # a second one, seconds later: do as asked, now
            os._exit(failures.TERMINATED)
        self._sigterm_at = now
        self._set(signum, frame)

    def _group_sigterm(self) -> None:
        self._set(signal.SIGTERM, None)
        threading.Thread(target=self._end_if_stuck, daemon=True, name="jaxdist-stop").start()

    def _end_if_stuck(self) -> None:
        """A loop that stops polling is stuck in a collective (a peer died: gloo and NCCL
        may wait for ever, and JAX's heartbeat takes its full timeout): no clean stop can
        come, so SIGTERM ends the process as it would without a trainer. Stuck means no
        poll for 3 x the longest gap between polls seen (at least 2 s), while stepping."""
        while True:
            time.sleep(0.2)
            if self._last_poll is None or self._paused:
                continue
            patience_s = max(2.0, 3 * self._longest_gap_s)
            if time.monotonic() - self._last_poll > patience_s:
                peers.name_dead_peer_or_return(wait_s=1.0)  # a dead peer: named, exit 76
                print(
                    f"jaxdist: SIGTERM: the training loop made no step in {patience_s:.0f}s "
                    "(a peer process probably died); ending now",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(failures.TERMINATED)

    @contextlib.contextmanager
    def busy(self):
        """Evaluating or saving: long, but not stuck (see ``_end_if_stuck``)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last_poll = time.monotonic()

    def stop_after(self, step: int) -> int | None:
        """Call after dispatching ``step`` and checking the step before, on every process:
        the step after which every process stops (the same everywhere), or None to go on."""
        now = time.monotonic()
        if self._last_poll is not None:
            self._longest_gap_s = max(self._longest_gap_s, now - self._last_poll)
        self._last_poll = now
        if self.stop_step is not None:
            return self.stop_step
        if not store.available():
            if self.signal_name:
                self.stop_step, self.requested_by = step, self.signal_name
            return self.stop_step
        if self.signal_name and not self._proposed:
            self._proposed = True
            who = f"{self.signal_name} to process {_process_index()}"
            self._agree(store.set_first(STOP_KEY, f"{step + MARGIN_STEPS} {who}"))
        elif self._poll is not None:
            self._agree(self._poll.result())  # started a step ago: normally done
        if self.stop_step is None:
            if self._poller is None:
                self._poller = ThreadPoolExecutor(1, thread_name_prefix="jaxdist-stop-poll")
            self._poll = self._poller.submit(store.try_get, STOP_KEY)
        return self.stop_step

    def _agree(self, agreed: str | None) -> None:
        if agreed is not None:
            at, self.requested_by = agreed.split(" ", 1)
            self.stop_step = int(at)

    def close(self) -> None:
        """Ends the background poll (the loop is over)."""
        if self._poller is not None:
            self._poller.shutdown(wait=False, cancel_futures=True)


def _process_index() -> int:
    import jax

    return jax.process_index()


class Preempted(Exception):
    """The loop stopped on a stop signal after ``step``, its checkpoint saved (exit 75)."""

    def __init__(self, step: int, requested_by: str, checkpoints, run_dir=None):
        self.step = step
        self.run_dir = run_dir  # where its failure record goes (jaxdist.train.ending)
        saved = f"; checkpoint saved in {checkpoints}" if checkpoints else ""
        super().__init__(
            f"stopped after step {step} on {requested_by}{saved}; "
            f"exit {failures.PREEMPTED} (run the same command again to resume)"
        )
