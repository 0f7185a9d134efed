"""The launcher when things go wrong: bytes that are not UTF-8, the launcher itself killed
or hung up, a rank killed mid-training, several failures in a row, a preemption, and
SIGTERM reaching a rank after jax.distributed.initialize.

Every test bounds its own time and, in the fixture's teardown, SIGKILLs every process it
ever saw below its launcher. Waits are on the condition itself (a file, a line, a reaped
rank, a main thread asleep in a barrier), never on a sleep, with a deadline that names
what did not come."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from group_helpers import PATIENCE_S, gone_within
from helpers import alive
from jaxdist.cluster import failures


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_bytes_that_are_not_utf8_are_forwarded(tmp_path, launcher):
    job = script(
        tmp_path,
        "latin1.py",
        "import sys\nout = sys.stdout.buffer\n"
        "out.write(b'caf\\xe9 \\xff in Latin-1\\n')\n"
        "for i in range(5000):  # 500 kB: more than a pipe holds, were nobody reading\n"
        "    out.write(b'x' * 99 + b'\\n')\n"
        "out.flush()\nsys.exit(3)\n",
    )
    run = launcher("--nproc", "1", "--", sys.executable, job)
    assert run.proc.wait(timeout=PATIENCE_S) == 3, run.text()[-2000:]
    out = run.output()
    assert b"[rank 0] caf\xe9 \xff in Latin-1\n" in out
    assert out.count(b"[rank 0] " + b"x" * 99 + b"\n") == 5000
    assert "rank 0 failed with exit code 3" in run.text()


GRANDPARENT = """import subprocess, sys, time
subprocess.Popen(["sleep", "600"])  # a grandchild of the launcher, in the rank's group
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGKILL, -9), (signal.SIGHUP, 129), (signal.SIGTERM, 143)]
)
def test_the_group_dies_with_the_launcher(tmp_path, launcher, sig, code):
    run = launcher("--nproc", "2", "--", sys.executable, script(tmp_path, "job.py", GRANDPARENT))
    run.wait_for(lambda: run.text().count("ready") == 2, PATIENCE_S, "2 ready lines")
    run.wait_for(lambda: len(run.below()) >= 4, PATIENCE_S, "2 ranks and 2 grandchildren")
    pids = run.below()
    run.proc.send_signal(sig)
    assert run.proc.wait(timeout=PATIENCE_S) == code, run.text()
    assert gone_within(pids, PATIENCE_S), [pid for pid in pids if alive(pid)]


BLOCKED_IN_A_COLLECTIVE = """import os, pathlib, sys, time
import jaxdist
info = jaxdist.initialize()
jaxdist.barrier("both come")  # compiles the barrier's program, on both ranks
if info.process_index == 0:
    pathlib.Path(sys.argv[1], "pid").write_text(str(os.getpid()))
    jaxdist.barrier("rank 1 never comes")  # compiled already: waits in XLA, not in Python
time.sleep(600)
"""


def main_thread_sleeps(pid: int) -> bool:
    """The process's main thread is asleep in the kernel (state S of /proc/PID/task/PID)."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    return stat.rsplit(") ", 1)[1].startswith("S")


def test_sigterm_ends_a_rank_blocked_in_a_collective(tmp_path, launcher):
    job = script(tmp_path, "job.py", BLOCKED_IN_A_COLLECTIVE)
    run = launcher(
        "--nproc", "2", "--cpu-devices-per-proc", "1", "--grace", "60", "--",
        sys.executable, job, str(tmp_path),
    )  # fmt: skip
    run.wait_for((tmp_path / "pid").exists, 60, "rank 0 at its second barrier")
    rank0 = int((tmp_path / "pid").read_text())
    # Into the barrier's wait: the main thread asleep at 5 polls in a row, 0.1 s apart (the
    # program is compiled, so between the pid file and the wait there is no work to do).
    states = []

    def waiting() -> bool:
        states.append(main_thread_sleeps(rank0))
        return len(states) >= 5 and all(states[-5:])

    run.wait_for(waiting, PATIENCE_S, "rank 0's main thread asleep in the barrier")
    pids = run.below()
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGTERM)
    assert run.proc.wait(timeout=PATIENCE_S) == 143, run.text()[-3000:]
    assert "rank 0 failed with exit code 143: it was ended by SIGTERM" in run.text()
    assert gone_within(pids, PATIENCE_S)


TRAIN = ["-m", "jaxdist.train", "--steps", "100000", "--log-every", "1"]
TRAIN += ["--global-batch-size", "32", "--hidden", "32", "--heartbeat-timeout", "60"]


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_training_ends_the_group_at_once(tmp_path, launcher, victim):
    metrics = tmp_path / "run" / "metrics.jsonl"
    run = launcher(
        "--nproc", "2", "--cpu-devices-per-proc", "2", "--grace", "60", "--",
        sys.executable, *TRAIN, "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    logged = lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3  # noqa: E731
    run.wait_for(logged, 120, "3 logged steps")
    ranks = run.ranks()
    assert sorted(ranks) == [0, 1], ranks
    pids = run.below()
    os.kill(ranks[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    assert run.proc.wait(timeout=PATIENCE_S) == 137, run.text()[-3000:]
    assert time.monotonic() - killed_at < 5, "waited out --grace"
    assert gone_within(pids, PATIENCE_S)
    assert f"rank {victim} failed with exit code 137: it was killed by SIGKILL" in run.text()


JOB = """import os, sys, time
rank, n = int(os.environ["JAXDIST_PROCESS_ID"]), int(os.environ["JAXDIST_NUM_PROCESSES"])
after, gap, code = PLAN[rank]
here = sys.argv[1]
with open(f"{here}/rank{rank}.pid.tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(f"{here}/rank{rank}.pid.tmp", f"{here}/rank{rank}.pid")


def wait_for(condition, what):
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:  # exit 1 saying so, never carry on as if it came
            sys.exit(f"rank {rank}: no {what} within 60 s")
        time.sleep(0.005)


def reaped(other):  # the launcher has waited for it: os.kill(pid, 0) works on a zombie
    try:
        os.kill(int(open(f"{here}/rank{other}.pid").read()), 0)
    except ProcessLookupError:
        return True
    return False


wait_for(lambda: all(os.path.exists(f"{here}/rank{r}.pid") for r in range(n)), "pid files")
if after is not None:
    wait_for(lambda: reaped(after), f"end of rank {after}")
time.sleep(gap)
print(SAY.format(rank=rank), flush=True)
sys.exit(code)
"""


def exits_at(tmp_path: Path, plan: dict[int, tuple[int | None, float, int]], say: str = ""):
    """A job in which rank r exits with code c once every rank has started and, with
    ``after`` a rank, once the launcher has reaped that rank's process, ``gap`` s later:
    plan[r] = (after, gap, c). Exits are ordered by these events, not by wall-clock
    delays, which a loaded 2-core machine stretched (both ranks then exited at once)."""
    path = script(tmp_path, "job.py", f"PLAN = {plan!r}\nSAY = {say!r}\n" + JOB)
    return [path, str(tmp_path)]


@pytest.mark.parametrize("gap", [1.0, 0.05])
def test_the_first_rank_to_fail_is_named(tmp_path, launcher, gap):
    """Rank 1 fails first; rank 0 fails ``gap`` s after the launcher has seen it (polling
    every 0.1 s, as the launcher did, sees both at once when the gap is small, and named
    the lower rank)."""
    job = exits_at(tmp_path, {1: (None, 0.0, 4), 0: (1, gap, 3)})
    run = launcher("--nproc", "2", "--", sys.executable, *job)
    assert run.proc.wait(timeout=60) == 4, run.text()
    assert "[launch] rank 1 failed with exit code 4" in run.text()
    assert "rank 0 failed" not in run.text()


def test_a_preempted_rank_lets_the_others_stop_by_themselves(tmp_path, launcher):
    job = exits_at(tmp_path, {1: (None, 0.0, 75), 0: (1, 1.0, 75)}, say="rank {rank} stopping")
    run = launcher("--nproc", "2", "--grace", "10", "--", sys.executable, *job)
    assert run.proc.wait(timeout=60) == 75, run.text()
    text = run.text()
    assert "[launch] rank 1 stopped for preemption (exit 75)" in text
    assert "[rank 0] rank 0 stopping" in text  # not ended by the launcher
    assert "failed" not in text


class NeverReaped:
    """A process as ``subprocess.Popen`` shows one that exited but cannot end: ``wait``
    never returns it (the real one is reaped by the test afterwards)."""

    def __init__(self, pid: int):
        self.pid = pid

    def wait(self, timeout=None):
        time.sleep(timeout)
        raise subprocess.TimeoutExpired("never reaped", timeout)


def test_an_exited_process_that_cannot_end_counts_as_exited_with_its_code(monkeypatch):
    """``exits.wait``: a zombie that stays one (as a process whose threads sleep in a
    frozen file system's writes stays) is taken as exited after ``STUCK_S``, with the
    code its exit left in /proc (77; -9 for a SIGKILL)."""
    import jaxdist.launch.exits as exits

    monkeypatch.setattr(exits, "STUCK_S", 0.3)
    for script, expected in (("os._exit(77)", 77), ("os.kill(os.getpid(), 9)", -9)):
        proc = subprocess.Popen([sys.executable, "-c", f"import os; {script}"])
        while failures.process_state(proc.pid) != "Z":
            time.sleep(0.01)
        assert exits.wait(NeverReaped(proc.pid), poll_s=0.05) == (expected, True)
        assert proc.wait() == expected  # the real exit code, as waitpid reports it
