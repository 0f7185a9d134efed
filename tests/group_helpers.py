"""Process groups under test: ``python -m jaxdist.launch`` watched from outside (its
output, every process ever below it, all killed at teardown), and a few /proc readers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import alive

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
MLP = [
    "--in-features",
    "12",
    "--num-classes",
    "5",
    "--hidden",
    "16",
    "--depth",
    "1",
]  # the small model of the group tests
ENV.pop("JAX_NUM_CPU_DEVICES", None)  # each command's own flags decide its device count


def parents() -> dict[int, int]:
    """pid -> parent pid of every process on the machine (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"JAXDIST_PROCESS_ID="):
            return int(item.split(b"=", 1)[1])
    return None


class Launcher:
    """``python -m jaxdist.launch ARGS``, its output to a file (a pipe nobody read would
    fill and block it), and every process ever seen below it."""

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None, cwd=None):
        self.log = tmp_path / "launch.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxdist.launch", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**ENV, **(env or {})},
                cwd=cwd,
            )
        self.seen: set[int] = set()
        self._started: dict[int, str] = {}  # pid -> its start time: pids are reused

    def below(self) -> set[int]:
        """The launcher's descendants now (also remembered for the teardown)."""
        tree, found, todo = parents(), set(), [self.proc.pid]
        while todo:
            pid = todo.pop()
            children = {child for child, parent in tree.items() if parent == pid}
            found |= children
            todo.extend(children)
        self.seen |= found
        for pid in found:
            self._started.setdefault(pid, start_time(pid))
        return found

    def ranks(self) -> dict[int, int]:
        return {rank_of(pid): pid for pid in self.below() if rank_of(pid) is not None}

    def output(self) -> bytes:
        return self.log.read_bytes()

    def text(self) -> str:
        return self.output().decode(errors="replace")

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"launcher ended waiting for {what}: {self.text()}"
            assert time.monotonic() < deadline, f"no {what} in {timeout}s: {self.text()[-3000:]}"
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.below()
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pid in self.seen:  # only if the pid is still the process seen, not a reuse
            if alive(pid) and start_time(pid) == self._started.get(pid):
                os.kill(pid, signal.SIGKILL)


def start_time(pid: int) -> str | None:
    """When ``pid`` started (field 22 of /proc/PID/stat, in clock ticks), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


# The bound on a wait for something that normally takes seconds (a signal handled, a
# process ended): generous, since CI's 2 cores may be shared with other work and a test
# must not fail for that; a wait still ends as soon as what it waits for happens.
PATIENCE_S = 180


def gone_within(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
