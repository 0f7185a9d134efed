"""Never hang silently: every process tells the others what it is doing, and a phase that
outlives its deadline stops the whole group with a report naming the culprit.

The training loop marks its phases (``watch.phase("data", step)``, ``"step"``, ``"eval"``,
``"save"``) and the steps it completes (``watch.completed(step)``): a few attribute
writes, no I/O. A daemon thread (``jaxdist-watchdog``) does the rest once per poll:

* publishes this process's progress to the coordination service's key-value store
  (``jaxdist/health/progress/<i>``: phase, its step, seconds in it, last completed step,
  host, pid, a beat counter) and reads every peer's;
* declares a hang when this process has been in one phase past its deadline
  (``--step-timeout`` for training steps and evaluation batches; ``--slow-phase-timeout``
  for set-up, the steps that compile and checkpoint saves), or when a peer's beat has not
  moved for ``silent_s`` (its whole process is frozen: SIGSTOP, a stuck host), or when
  another process declared one (``jaxdist/health/hang``);
* then ``jaxdist.health.hang_report`` dumps stacks, writes ``RUN_DIR/hang-report.txt`` and exits 77;
* reads the failures peers said they ended on (``jaxdist/ending/<i>``, e.g. a full disk):
  unless this process ends the same way by itself within a second, it ends with that
  process's exit code and line (``on_peer_ending``), not as a death to be timed out.

A frozen process cannot report itself; it is named by the others. One process without a
group has no store: its own deadlines still apply.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jaxdist.cluster import store
from jaxdist.cluster.failures import hostname, process_gone
from jaxdist.cluster.leaving import ENDING
from jaxdist.health.deadlines import AUTO_FACTOR, AUTO_FLOOR_S, SLOW_PHASES, WARMUP_STEPS, Deadlines

PROGRESS = "jaxdist/health/progress/"
HANG_KEY = "jaxdist/health/hang"


@dataclass(frozen=True)
class Peer:
    """What a process last published, and when (on our clock) its beat last moved."""

    record: dict  # its "beat" counts its publications
    moved_at: float  # time.monotonic() here

    def silent_for(self, now: float) -> float:
        return now - self.moved_at


class Watchdog:
    def __init__(
        self,
        process_index: int,
        process_count: int,
        deadlines: Deadlines,
        *,
        poll_s: float = 1.0,
        on_hang=None,
        on_peer_ending=None,
    ):
        self.index, self.count = process_index, process_count
        self.deadlines = deadlines
        # Short deadlines (tests) want quicker polls; a poll is one or two ~0.1 ms RPCs.
        self.poll_s = min(poll_s, max(0.05, (deadlines.step_s or AUTO_FLOOR_S) / 5))
        # (watchdog, declaration) -> never returns: jaxdist.health.hang_report.handle
        self.on_hang = on_hang
        # (index, ending) -> never returns: jaxdist.cluster.peers.end_for_peer_ending
        self.on_peer_ending = on_peer_ending
        self.endings: dict[int, dict] = {}  # what peers said they ended on, kept
        self._ending_seen: dict[int, float] = {}  # when this process first read each
        self.run_dir: Path | None = None  # where the report goes, once known
        # Background writes (a checkpoint, the sinks' files): () -> (phase, step, seconds,
        # what) or None. A file system that stops answering blocks them, not the loop.
        self.writers: list = []
        self.host, self.pid = hostname(), os.getpid()
        self.phase_name, self.phase_step, self.slow = "setup", 0, True
        self.since = time.monotonic()
        self.done_step = 0  # the last step whose results this process read
        self._last_done_at: float | None = None
        self._intervals: collections.deque[float] = collections.deque(maxlen=200)
        self._seen_done = 0  # completions counted, for the warm-up
        self.peers: dict[int, Peer] = {}
        self.beat = 0
        self.kv_stuck_since: float | None = None  # the store stopped answering
        self._stop = threading.Event()
        self._kv = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdist-kv")
        self._thread = threading.Thread(target=self._run, name="jaxdist-watchdog", daemon=True)

    # --- the main thread's side: cheap, no I/O
    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def phase(self, name: str, step: int, *, slow: bool = False) -> None:
        """Entering phase ``name`` for ``step``: its deadline runs from now."""
        self.phase_name, self.phase_step = name, step
        self.slow = slow or name in SLOW_PHASES
        self.since = time.monotonic()
        if self.slow:  # a slow phase's time is not a step interval
            self._last_done_at = None

    def completed(self, step: int) -> None:
        """The results of ``step`` were read: progress, and one more step time."""
        now = time.monotonic()
        self.done_step = step
        self._seen_done += 1
        if self._last_done_at is not None and self._seen_done > WARMUP_STEPS:
            self._intervals.append(now - self._last_done_at)
        self._last_done_at = now

    def finish(self) -> None:
        """The loop is over: silence from here on is no alarm."""
        self.phase("done", self.done_step)
        self._publish()
        self.stop()

    def stop(self) -> None:
        """No more watching (the thread ends within a poll; its store calls fail)."""
        self._stop.set()
        self._kv.shutdown(wait=False)  # its thread would otherwise outlive the run

    # --- deadlines
    def step_deadline_s(self) -> float:
        if self.deadlines.step_s:
            return self.deadlines.step_s
        if not self._intervals:
            return AUTO_FLOOR_S
        return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(self._intervals))

    def deadline_s(self) -> float:
        return self.deadlines.slow_s if self.slow else self.step_deadline_s()

    def record(self) -> dict:
        return {
            "process": self.index,
            "host": self.host,
            "pid": self.pid,
            "phase": self.phase_name,
            "step": self.phase_step,
            "in_phase_s": round(time.monotonic() - self.since, 3),
            "deadline_s": round(self.deadline_s(), 3),
            "done": self.done_step,
            "beat": self.beat,
        }

    # --- the watchdog thread
    def _run(self) -> None:
        self._publish()  # at once: the peers know this process's host and pid from the start
        while not self._stop.wait(self.poll_s):
            ended = self._peer_ended()  # first: a peer gone after saying why is not "dead"
            declared = self._check()
            if declared is not None:
                if self.on_hang is not None:
                    self.on_hang(self, declared)  # exits the process
                return
            if ended is not None and self.on_peer_ending is not None:
                self.on_peer_ending(*ended)  # exits the process

    def _peer_ended(self) -> tuple[int, dict] | None:
        """(index, ending) of a peer that ended on a named failure a while ago: a grace
        (a second at least) lets this process reach the same ending by itself first."""
        if self.count == 1:
            return None
        found = self.kv(store.get_dir, ENDING) or {}
        now = time.monotonic()
        for value in found.values():
            ending = json.loads(value)
            index = ending["process"]
            if index != self.index:
                self.endings[index] = ending
                self._ending_seen.setdefault(index, now)
        grace_s = max(1.0, 2 * self.poll_s)
        due = [i for i, seen in self._ending_seen.items() if now - seen >= grace_s]
        return (min(due), self.endings[min(due)]) if due else None

    def _check(self) -> dict | None:
        self._publish()
        self.read_peers()
        now = time.monotonic()
        if self.count > 1:
            found = self.kv(store.try_get, HANG_KEY)
            if found:
                return json.loads(found)
        stalled = self._stalled_write(now)  # before the phase: it names the path
        if stalled is not None:
            return stalled
        overdue = now - self.since - self.deadline_s()
        if overdue > 0 and self.phase_name != "done":
            return self._declare(
                f"process {self.index} spent {now - self.since:.1f}s in phase "
                f"{self.phase_name} of step {self.phase_step} (deadline {self.deadline_s():g}s)",
                stuck_s=now - self.since,
            )
        for index, peer in sorted(self.peers.items()):
            if peer.record.get("phase") == "done":
                continue  # finished: its silence is no alarm
            silent = peer.silent_for(now)
            # A peer on this host whose process is gone died: no need to wait silent_s.
            dead = silent > 3 * self.poll_s and process_gone(peer.record, self.host)
            if dead or silent > self.deadlines.silent_s:
                state = "has died" if dead else "froze, or died, or its host is unreachable"
                return self._declare(
                    f"process {index} ({where(peer.record)}) {state}: it last reported "
                    f"{silent:.1f}s ago, in phase {peer.record.get('phase')} of step "
                    f"{peer.record.get('step')}",
                    stuck_s=silent,
                    silent=index,
                    dead=dead,
                )
        if self.kv_stuck_since is not None and now - self.kv_stuck_since > self.deadlines.silent_s:
            return self._declare(
                f"the coordination service on process 0 has not answered for "
                f"{now - self.kv_stuck_since:.1f}s (process 0 frozen?)",
                stuck_s=now - self.kv_stuck_since,
                local_only=True,
            )
        return None

    def _stalled_write(self, now: float) -> dict | None:
        """A background write past the slow deadline (the checkpoint deadline): declared
        as this process stuck in that write's phase, since its start."""
        for probe in self.writers:
            found = probe()
            if found is None or found[2] <= self.deadlines.slow_s:
                continue
            phase, step, seconds, what = found
            self.phase_name, self.phase_step, self.since = phase, step, now - seconds
            return self._declare(
                f"process {self.index} spent {seconds:.1f}s in phase {phase} of step {step}"
                f" (deadline {self.deadlines.slow_s:g}s): {what}",
                stuck_s=seconds,
                writing=what,
            )
        return None

    def _declare(self, reason: str, stuck_s: float, local_only=False, **about) -> dict:
        """The hang (or, ``dead=True``, a dead peer): this process's finding, or the
        first one any process made (``jaxdist/health/hang``)."""
        declared = {"by": self.index, "reason": reason, "stuck_s": round(stuck_s, 3), **about}
        if self.count > 1 and not local_only:
            agreed = self.kv(store.set_first, HANG_KEY, json.dumps(declared))
            if agreed:
                return json.loads(agreed)
        return declared

    def _publish(self) -> None:
        self.beat += 1
        if self.count > 1:
            self.kv(store.put, f"{PROGRESS}{self.index}", json.dumps(self.record()))

    def read_peers(self) -> None:
        if self.count == 1:
            return
        found = self.kv(store.get_dir, PROGRESS)
        if found is None:
            return
        now = time.monotonic()
        for value in found.values():
            record = json.loads(value)
            index = record["process"]
            if index == self.index:
                continue
            old = self.peers.get(index)
            moved = old is None or old.record["beat"] != record["beat"]
            self.peers[index] = Peer(record, now if moved else old.moved_at)

    def kv(self, fn, *args, timeout_s: float = 5.0):
        """``fn(*args)`` on the store, or None if it failed or took over ``timeout_s``
        (a frozen process 0 holds the store: its calls would wait for ever)."""
        try:
            result = self._kv.submit(fn, *args).result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.kv_stuck_since = self.kv_stuck_since or time.monotonic()
            return None
        except Exception:
            return None
        self.kv_stuck_since = None
        return result


def where(record: dict) -> str:
    """A process's host and pid, from its published record."""
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}"
