"""Dead peers, named: which process of the group died, said by every survivor.

When a process of the group dies, the others learn it in one of two ways (shared/
jax-notes fact 7): a collective they are in fails at once with a Python error (gloo:
"Connection closed by peer"), or JAX's coordination client aborts the process from a
native thread (SIGABRT, a C++ check-failure trace as its last word): at once when
process 0, which runs the coordination service, died; after ``--heartbeat-timeout``
when another process died or froze. Either way each survivor prints one line naming the
dead process (index, host, pid, the step and phase it last reported: the watchdog's
table), the lowest-numbered survivor appends it to ``failures.jsonl``, and every
survivor exits ``failures.PEER_DIED`` (76).

SIGABRT is caught by a C-level handler made with ctypes: Python's ``signal`` module only
runs handlers in the main thread between bytecodes, which never happens once ``abort()``
has been called. The handler takes the GIL, prints, and ``os._exit``s.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import time

from jaxdist.cluster import failures
from jaxdist.cluster.leaving import STATE as _STATE
from jaxdist.cluster.leaving import announce_ending, exit_now, leave_after_peers
from jaxdist.cluster.leaving import say as _say


def end_for_peer_ending(index: int, ending: dict) -> None:
    """Process ``index`` ended on a failure it named: this one ends with its exit code and
    its line (a full disk on one process ends every process with 74). The lowest-numbered
    survivor records it, unless the process that failed was process 0 (it did)."""
    code = int(ending["code"])
    line = f"{ending['message']} (process {index} ended on it: exit {code}); ending this process"
    announce_ending(code, ending.get("cause", "error"), line)
    _say(line)
    record = _record_of(index)
    failure = failures.Failure(
        cause=ending.get("cause", "error"),
        message=ending["message"],
        process=index,
        host=record.get("host", ""),
        step=record.get("step"),
        exit_code=code,
        reported_by=_STATE.index,
    )
    watchdog = _STATE.watch
    lowest = min(set(range(_STATE.count)) - {index})
    if index != 0 and _STATE.index == lowest and watchdog is not None:
        failures.record(watchdog.run_dir, failure)
    failures.tell_launcher(failure)
    leave_after_peers()
    exit_now(code)


def _ending_of(index: int | None) -> dict | None:
    """What process ``index`` said it ended on, as this process's watchdog last read it
    (kept: process 0's store goes with it)."""
    watchdog = _STATE.watch
    return None if watchdog is None or index is None else watchdog.endings.get(index)


def watch(watchdog) -> None:
    """From now on, name dead peers from ``watchdog``'s table."""
    _STATE.watch = watchdog


def install_abort_handler(process_id: int, count: int) -> None:
    """Catches SIGABRT from now on (call before ``jax.distributed.initialize``: a process
    turned away while the group forms is told why). ``joined()`` once it formed."""
    _STATE.joining, _STATE.index, _STATE.count = (process_id, count), process_id, count
    if _STATE.handler is None:
        handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_abort)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signal.SIGABRT, ctypes.cast(handler, ctypes.c_void_p))
        _STATE.handler = handler


def joined(coordinator: str) -> None:
    _STATE.joining, _STATE.coordinator = None, coordinator


def _on_abort(signum: int) -> None:
    try:
        if _STATE.exiting is not None:
            if _STATE.last_word:
                _say(_STATE.last_word)
            os._exit(_STATE.exiting)
        if _STATE.joining is not None:
            process_id, count = _STATE.joining
            _say(
                f"process {process_id} of {count} was turned away by the coordination service "
                "while the group formed (JAX's message is above). The usual cause: a second "
                f"process was given the same process id {process_id} (RANK, --process-id, "
                "JAXDIST_PROCESS_ID) and took its place"
            )
            os._exit(failures.BAD_INPUT)
        culprit, why = name_dead(wait_s=0.0) if _STATE.count > 1 else (None, "")
        if culprit is None:
            _native_abort()
        end_for_dead_peer(culprit, why)
    except BaseException:
        os._exit(128 + signal.SIGABRT)


def _native_abort() -> None:
    """XLA aborted this process, no peer being dead: most often a collective that never
    completed (XLA:CPU gives up after 40 s: ``Termination timeout for all reduce``). One
    line saying what was running, a ``failures.jsonl`` record, exit 128 + SIGABRT."""
    watchdog, code = _STATE.watch, 128 + signal.SIGABRT
    phase, step = (watchdog.phase_name, watchdog.phase_step) if watchdog else ("", None)
    doing = f" in the {phase} phase of step {step}" if watchdog else ""
    message = (
        f"native code (XLA) aborted this process{doing}; its message, if any, is above (XLA "
        "aborts when a collective's participants never all arrive, or when one of its "
        "compiler's checks fails: an XLA bug worth reporting with that message)"
    )
    _say(message)
    failure = failures.Failure(
        cause="aborted",
        message=message,
        process=_STATE.index,
        host=failures.hostname(),
        step=step,
        exit_code=code,
        reported_by=_STATE.index,
    )
    failures.record(getattr(watchdog, "run_dir", None), failure)
    os._exit(code)


# What gloo, NCCL and the coordination client say when the other end is gone.
_PEER_GONE = ("gloo", "nccl", "connection", "socket closed", "unavailable", "deadline_exceeded")


def on_collective_error(err: BaseException) -> None:
    """An error in a multi-process loop: if a peer is dead (named from the watchdog's
    table) or the error says a connection failed, says which and exits 76; else returns
    (the caller re-raises: a bug, not a peer)."""
    culprit, why = name_dead(wait_s=_poll_s() * 3 + 0.5)
    if culprit is None:
        text = f"{type(err).__name__}: {err}"
        if not any(word in text.lower() for word in _PEER_GONE):
            return
        why = f"a collective failed ({text[:300]}); a peer process probably died"
    end_for_dead_peer(culprit, why)


def name_dead_peer_or_return(wait_s: float = 0.0) -> None:
    """Ends this process naming a peer that is dead (exit 76), if one is; else returns."""
    if _STATE.count > 1:
        culprit, why = name_dead(wait_s)
        if culprit is not None:
            end_for_dead_peer(culprit, why)


def end_for_dead_peer(culprit: int | None, why: str) -> None:
    ending = _ending_of(culprit)
    if ending is not None:  # it said why before it went
        end_for_peer_ending(culprit, ending)
    line = f"{why}; ending this process"
    # said again, last, should JAX's client abort (with its C++ trace) on the way out
    _STATE.exiting, _STATE.last_word = failures.PEER_DIED, line
    _say(line)
    survivors = set(range(_STATE.count)) - {culprit}
    watchdog = _STATE.watch
    record = _record_of(culprit)
    failure = failures.Failure(
        cause="dead_peer",
        message=why,
        process=culprit,
        host=record.get("host", ""),
        step=record.get("step"),
        detect_s=_silent_s(culprit),
        reported_by=_STATE.index,
    )
    if _STATE.index == min(survivors) and watchdog is not None:
        failures.record(watchdog.run_dir, failure)
    failures.tell_launcher(failure)
    exit_now(failures.PEER_DIED)


def name_dead(wait_s: float) -> tuple[int | None, str]:
    """(process, why) for the process that died: process 0 when its coordination service
    is unreachable, a peer on this host whose process is gone (at once: a launcher ends
    the group a fraction of a second after a death), else the peer whose beat stopped
    (waiting up to ``wait_s`` for the watchdog to see it); (None, "") when none looks dead."""
    if _STATE.index != 0 and _STATE.coordinator and not _reachable(_STATE.coordinator):
        return 0, _describe(0, f"its coordination service at {_STATE.coordinator} is gone")
    watchdog = _STATE.watch
    if watchdog is None:
        return None, ""
    host = failures.hostname()
    for i, peer in list(watchdog.peers.items()):  # on this host: its process is gone
        if peer.record.get("phase") != "done" and failures.process_gone(peer.record, host):
            return i, _describe(i, "its process has ended")
    deadline = time.monotonic() + wait_s
    while True:
        stale = {
            i: s
            for i in list(watchdog.peers)
            if (s := _silent_s(i)) is not None and s > watchdog.poll_s * 2.5
        }
        stopped = [i for i in stale if watchdog.peers[i].record.get("phase") != "done"]
        if stopped:
            i = max(stopped, key=lambda j: stale[j])
            return i, _describe(i, f"it stopped reporting {stale[i]:.1f}s ago")
        if time.monotonic() >= deadline:
            return None, ""
        time.sleep(0.05)


def _describe(index: int, evidence: str) -> str:
    r = _record_of(index)
    if not r and index == 0 and _STATE.coordinator:  # never heard from: its address at least
        r = {"host": _STATE.coordinator.rpartition(":")[0]}
    where = ", ".join(f"{key} {r[key]}" for key in ("host", "pid") if key in r) or "unknown host"
    last = f", last at step {r['step']} in phase {r['phase']}" if "step" in r else ""
    return f"process {index} ({where}) died or is unreachable: {evidence}{last}"


def _record_of(index: int | None) -> dict:
    watchdog = _STATE.watch
    if watchdog is None or index is None:
        return {}
    peer = watchdog.peers.get(index)
    return dict(peer.record) if peer else {}


def _silent_s(index: int | None) -> float | None:
    watchdog = _STATE.watch
    peer = watchdog.peers.get(index) if watchdog is not None and index is not None else None
    return None if peer is None else round(peer.silent_for(time.monotonic()), 3)


def _poll_s() -> float:
    return _STATE.watch.poll_s if _STATE.watch is not None else 0.0


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except OSError:
        return False
