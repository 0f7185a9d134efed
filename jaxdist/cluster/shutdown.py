"""How a process of a group ends: SIGTERM, an uncaught error, a deliberate exit code.

After ``jax.distributed.initialize`` a normal interpreter exit waits in JAX's shutdown
barrier for every other process, and SIGTERM goes to JAX's preemption notifier (which
keeps the process running): each exit path here is made so that neither happens by
accident. ``jaxdist.initialize`` installs them once the group has formed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback

import jax

from jaxdist.cluster import failures, leaving, peers, store


def exit_on_sigterm() -> None:
    """SIGTERM exits at once with 143. jax.distributed.initialize hands SIGTERM to JAX's
    preemption notifier, which keeps the process running (shared/jax-notes fact 2), so
    neither a launcher ending its group, nor SLURM, nor ``kill`` could end it; a handler
    installed after initialize replaces the notifier. A Python handler runs only when the
    main thread is in Python, not while it waits in XLA (a collective whose peer died,
    a long step), so a thread woken by the signal through the wakeup fd exits too."""
    if threading.current_thread() is not threading.main_thread():
        return  # handlers can only be installed from the main thread
    signal.signal(signal.SIGTERM, _ignore_in_main_thread)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(
        target=_watch_signals, args=(read_fd, previous), daemon=True, name="jaxdist-sigterm"
    ).start()


def _watch_signals(read_fd: int, previous_fd: int) -> None:
    while True:
        numbers = os.read(read_fd, 512)  # one byte per signal that has a Python handler
        if previous_fd >= 0:  # whoever had the wakeup fd before still gets woken
            with contextlib.suppress(OSError):
                os.write(previous_fd, numbers)
        for _ in range(numbers.count(signal.SIGTERM)):
            _SIGTERM_STOP.received()


MERGE_S = failures.SIGTERM_MERGE_S


class _SigtermStop:
    """What SIGTERM does once the group has formed: exit 143 at once, unless a training
    loop asked for a clean stop (``stop_on_sigterm``): then the first SIGTERM calls its
    callback and only a second one, ``MERGE_S`` or more later, exits. A peer found dead
    on the first is named (exit 76) instead: a launcher ending the group after a death
    sends SIGTERM within a second of it. Process-wide, as signal handlers are."""

    def __init__(self):
        self.callback = None
        self.first: float | None = None

    def received(self) -> None:
        now = time.monotonic()
        if leaving.exiting() or (self.first is not None and now - self.first < MERGE_S):
            return  # on its way out already; or the same request
        again, self.first = self.first is not None, self.first or now
        if not again:
            peers.name_dead_peer_or_return()
        if self.callback is None or again:
            leaving.exit_now(failures.TERMINATED)  # 143, as a shell reports SIGTERM
        self.callback()


_SIGTERM_STOP = _SigtermStop()


def sigterm_watched() -> bool:
    """Whether SIGTERM goes through ``jaxdist.initialize``'s watcher (a process group)."""
    return signal.getsignal(signal.SIGTERM) is _ignore_in_main_thread


def stop_on_sigterm(callback) -> None:
    """In a process group: the first SIGTERM calls ``callback`` instead of exiting."""
    _SIGTERM_STOP.callback = callback


def _ignore_in_main_thread(signum, frame) -> None:
    # The watcher thread acts on every SIGTERM (it is woken even while the main thread
    # waits in XLA); the main thread's handler only makes Python write the wakeup fd.
    pass


def exit_fast_on_uncaught_error(process_id: int) -> None:
    """An uncaught exception prints with a ``[rank N]`` prefix and exits at once with 1.
    A normal interpreter exit would wait in JAX's shutdown barrier for the other
    processes (which keep running), up to the shutdown timeout, and then abort."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        lines = traceback.format_exception(kind, value, tb)
        text = "".join(lines).rstrip("\n").replace("\n", f"\n[rank {process_id}] ")
        print(f"[rank {process_id}] {text}", file=sys.stderr, flush=True)
        if kind is KeyboardInterrupt:
            previous(kind, value, tb)
        leaving.exit_now(failures.FAILED)

    sys.excepthook = hook
    _exit_fast_on_sys_exit()


def _exit_fast_on_sys_exit() -> None:
    """``sys.exit(3)`` in the main thread leaves at once with 3 (``exit_now``). The
    interpreter's own exit would wait in JAX's shutdown barrier until every other process
    ended by itself (124 s for a peer with 120 s of work left), so a launcher,
    ``jaxdist.spawn`` or srun learnt of the failure only then; now they, and the others'
    dead-peer line, name the process within seconds. ``sys.exit()`` and ``sys.exit(0)``
    still wait there: the group ends together. (A bare ``raise SystemExit(3)`` does not
    pass through ``sys.exit`` and is not seen.)"""
    interpreter_exit = sys.exit
    main_thread = threading.main_thread()

    def deliberate_exit(status=None):
        if status is None or status == 0 or threading.current_thread() is not main_thread:
            interpreter_exit(status)
        if not isinstance(status, int):  # sys.exit("why"): printed, exit 1, as Python does
            print(status, file=sys.stderr, flush=True)
        exit_now(status if isinstance(status, int) else 1)

    sys.exit = deliberate_exit


def exit_now(code: int) -> None:
    """Ends the process with ``code``. With several processes and a non-zero code, skips
    JAX's shutdown barrier (it would wait for peers that are still training)."""
    if code and jax.distributed.is_initialized() and jax.process_count() > 1:
        if code == failures.PREEMPTED:
            _leave_together()
        leaving.leave_after_peers()  # a failure it announced: the others say theirs first
        leaving.exit_now(code)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == failures.STORAGE:
        # A save abandoned on a full disk leaves orbax's threads writing; an interpreter
        # shutdown under them prints their errors (asyncio's closed loop, sys.meta_path is
        # None) after jaxdist's one line. Nothing is left to flush: leave at once.
        os._exit(code)
    leaving.expect_exit(code)  # JAX's client aborting during a normal shutdown keeps it
    sys.exit(code)


def _leave_together(timeout_s: float = 30) -> None:
    """A preemption stops every process at the same step, but they finish saving and
    reporting at different moments. Process 0 hosts the coordination service: leaving
    first would kill it under the others, whose clients then abort mid-report. So all
    meet at a barrier of the store, and process 0 leaves last."""
    leaving.expect_exit(failures.PREEMPTED)  # a client abort on the way out keeps 75
    try:
        store.barrier("jaxdist/exit/preempted", timeout_s)
    except Exception:  # a peer already gone: nothing to wait for
        return
    if jax.process_index() == 0:
        time.sleep(0.5)  # the others' exits, before the service goes
