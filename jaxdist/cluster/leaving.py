"""The one way out of a process that must stop now, and how its ending is told to the
others of its group.

``exit_now`` leaves at once (no shutdown barrier, no atexit) with a fixed exit code,
which a SIGABRT from JAX's client on the way out keeps (``expect_exit``). A process
ending on a failure it named (a full disk, bad input) says so in the store
(``announce_ending``, ``jaxdist/ending/<i>``): the others' watchdogs then end them with
the same code and line instead of waiting to find it dead, and process 0, which hosts
the store, leaves only once the others have said how they end (``leave_after_peers``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from jaxdist.cluster import store

ENDING = "jaxdist/ending/"  # + process index: the failure a process ended on, named


@dataclass
class _State:
    """Process-wide, as signal dispositions are: what the SIGABRT handler reads."""

    watch: object | None = None  # jaxdist.health.watchdog.Watchdog, once the loop is watched
    exiting: int | None = None  # a deliberate exit under way, with this code
    last_word: str = ""  # said again if JAX's client aborts on the way out
    announced: bool = False  # this process told the others how it ends (announce_ending)
    joining: tuple[int, int] | None = None  # (process_id, count) while the group forms
    index: int = 0
    count: int = 1
    coordinator: str = ""  # HOST:PORT of process 0's coordination service
    handler: object = field(default=None, repr=False)  # the ctypes callback, kept alive


STATE = _State()


def exit_now(code: int) -> None:
    """Flushes and ends the process with ``code`` at once (no shutdown barrier, no
    atexit); a SIGABRT from JAX's client while on the way out keeps ``code``.

    Flushed from another thread, for at most a second: the caller may be a signal
    handler or the watchdog's thread while the main thread holds a stream's lock (or is
    blocked writing to a full pipe)."""
    STATE.exiting = code
    with contextlib.suppress(Exception):
        flusher = threading.Thread(target=_flush, daemon=True)
        flusher.start()
        flusher.join(timeout=1)
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def expect_exit(code: int, last_word: str = "") -> None:
    """A deliberate exit with ``code`` is under way: an abort meanwhile keeps the code,
    and says ``last_word`` again after JAX's trace."""
    STATE.exiting, STATE.last_word = code, last_word


def exiting() -> bool:
    """Whether this process is already on its way out (a later SIGTERM changes nothing)."""
    return STATE.exiting is not None


def announce_ending(code: int, cause: str, line: str) -> None:
    """This process ends with ``code`` on a failure it named (``line``): the others are
    told (their watchdogs end them the same way, not as the death of this one), within
    two seconds at most (a frozen store is not waited for)."""
    expect_exit(code, line)
    if STATE.count <= 1:
        return
    STATE.announced = True
    record = {"process": STATE.index, "code": code, "cause": cause, "message": line}
    put = threading.Thread(
        target=store.put, args=(f"{ENDING}{STATE.index}", json.dumps(record)), daemon=True
    )
    put.start()
    put.join(timeout=2.0)


def leave_after_peers(timeout_s: float = 10.0) -> None:
    """Process 0, having said how it ends, waits until every other process said so too
    (or ``timeout_s``): it hosts the store, and leaving first would abort the others'
    clients before they said their own line."""
    if STATE.index != 0 or STATE.count <= 1 or not STATE.announced:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if len(store.get_dir(ENDING)) >= STATE.count:
                time.sleep(0.5)  # their lines and exits, before the service goes
                return
        except Exception:
            return
        time.sleep(0.05)


def say(text: str) -> None:
    prefix = f"[rank {STATE.index}] " if STATE.count > 1 else ""
    with contextlib.suppress(Exception):
        os.write(2, f"{prefix}jaxdist: error: {text}\n".encode())
