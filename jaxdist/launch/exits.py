"""How a launcher's group learns that it is to end: one of its own processes exited
(``Exit``), or, with several machines, another node's launcher reported a failure or
was lost (``Elsewhere``). Both say themselves in the launcher's words."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass

from jaxdist.cluster import failures


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class Exit:
    rank: int  # the process's index among its launcher's, 0 .. nproc-1
    returncode: int  # as subprocess reports it: -S for a death by signal S
    first_rank: int = 0  # the global rank of the launcher's first process
    node: int | None = None  # the launcher's node rank, with several machines
    # it exited, but threads blocked in the kernel keep it from ending (``wait``)
    stuck: bool = False

    @property
    def global_rank(self) -> int:
        return self.first_rank + self.rank

    @property
    def code(self) -> int:
        """As a shell reports it: 128 + S for a death by signal S."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def preempted(self) -> bool:
        return self.returncode == failures.PREEMPTED

    @property
    def who(self) -> str:
        on = "" if self.node is None else f" on node {self.node}"
        return f"rank {self.global_rank}{on}"

    def __str__(self) -> str:
        if self.returncode == 0:
            return f"{self.who} finished"
        if self.preempted:
            return f"{self.who} stopped for preemption (exit {failures.PREEMPTED})"
        text = f"{self.who} failed with exit code {self.code}"
        if self.returncode < 0:
            return f"{text}: it was killed by {signal_name(-self.returncode)}"
        if self.returncode == failures.TERMINATED:  # jaxdist.initialize's SIGTERM handler
            text = f"{text}: it was ended by SIGTERM"
        if self.stuck:
            text += (
                " (it exited, but threads blocked in the kernel, on a frozen or hung file "
                "system or device, keep it from ending until that answers; not waited for)"
            )
        return text


STUCK_S = 5.0  # an exited process whose threads have not ended after this is stuck


def wait(proc: subprocess.Popen, poll_s: float = 0.2) -> tuple[int, bool]:
    """(returncode, stuck) of ``proc`` once it exits. A process whose main thread exited
    while other threads sleep uninterruptibly in the kernel (a write to a frozen file
    system) cannot end, and no signal ends it, until the kernel returns: after
    ``STUCK_S`` as a zombie it counts as exited, with the code its exit gave."""
    zombie_since = None
    while True:
        try:
            return proc.wait(timeout=poll_s), False
        except subprocess.TimeoutExpired:
            pass
        if failures.process_state(proc.pid) != "Z":
            zombie_since = None
            continue
        zombie_since = zombie_since or time.monotonic()
        if time.monotonic() - zombie_since >= STUCK_S:
            return _exit_status(proc.pid), True


def _exit_status(pid: int) -> int:
    """The exit code a zombie's main thread left (``/proc/PID/stat``'s exit_code, field
    52, as waitpid reports it), as subprocess gives it: -S for a signal; 1 if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            status = int(stat.read().rsplit(") ", 1)[1].split()[49])
    except (OSError, IndexError, ValueError):
        return failures.FAILED
    return -(status & 0x7F) if status & 0x7F else status >> 8


@dataclass(frozen=True)
class Elsewhere:
    """Another machine's failure, as that node's launcher (or node 0's, for a lost
    node) reported it; this launcher ends its own processes and exits with ``code``."""

    text: str  # "rank 3 on node 1 failed with exit code 3"
    code: int
    node: int  # where it happened
    preempted = False

    @property
    def returncode(self) -> int:
        return self.code

    def __str__(self) -> str:
        return self.text
