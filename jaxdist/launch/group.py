"""N local processes of one command, started, watched and ended as one group: the one
implementation behind ``python -m jaxdist.launch`` and ``jaxdist.spawn``.

* Output is forwarded as bytes, each line prefixed ``[rank R] `` (``jaxdist.launch.rank_output``).
* A thread per process waits for it, so exits are seen in the order they happen: the
  first rank to fail, by time, is the one reported.
* Ending the group: SIGTERM to every rank's process group, SIGKILL after ``grace`` s.
  A rank that stopped for preemption (exit 75) first gives the others ``grace`` s to stop
  at the same step by themselves. A stop signal to the launcher goes to every rank, which
  get ``stop_grace`` s to save and exit (``jaxdist.launch.stop_signals``).
* No orphans. Each rank leads its own process group (its children are signalled with
  it) and gets SIGKILL when the thread that started it dies (Linux ``PR_SET_PDEATHSIG``,
  ``kill -9`` of us included); a guard process SIGKILLs every rank's process group when
  its pipe from us closes without a goodbye, which also reaches the ranks' children and
  works where prctl does not exist.
* Several machines: the group is this machine's share of a larger one
  (``placement.Placement``), prefixes and messages show global ranks, and another
  machine's failure interrupts the wait (``interrupt``; ``jaxdist.launch.nodes``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from jaxdist.cluster import failures
from jaxdist.launch import exits, orphans, records, stop_signals
from jaxdist.launch.exits import Elsewhere, Exit
from jaxdist.launch.placement import Placement, free_port, rank_env
from jaxdist.launch.rank_output import Output, forward

__all__ = ["Elsewhere", "Exit", "Group", "Placement", "free_port", "rank_env", "run"]

KILL_WAIT_S = 5.0  # after SIGKILL: time for the kernel to tear the processes down


class Group:
    """``nproc`` processes of ``command``, process r with ``rank_env(r, place, ...)``.
    ``watcher`` is called with each ``Exit`` as it happens (from a waiting thread)."""

    def __init__(
        self,
        command: list[str],
        nproc: int,
        out: Output,
        place: Placement | None = None,
        watcher: Callable[[Exit], None] | None = None,
        **env_options,
    ):
        self.out, self.watcher = out, watcher
        self.place = (place or Placement()).started(nproc)
        self.exits: queue.SimpleQueue[Exit | Elsewhere] = queue.SimpleQueue()
        self.done: list[Exit] = []  # every exit so far, in the order they happened
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.empty: set[int] = set()  # process groups known to be empty: never signalled
        self.stuck: set[int] = set()  # pids that exited but cannot end (exits.wait)
        self.ended = False
        self.guard = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", orphans.GUARD],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C or hang-up of our terminal does not reach it
        )
        self.failure_dir = tempfile.mkdtemp(prefix="jaxdist-failures-")
        env_options["failure_dir"] = self.failure_dir
        try:
            for rank in range(nproc):
                self._start(rank, command, rank_env(rank, self.place, **env_options))
        except BaseException:
            self.end(0)
            raise

    def _start(self, rank: int, command: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(
            orphans.dying_with_us(command),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Its own process group, children included; not its own session: Linux's
            # autogroup scheduler shares the CPU fairly between sessions, and on a CPU
            # the ranks oversubscribe (2 x 4 emulated devices on 2 cores) that made the
            # same plain-JAX step ~20% slower (204-243 ms against 177-204).
            process_group=0,
        )
        self.procs.append(proc)
        self._tell_guard(f"add {proc.pid}")
        shown = self.place.first_rank + rank
        for target, args in ((forward, (shown, proc.stdout, self.out)), (self._reap, (rank, proc))):
            thread = threading.Thread(target=target, args=args, daemon=True)
            thread.start()
            self.threads.append(thread)

    def _reap(self, rank: int, proc: subprocess.Popen) -> None:
        returncode, stuck = exits.wait(proc)
        if stuck:
            self.stuck.add(proc.pid)
        try:
            os.killpg(proc.pid, 0)  # children left behind keep the pid from being reused
        except ProcessLookupError:  # none: the pid may be reused, never signal it again
            self.empty.add(proc.pid)
        except PermissionError:
            pass
        self.done.append(Exit(rank, returncode, self.place.first_rank, self.place.node, stuck))
        self.exits.put(self.done[-1])
        if self.watcher is not None:
            self.watcher(self.done[-1])

    def interrupt(self, event: Elsewhere) -> None:
        """Another machine failed: ``first_failure`` returns ``event`` now."""
        self.exits.put(event)

    def _tell_guard(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # a guard killed by someone else
            self.guard.stdin.write(f"{line}\n".encode())
            self.guard.stdin.flush()

    def first_failure(self, timeout: float | None = None) -> Exit | Elsewhere | None:
        """Blocks until every process has exited 0 (None) or one has failed: the first
        to fail, by time, or an ``interrupt``. Raises TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in self.procs:
            done = self._next_exit(deadline)
            if done.returncode:
                return done
        return None

    def _next_exit(self, deadline: float | None) -> Exit | Elsewhere:
        while True:
            try:
                return self.exits.get(timeout=0.2)  # short waits: Ctrl-C gets through
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError from None

    def wait_exited(self, seconds: float) -> bool:
        """True once every process has exited; False if some still run after ``seconds``."""
        deadline = time.monotonic() + seconds
        while any(p.returncode is None and p.pid not in self.stuck for p in self.procs):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def end(self, grace: float, *, at_once: bool = False) -> None:
        """SIGTERM to every rank's process group, SIGKILL after ``grace`` s (also to the
        children a rank that has exited left behind); then dismisses the guard.
        ``at_once`` (a rank failed, or a stop that could not finish): SIGTERM twice. The
        trainer takes a first SIGTERM as a request to stop cleanly and save (or, a peer
        being dead, names it and exits 76), and a second as "exit now"; two within
        ``failures.SIGTERM_MERGE_S`` are one request (a group-wide kill), so the second comes
        after it. Once only: a stop signal's handling ends the group first. A rank's
        death that no process recorded, or a record a rank could not write, is written here
        (``jaxdist.launch.records``)."""
        if self.ended:
            return
        self.ended = True
        died = [e for e in self.done if e.returncode < 0]  # by a signal, before ours
        self.send(signal.SIGTERM)
        for proc in self.procs:  # a stopped (frozen) rank would take SIGTERM only once resumed
            if proc.poll() is None and _stopped(proc.pid):
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if at_once and not self.wait_exited(failures.SIGTERM_MERGE_S + 0.3):
            self.send(signal.SIGTERM)
        self.wait_exited(grace)
        self.send(signal.SIGKILL)
        self.wait_exited(KILL_WAIT_S)
        for thread in self.threads:
            thread.join(timeout=1)  # the last lines of output
        self._tell_guard("done")
        records.unreported(Path(self.failure_dir), died, self.out.say)
        records.unwritten(Path(self.failure_dir), self.out.say)
        shutil.rmtree(self.failure_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.guard.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.guard.wait(timeout=KILL_WAIT_S)

    def newest_checkpoint(self) -> str:
        return records.newest_checkpoint(Path(self.failure_dir))

    def culprit(self, first: Exit | Elsewhere) -> str:
        """Who is to blame, when it is not ``first``: a rank that is stopped (SIGSTOP: it
        cannot exit by itself), or the one its peers named (``failures.tell_launcher``).
        Global ranks; "" for another machine's failure (its launcher says)."""
        if isinstance(first, Elsewhere):
            return ""
        procs = enumerate(self.procs, self.place.first_rank)
        stopped = [r for r, p in procs if p.poll() is None and _stopped(p.pid)]
        told = failures.from_launcher_dir(Path(self.failure_dir))
        return failures.culprit_line(first.global_rank, told, stopped)

    def send(self, sig: int) -> None:
        """``sig`` to every rank's process group (its children too)."""
        for proc in self.procs:
            if proc.pid not in self.empty:
                with contextlib.suppress(OSError):  # the group is empty: nothing to end
                    os.killpg(proc.pid, sig)


def _stopped(pid: int) -> bool:
    """Linux: the process is stopped (state T), e.g. by SIGSTOP."""
    return failures.process_state(pid) in ("T", "t")


def run(
    command: list[str],
    nproc: int,
    out: Output,
    *,
    grace: float = 5.0,
    timeout: float | None = None,
    stop_grace: float = stop_signals.STOP_GRACE_S,
    place: Placement | None = None,
    peers=None,
    **env_options,
) -> Exit | Elsewhere | None:
    """Runs the group to its end: None when every process exited 0, else the first
    failure, by time, once the others are ended. Ctrl-C (KeyboardInterrupt) and, after
    ``timeout`` s, TimeoutError end them all and propagate; a stop signal
    (``stop_signals.StopRequested``) propagates once the group has stopped, with the
    launcher's exit code. ``peers`` (several machines, ``jaxdist.launch.nodes``) hears of
    every exit and interrupts the wait when another machine fails."""
    group = Group(command, nproc, out, place, peers and peers.exited, **env_options)
    if peers is not None:
        peers.attach(group)
    first = None
    try:
        first = group.first_failure(timeout)
        if first is not None and first.preempted:
            out.say(f"{first}: the others get {grace:g}s to stop at the same step")
            group.wait_exited(grace)
        elif first is not None:
            which = "this node's" if isinstance(first, Elsewhere) else "the other"
            out.say(f"{first}: ending {which} processes")
            culprit = group.culprit(first)
            if culprit:
                out.say(culprit)
        return first
    except stop_signals.StopRequested as request:
        request.code = stop_signals.stop(group, request, out, grace=grace, stop_grace=stop_grace)
        raise
    except KeyboardInterrupt:
        out.say("interrupted: ending all processes")
        group.end(grace, at_once=True)
        saved = group.newest_checkpoint()  # whether the ranks saved before they were ended
        if saved:
            out.say(saved)
        raise
    except TimeoutError:
        out.say(f"not finished after {timeout:g}s: ending all processes")
        raise
    finally:
        group.end(grace, at_once=first is not None and not first.preempted)
