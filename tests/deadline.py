"""A deadline per test: a test still running after ``TEST_DEADLINE_S`` (environment
variable, default 600 s; the slowest test of the full tier takes about 250 s) has every
thread's traceback written to stderr with its name, the processes it started killed, and
its pytest worker ended. pytest-xdist reports the worker's crash against that test and
goes on with a fresh worker, so a hang fails one named test instead of running CI into
its own time limit with no word of where. xdist does not pass a worker's stderr on, so
the report also goes to a file in ``reports_dir()``, which the session's summary prints.

Two layers: a Python thread (kills the test's child processes first, so none is left
running), and faulthandler's native watchdog a minute later in case the hang holds the
GIL and the thread never runs."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import threading

DEFAULT_S = 600.0
NATIVE_MARGIN_S = 60.0


def limit_s() -> float:
    return float(os.environ.get("TEST_DEADLINE_S") or DEFAULT_S)


def reports_dir() -> str:
    """The session's folder for hang reports (made by the first process, inherited)."""
    if "JAXDIST_TEST_HANGS" not in os.environ:
        os.environ["JAXDIST_TEST_HANGS"] = tempfile.mkdtemp(prefix="jaxdist-test-hangs-")
        atexit.register(shutil.rmtree, os.environ["JAXDIST_TEST_HANGS"], ignore_errors=True)
    return os.environ["JAXDIST_TEST_HANGS"]


def reports() -> list[str]:
    folder = reports_dir()
    return [open(os.path.join(folder, name)).read() for name in sorted(os.listdir(folder))]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc (no psutil in the quick tier's env)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after ")"
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent_of[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, up in parent_of.items() if up == parent]
        found += children
        frontier += children
    return found


class Deadline:
    """Armed around one test (``arm(nodeid)`` ... ``disarm()``)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._timer: threading.Timer | None = None

    def arm(self, nodeid: str) -> None:
        self._timer = threading.Timer(self.seconds, self._expire, args=(nodeid,))
        self._timer.name = "jaxdist-test-deadline"
        self._timer.daemon = True
        self._timer.start()
        faulthandler.dump_traceback_later(self.seconds + NATIVE_MARGIN_S, exit=True)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, nodeid: str) -> None:
        said = (
            f"jaxdist tests: {nodeid} still running after {self.seconds:.0f} s "
            f"(TEST_DEADLINE_S): its threads' tracebacks follow; its processes are killed "
            f"and its worker ends\n"
        )
        path = os.path.join(reports_dir(), f"{os.getpid()}.txt")
        with open(path, "w") as report:
            for stream in (sys.stderr, report):
                stream.write(said)
                stream.flush()
                faulthandler.dump_traceback(stream, all_threads=True)
                stream.flush()
        for child in descendants(os.getpid()):
            with contextlib.suppress(OSError):  # gone already
                os.kill(child, signal.SIGKILL)
        os._exit(70)
