"""SIGTERM or SIGUSR1 to ``python -m jaxdist.launch``: the group stops as one rank would.

What Kubernetes, ``scancel`` and SLURM's ``--signal=USR1@120`` send is a request to stop
cleanly, so the launcher forwards it to every rank (the trainer then stops after the same
step on every process, saves and exits 75) and waits up to ``--stop-grace`` s. Its own
exit code tells a wrapper what happened: 75 when every rank saved (run the same command
again), the first failing rank's code when one failed instead, 143 only when it had to
end ranks itself (the grace expired, or a second SIGTERM: "stop now", as for a rank).
"""

from __future__ import annotations

import signal
import time

from jaxdist.cluster import failures

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# SLURM's --signal=USR1@120 warns 2 minutes ahead: a large checkpoint may take that long
STOP_GRACE_S = 120.0
POLL_S = 0.05


class StopRequested(BaseException):
    """The first stop signal, raised in the main thread wherever it is (a BaseException,
    like KeyboardInterrupt, so that no ``except Exception`` swallows it). ``received``:
    every stop signal so far, this one first, growing as more arrive; ``code``: the
    launcher's exit code, set once ``stop`` has stopped the group."""

    def __init__(self, signum: int, received: list[int]):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.received = signum, received
        self.code: int | None = None


def install() -> None:
    """Only the first stop signal raises: later ones are recorded, so that they cannot
    interrupt the stop (or the ending of the group) half-way."""
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)
        if len(received) == 1:
            raise StopRequested(signum, received)

    for signum in SIGNALS:
        signal.signal(signum, handler)


def stop(group, request: StopRequested, out, *, grace: float, stop_grace: float) -> int:
    """Forwards the stop signal to every rank of ``group`` (a ``group.Group``), waits for
    them, ends the group and returns the launcher's exit code, its last line said."""
    name = request.args[0]
    out.say(f"{name}: asking every rank to save a checkpoint and stop within {stop_grace:g}s")
    forwarded: set[int] = set()
    deadline = time.monotonic() + stop_grace
    while True:
        for signum in request.received:  # each kind once: a rank takes a repeat as "now"
            if signum not in forwarded:
                forwarded.add(signum)
                group.send(signum)
        code = _outcome(name, group, out, grace)
        if code is not None:
            return code
        if request.received.count(signal.SIGTERM) >= 2:
            why = "a second SIGTERM"
            break
        if time.monotonic() > deadline:
            why = f"not stopped within {stop_grace:g}s (--stop-grace)"
            break
        time.sleep(POLL_S)
    exited = list(group.done)
    running = sorted(set(range(len(group.procs))) - {e.rank for e in exited})
    if not running:  # the last exited just now
        return _outcome(name, group, out, grace)
    first = group.place.first_rank  # global ranks: this machine's first is R x K on node R
    running = [first + rank for rank in running]
    saved = [e.global_rank for e in exited if e.preempted]
    # The trainer takes a second SIGTERM as "exit now" (143), SIGKILL after --grace ends
    # one that cannot (stuck in a collective, frozen).
    group.end(grace, at_once=True)
    also = f"; {_ranks(saved)} saved a checkpoint and exited {failures.PREEMPTED}" if saved else ""
    newest = group.newest_checkpoint()
    newest = f"; {newest}" if newest else ""
    out.say(f"stopped by {name}: killed {_ranks(running)}: {why}{also}{newest}; exit "
            f"{failures.TERMINATED}")  # fmt: skip
    return failures.TERMINATED


def exit_code(request: StopRequested, out) -> int:
    """The launcher's exit code; 143 when the signal came while no group could be asked
    to stop (being started or ended: ``group.Group`` ends it on the way out)."""
    if request.code is None:
        name = request.args[0]
        out.say(f"stopped by {name} while the processes were started or ended; exit 143")
        return failures.TERMINATED
    return request.code


def _outcome(name: str, group, out, grace: float) -> int | None:
    """The exit code once a rank has failed or every rank has exited, else None."""
    failed = [e for e in group.done if e.returncode not in (0, failures.PREEMPTED)]
    if failed:
        return _failed(name, group, failed[0], out, grace)
    if len(group.done) < len(group.procs):
        return None
    group.end(grace)  # children the ranks left behind
    return _stopped(name, group.done, out)


def _failed(name: str, group, first, out, grace: float) -> int:
    """A rank exited neither 0 nor 75: as without a signal, the first to fail, by time,
    names the code, the culprit is named, and the others are ended at once."""
    out.say(f"{first}: ending the other processes")
    culprit = group.culprit(first)
    if culprit:
        out.say(culprit)
    group.end(grace, at_once=True)
    out.say(f"stopped by {name}: not every rank saved a checkpoint: {first}; exit {first.code}")
    return first.code


def _stopped(name: str, done: list, out) -> int:
    """Every rank exited by itself, 0 or 75: 75 unless all finished (the signal came
    after the last step)."""
    codes = {e.returncode for e in done}
    if codes == {0}:
        out.say(f"stopped by {name}: every rank had finished (exit 0); exit 0")
        return 0
    if codes == {failures.PREEMPTED}:
        said = f"every rank saved a checkpoint and exited {failures.PREEMPTED}"
    else:
        said = "; ".join(map(str, sorted(done, key=lambda e: e.rank)))
    out.say(f"stopped by {name}: {said}; the same command resumes")
    return failures.PREEMPTED


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
