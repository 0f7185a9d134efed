"""One run per run directory (``jaxdist.checkpoint.lock``): a second run on a live
directory exits 2 at once naming the holder; a lock whose process is gone, or that
belongs to this same run (a requeue, a launcher restart), is taken over. The rules on
fake lock files in-process; end to end: two identical commands at once, a SIGKILLed run,
and a refusal reaching every process of a group."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import launch, metrics_of
from jaxdist.checkpoint import lock, run_directory
from jaxdist.checkpoint.run_directory import checkpoint_steps
from jaxdist.errors import ConfigError
from jaxdist.train.trainer import main

HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def no_run_id(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("JAXDIST_RUN_ID", raising=False)


def fake_lock(run_dir, *, host=HOST, pid, pid_start=None, run_id=None, age_s=180, renewed_s=12):
    """A lock as a run started ``age_s`` ago, renewed ``renewed_s`` ago, would leave."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / lock.LOCK
    started = time.time() - age_s
    path.write_text(json.dumps({
        "host": host, "pid": pid, "process_group": pid, "pid_start": pid_start,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "started_at": started, "run_id": run_id, "processes": 1,
    }))  # fmt: skip
    os.utime(path, (time.time() - renewed_s,) * 2)
    return path


def dead_pid() -> tuple[int, int]:
    """The pid and start time of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["sleep", "30"])
    start = lock._pid_start(proc.pid)
    proc.kill()
    proc.wait()
    return proc.pid, start


def lock_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "jaxdist-lock" and t.is_alive()]


def test_a_lock_says_who_holds_it_and_goes_with_the_directories_it_made(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    lock.acquire(run_dir)
    held = json.loads((run_dir / lock.LOCK).read_text())
    assert held["host"] == HOST and held["pid"] == os.getpid()
    assert held["process_group"] == os.getpgid(0) and held["processes"] == 1
    assert held["pid_start"] == lock._pid_start(os.getpid()) and held["run_id"] is None
    assert abs(held["started_at"] - time.time()) < 60 and held["started"][:2] == "20"
    assert len(lock_threads()) == 1
    # not an earlier run's file, and --overwrite's clearing keeps it
    assert run_directory.plan(run_dir, "auto", overwrite=False) == run_directory.Plan(False, False)
    run_directory.clear(run_dir)
    assert os.listdir(run_dir) == [lock.LOCK]
    lock.release(run_dir)
    assert not (tmp_path / "runs").exists()  # made only to hold the lock: gone with it
    time.sleep(0.05)
    assert not lock_threads()
    lock.release(run_dir)  # twice, or never taken: nothing to do


@pytest.mark.parametrize("where", ["this host", "another host"])
def test_a_live_holder_is_refused_with_its_numbers(tmp_path, where):
    parent = os.getppid()  # alive, with its own start time
    if where == "this host":
        path = fake_lock(tmp_path, pid=parent, pid_start=lock._pid_start(parent))
    else:  # cannot be checked from here: refused, with the lock's age
        path = fake_lock(tmp_path, host="node-b17", pid=4242)
    before = path.read_text()
    with pytest.raises(ConfigError) as err:
        lock.acquire(tmp_path)
    host, pid = (HOST, parent) if where == "this host" else ("node-b17", 4242)
    assert str(err.value) == (
        f"--run-dir {tmp_path} is in use by another run: host {host}, pid {pid} (process "
        f"group {pid}, run id none), started {json.loads(before)['started']} (3 min ago), "
        f"lock renewed 12 s ago; wait for it to end, use another --run-dir, or, if that run "
        f"is gone, delete {path}"
    )
    assert path.read_text() == before and sorted(os.listdir(tmp_path)) == [lock.LOCK]


@pytest.mark.parametrize("why", ["its pid is gone", "its pid was reused"])
def test_a_lock_whose_process_is_gone_is_taken_over_with_a_note(tmp_path, capsys, why):
    if why == "its pid is gone":
        pid, start = dead_pid()
    else:  # a live pid, started after the holder did: another process
        pid, start = os.getppid(), lock._pid_start(os.getppid()) - 1
    path = fake_lock(tmp_path, pid=pid, pid_start=start)
    started = json.loads(path.read_text())["started"]
    lock.acquire(tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert capsys.readouterr().out == (
        f"jaxdist: note: taking over the lock of an earlier run in {tmp_path} (host {HOST}, "
        f"pid {pid}, started {started}) whose process is gone\n"
    )
    lock.release(tmp_path)
    assert os.listdir(tmp_path) == []  # the directory was there before: kept


def test_the_same_run_takes_its_own_lock_over_wherever_it_was(tmp_path, monkeypatch):
    """A SLURM requeue or a launcher restart keeps the run id; its earlier attempt's lock
    (even on another host, renewed a moment ago) is not another run's."""
    monkeypatch.setenv("JAXDIST_RUN_ID", "x")
    fake_lock(tmp_path, host="node-b17", pid=4242, run_id="x", renewed_s=1)
    lock.acquire(tmp_path)
    assert json.loads((tmp_path / lock.LOCK).read_text())["run_id"] == "x"
    lock.release(tmp_path)
    monkeypatch.setenv("JAXDIST_RUN_ID", "y")  # another run id: another run
    fake_lock(tmp_path, host="node-b17", pid=4242, run_id="x")
    with pytest.raises(ConfigError, match="pid 4242 .process group 4242, run id x."):
        lock.acquire(tmp_path)


def test_a_takeover_loses_to_one_that_got_there_first(tmp_path):
    """Two starters that judged the same lock stale: the one that replaces it second
    finds another lock than the one it judged, and backs off."""
    path = fake_lock(tmp_path, pid=dead_pid()[0])
    stale = path.read_text()
    first, second = tmp_path / "t1", tmp_path / "t2"
    first.write_text("first\n")
    second.write_text("second\n")
    assert lock._take_over(path, first, stale)
    assert not lock._take_over(path, second, stale)
    assert path.read_text() == "first\n" and sorted(os.listdir(tmp_path)) == [lock.LOCK, "t2"]


RACER = """
import os, sys, time
from jaxdist.checkpoint import lock, run_directory
from jaxdist.errors import ConfigError
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.001)
for run_dir in sys.argv[2:]:
    try:
        lock.acquire(run_dir)
        print("won", flush=True)
    except ConfigError as err:
        print(err, flush=True)
time.sleep(2)  # the winners hold on while the others judge
"""


def test_of_three_starters_at_once_one_wins(tmp_path):
    """On a free directory (each creates) and on a stale lock (each takes over)."""
    free, stale = tmp_path / "free", tmp_path / "stale"
    fake_lock(stale, pid=dead_pid()[0])
    go = tmp_path / "go"
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, str(go), str(free), str(stale)],
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(3)
    ]  # fmt: skip
    for racer in racers:  # every interpreter has imported jaxdist
        assert racer.stdout.readline() == "ready\n"
    go.touch()
    said = [r.communicate(timeout=60)[0].splitlines() for r in racers]
    said = [[line for line in s if "jaxdist: note:" not in line] for s in said]
    for index, run_dir in enumerate((free, stale)):
        lines = [s[index] for s in said]
        winners = [r.pid for r, line in zip(racers, lines, strict=True) if line == "won"]
        assert len(winners) == 1, lines
        refusals = [line for line in lines if line != "won"]
        expected = f"in use by another run: host {HOST}, pid {winners[0]} "
        assert all(expected in line for line in refusals), lines
        assert sorted(os.listdir(run_dir)) == [lock.LOCK]  # no claim or temporary file left


FLAGS = ["--steps", "1000", "--log-every", "1", "--checkpoint-every", "50", "--hidden", "16"]
FLAGS += ["--global-batch-size", "16", "--compile-cache", "off", "--no-tensorboard"]


def command(run_dir) -> list[str]:
    return [sys.executable, "-m", "jaxdist.train", *FLAGS, "--run-dir", str(run_dir)]


def env() -> dict:
    drop = ("JAX_NUM_CPU_DEVICES", "SLURM_JOB_ID", "JAXDIST_RUN_ID")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"JAX_PLATFORMS": "cpu"}


def wait_until(condition, proc, timeout=120, what=""):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, f"{what} (exit {proc.poll()})"
        time.sleep(0.01)


def test_a_second_run_on_a_live_directory_exits_2_naming_the_first(tmp_path):
    """The first has a checkpoint (so the second could resume it, as a resubmitted job
    did); it is paused (SIGSTOP) while the second starts, so that on 2 shared cores it is
    surely still running, then finishes alone: each step once, in order."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen(command(run_dir), env=env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_until(lambda: checkpoint_steps(run_dir), first, what="no checkpoint")
        first.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        second = subprocess.run(command(run_dir), env=env(), capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        seconds = time.monotonic() - start
    finally:
        first.send_signal(signal.SIGCONT)
    errors = [line for line in second.stderr.splitlines() if "jaxdist: error:" in line]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    assert errors[0].startswith(
        f"jaxdist: error: --run-dir {run_dir} is in use by another run: host {HOST}, pid "
        f"{first.pid} (process group {os.getpgid(first.pid)}, run id none), started "
    ), errors[0]
    assert re.search(r"lock renewed \d+ s ago; wait for it to end", errors[0]), errors[0]
    assert "Traceback" not in second.stderr and seconds < 60
    out = first.communicate(timeout=120)[0]
    assert first.returncode == 0, out[-3000:]
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, 1001))
    assert lock.LOCK not in os.listdir(run_dir) and "failures.jsonl" not in os.listdir(run_dir)


def test_a_sigkilled_runs_lock_is_taken_over_and_the_same_run_is_not_refused(
    tmp_path, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    killed = subprocess.Popen(command(run_dir), env=env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    wait_until((run_dir / lock.LOCK).exists, killed, what="no lock")
    killed.kill()  # in set-up, before its first step
    killed.wait()
    started = json.loads((run_dir / lock.LOCK).read_text())["started"]
    args = ["--run-dir", str(run_dir), "--steps", "2", "--hidden", "16", "--no-tensorboard"]
    assert main(args) == 0, capsys.readouterr().err
    assert (
        f"jaxdist: note: taking over the lock of an earlier run in {run_dir} (host {HOST}, "
        f"pid {killed.pid}, started {started}) whose process is gone"
    ) in capsys.readouterr().out
    assert lock.LOCK not in os.listdir(run_dir)
    # A restart of a run with an id: its own lock, renewed a moment ago, is no obstacle.
    monkeypatch.setenv("JAXDIST_RUN_ID", "x")
    fake_lock(run_dir, host="node-b17", pid=4242, run_id="x", renewed_s=1)
    assert main([*args, "--steps", "4"]) == 0, capsys.readouterr().err
    assert [r["step"] for r in metrics_of(run_dir)][-1] == 4
    assert lock.LOCK not in os.listdir(run_dir)


def test_every_process_of_a_group_is_refused(tmp_path):
    """Process 0 alone reads the lock; its refusal reaches the others, and all exit 2."""
    path = fake_lock(tmp_path / "run", host="node-b17", pid=4242)
    proc, seconds = launch(
        "--nproc", "2", "--", sys.executable, "-m", "jaxdist.train", "--run-dir",
        str(tmp_path / "run"), "--steps", "2", "--cpu-devices", "1", "--overwrite",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-3000:]
    for rank in (0, 1):
        line = f"[rank {rank}] jaxdist: error: --run-dir {tmp_path / 'run'} is in use by another"
        assert line in proc.stdout + proc.stderr, proc.stdout[-3000:]
    assert sorted(os.listdir(tmp_path / "run")) == [lock.LOCK] and path.exists()
