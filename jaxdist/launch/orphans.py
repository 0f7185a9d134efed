"""No orphans: what keeps a launcher's processes from outliving it (``jaxdist.launch.group``).

Two independent means, so that either alone suffices: each rank asks Linux for SIGKILL
when the thread that started it dies (``PR_SET_PDEATHSIG``, which survives ``exec``), and
a guard process, a separate interpreter that outlives us, SIGKILLs every rank's process
group when its pipe from us closes without a goodbye (``kill -9`` of the launcher too, and
where ``prctl`` does not exist).
"""

from __future__ import annotations

import os
import sys

# Run by a separate interpreter: it holds the read end of a pipe from us and outlives us.
GUARD = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    word, _, pgid = line.partition(" ")
    if word == "done":
        sys.exit()
    groups.add(int(pgid))
for pgid in groups:  # the pipe closed without "done": our owner died
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


# Runs in each rank's process, then becomes the command: PR_SET_PDEATHSIG (1) = SIGKILL.
DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))
if os.getppid() != int(sys.argv[1]):  # our starter died before prctl: no signal would come
    os._exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as err:
    print(f"jaxdist: cannot run {sys.argv[2]!r}: {err}", file=sys.stderr, flush=True)
    os._exit(127)  # as a shell reports a command that cannot run
"""


def dying_with_us(command: list[str]) -> list[str]:
    """``command`` run through a small interpreter that asks Linux for SIGKILL when the
    thread starting it dies, then execs the command (the request survives exec). Not a
    ``preexec_fn``: that forces a real fork() of our multithreaded (JAX) process, which
    can deadlock the child before it execs. Elsewhere the guard alone covers it."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT, str(os.getpid()), *command]
