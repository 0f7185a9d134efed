"""How a launcher's group learns that it is to end: one of its own processes exited
(``Exit``), or, with several machines, another node's launcher reported a failure or
was lost (``Elsewhere``). Both say themselves in the launcher's words."""

from __future__ import annotations

import signal
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
            return f"{text}: it was ended by SIGTERM"
        return text


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
