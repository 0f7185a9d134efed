"""SIGTERM and SIGUSR1 to the launcher (Kubernetes, scancel, SLURM's --signal=USR1): every
rank is asked to save and stop, and the launcher's exit code says how it went: 75 when
every rank saved (the same command resumes), a failing rank's own code, 143 only when it
had to kill (``--stop-grace`` expired, or a second SIGTERM); never a restart.

The trainer end to end for SIGTERM and SIGUSR1; the other outcomes with small scripts
whose ranks save, fail or ignore the signal as told, so that nothing depends on timing."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from group_helpers import MLP, PATIENCE_S, gone_within
from helpers import alive
from jaxdist.checkpoint.run_directory import checkpoint_steps

SAVED = "every rank saved a checkpoint and exited 75; the same command resumes"


def last_line(text: str) -> str:
    return text.rstrip("\n").rsplit("\n", 1)[-1]


def train(run_dir: Path) -> list[str]:
    """2 ranks x 1 device: 30 short steps, still running after the 5th is logged (a stop
    comes within 3 steps of the signal), yet quick to finish on resuming."""
    return [
        "--nproc", "2", "--cpu-devices-per-proc", "1", "--grace", "30", "--",
        sys.executable, "-m", "jaxdist.train", *MLP, "--steps", "30", "--log-every", "1",
        "--global-batch-size", "8", "--run-dir", str(run_dir), "--heartbeat-timeout", "30",
    ]  # fmt: skip


def logged(run_dir: Path, count: int):
    metrics = run_dir / "metrics.jsonl"
    return lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= count


def test_sigterm_to_the_launcher_saves_exits_75_and_the_same_command_resumes(tmp_path, launcher):
    sig = signal.SIGTERM  # SIGUSR1 takes the same path (the next test, with stand-in ranks)
    run_dir = tmp_path / "run"
    run = launcher(*train(run_dir))
    run.wait_for(logged(run_dir, 5), 120, "5 logged steps")
    pids = run.below()
    run.proc.send_signal(sig)
    assert run.proc.wait(timeout=60) == 75, run.text()[-3000:]
    text = run.text()
    assert last_line(text) == f"[launch] stopped by {sig.name}: {SAVED}", text[-3000:]
    stops = re.findall(
        rf"stopped after step (\d+) on {sig.name} to process \d; checkpoint saved", text
    )
    assert len(stops) == 2 and stops[0] == stops[1], text[-3000:]  # both ranks, one step
    saved = int(stops[0])
    assert checkpoint_steps(run_dir)[0] == saved < 30
    assert gone_within(pids, PATIENCE_S)
    (tmp_path / "launch.log").rename(tmp_path / "stopped.log")
    again = launcher(*train(run_dir))
    assert again.proc.wait(timeout=120) == 0, again.text()[-3000:]
    assert f"resumed from the checkpoint of step {saved}" in again.text()


# Each rank does as PLAN says on SIGTERM or SIGUSR1: exit with a code, or ignore it.
JOB = """import os, pathlib, signal, sys, time
rank = int(os.environ["JAXDIST_PROCESS_ID"])
plan = PLAN[rank]


def stop(signum, frame):
    print(f"got {signal.Signals(signum).name}", flush=True)
    if plan != "ignore":
        sys.exit(plan)


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGUSR1, stop)
pathlib.Path(sys.argv[1], f"ready{rank}").write_text("")
while True:
    time.sleep(0.05)
"""


def job(tmp_path: Path, plan: dict[int, int | str]) -> list[str]:
    path = tmp_path / "job.py"
    path.write_text(f"PLAN = {plan!r}\n" + JOB)
    return [sys.executable, str(path), str(tmp_path)]


def started(run, tmp_path: Path, nproc: int = 2) -> set[int]:
    run.wait_for(
        lambda: len(list(tmp_path.glob("ready*"))) == nproc, PATIENCE_S, "every rank ready"
    )
    return run.below()


def test_sigusr1_to_the_launcher_is_forwarded_once_and_75_from_every_rank_is_75(tmp_path, launcher):
    run = launcher("--nproc", "2", "--grace", "1", "--", *job(tmp_path, {0: 75, 1: 75}))
    pids = started(run, tmp_path)
    run.proc.send_signal(signal.SIGUSR1)
    assert run.proc.wait(timeout=PATIENCE_S) == 75, run.text()
    assert run.text().count("got SIGUSR1") == 2, run.text()
    assert last_line(run.text()) == f"[launch] stopped by SIGUSR1: {SAVED}", run.text()
    assert gone_within(pids, PATIENCE_S), [pid for pid in pids if alive(pid)]


def test_a_rank_that_does_not_stop_within_the_stop_grace_is_killed_exit_143(tmp_path, launcher):
    run = launcher(
        "--nproc", "2", "--stop-grace", "1", "--grace", "1", "--",
        *job(tmp_path, {0: 75, 1: "ignore"}),
    )  # fmt: skip
    pids = started(run, tmp_path)
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=PATIENCE_S) == 143, run.text()
    assert last_line(run.text()) == (
        "[launch] stopped by SIGTERM: killed rank 1: not stopped within 1s (--stop-grace); "
        "rank 0 saved a checkpoint and exited 75; exit 143"
    ), run.text()
    assert gone_within(pids, PATIENCE_S), [pid for pid in pids if alive(pid)]


def test_a_second_sigterm_kills_at_once(tmp_path, launcher):
    run = launcher(
        "--nproc", "2", "--stop-grace", "600", "--grace", "1", "--",
        *job(tmp_path, {0: "ignore", 1: "ignore"}),
    )  # fmt: skip
    pids = started(run, tmp_path)
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for(lambda: run.text().count("got SIGTERM") == 2, PATIENCE_S, "SIGTERM forwarded")
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=PATIENCE_S) == 143, run.text()
    assert last_line(run.text()) == (
        "[launch] stopped by SIGTERM: killed ranks 0, 1: a second SIGTERM; exit 143"
    ), run.text()
    assert gone_within(pids, PATIENCE_S), [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize(
    ("plan", "code", "last"),
    [
        ({0: 75, 1: 75}, 75, f"[launch] stopped by SIGUSR1: {SAVED}"),
        (
            {0: 75, 1: 3},
            3,
            "[launch] stopped by SIGUSR1: not every rank saved a checkpoint: "
            "rank 1 failed with exit code 3; exit 3",
        ),
    ],
    ids=["saved", "failed"],
)
def test_a_stopped_group_is_never_restarted(tmp_path, launcher, plan, code, last):
    run = launcher("--nproc", "2", "--max-restarts", "2", "--", *job(tmp_path, plan))
    started(run, tmp_path)
    run.proc.send_signal(signal.SIGUSR1)
    assert run.proc.wait(timeout=PATIENCE_S) == code, run.text()
    text = run.text()
    assert last_line(text) == last, text
    assert "restart" not in text
