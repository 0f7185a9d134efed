"""Faults where processes meet, each a real run of 2 processes under ``python -m
jaxdist.launch``: ``kill -9`` of process 0 (whose death takes the coordination service)
or of process 1, three times each, is named by the survivor in its jaxdist line (the
last word even if JAX's client aborts after it), recorded in ``failures.jsonl``, and the
restarted group resumes from the newest checkpoint; SIGTERM to the launcher and every
rank in one ``kill`` (a group-wide stop) saves at one step on every rank and exits 75,
and the same command resumes with no step repeated or lost; a read-only mount says so."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_storage_faults import frozen_capable_fs

from group_helpers import MLP, PATIENCE_S
from helpers import failures_of


def train(run_dir: Path, steps: int, *extra: str, cache: Path | None = None) -> list[str]:
    """The command; ``cache``: an XLA compilation cache that the test's later groups (its
    restarts, its next attempts) load the first one's programs from (3 s of a group's
    start on 2 cores), on a file system no fault touches."""
    return [
        "--nproc", "2", "--cpu-devices-per-proc", "2", *extra, "--",
        sys.executable, "-m", "jaxdist.train", *MLP, "--steps", str(steps), "--log-every", "1",
        "--global-batch-size", "16", "--checkpoint-every", "10", "--run-dir", str(run_dir),
        "--heartbeat-timeout", "30", *(["--compile-cache", str(cache)] if cache else []),
    ]  # fmt: skip


def logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip()]


def newest_checkpoint(run_dir: Path) -> int:
    return max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_process_is_named_and_recorded_every_time_and_the_group_resumes(
    tmp_path, launcher, victim
):
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        run = launcher(*train(run_dir, 60, "--max-restarts", "1", cache=tmp_path / "xla"))
        saved = run_dir / "checkpoints" / "10"  # a checkpoint to resume from, complete
        run.wait_for(lambda d=run_dir, s=saved: s.is_dir() and len(logged_steps(d)) >= 14,
                     PATIENCE_S, "step 10's checkpoint and 14 steps")  # fmt: skip
        os.kill(run.ranks()[victim], signal.SIGKILL)
        assert run.proc.wait(timeout=PATIENCE_S) == 0, run.text()[-3000:]  # restarted, done
        text = run.text()
        survivor = 1 - victim
        said = re.findall(rf"\[rank {survivor}\] jaxdist: error: process {victim} \(.*", text)
        recorded = [f for f in failures_of(run_dir) if f["cause"] == "dead_peer"]
        assert recorded and recorded[0]["process"] == victim, (attempt, recorded, text[-3000:])
        # the survivor named it, even when the launcher's SIGTERM came a moment after the
        # death; its line is its last word, whatever JAX's client printed before
        assert said, (attempt, text[-3000:])
        before = text.split("[launch] restart 1/1")[0].splitlines()
        mine = [x for x in before if x.startswith(f"[rank {survivor}] ")]
        assert mine[-1].startswith(f"[rank {survivor}] jaxdist: error: process {victim}"), mine[-5:]
        assert "[launch] restart 1/1" in text
        resumed = re.search(r"resumed from the checkpoint of step (\d+)", text)
        assert resumed and int(resumed.group(1)) >= 10, text[-3000:]
        assert logged_steps(run_dir)[-1] == 60


def test_sigterm_to_the_launcher_and_every_rank_at_once_saves_and_resumes(tmp_path, launcher):
    """systemd's KillMode=control-group: each rank gets its own SIGTERM and the launcher's
    forward of it; the two are one request."""
    run_dir = tmp_path / "run"
    run = launcher(*train(run_dir, 200, "--grace", "30", cache=tmp_path / "xla"))
    run.wait_for(lambda: len(logged_steps(run_dir)) >= 5, PATIENCE_S, "5 logged steps")
    for pid in [run.proc.pid, *run.ranks().values()]:  # one kill, the whole group
        os.kill(pid, signal.SIGTERM)
    assert run.proc.wait(timeout=PATIENCE_S) == 75, run.text()[-3000:]
    text = run.text()
    stops = re.findall(r"stopped after step (\d+) on SIGTERM to process \d; checkpoint saved", text)
    assert len(stops) == 2 and stops[0] == stops[1], text[-3000:]
    stop = int(stops[0])
    assert newest_checkpoint(run_dir) == stop and logged_steps(run_dir)[-1] == stop
    assert "the newest checkpoint: step" not in text or f"step {stop}" in text
    (tmp_path / "launch.log").rename(tmp_path / "stopped.log")
    again = launcher(*train(run_dir, stop + 6, cache=tmp_path / "xla"))
    assert again.proc.wait(timeout=PATIENCE_S) == 0, again.text()[-3000:]
    assert f"resumed from the checkpoint of step {stop}" in again.text()
    assert logged_steps(run_dir) == list(range(1, stop + 7))  # none repeated, none lost


def test_a_frozen_file_system_is_a_hang_the_launcher_does_not_wait_out(tmp_path, launcher):
    """fsfreeze of the run directory's file system mid-run: each rank declares the hang
    at the save deadline and exits 77, but threads blocked in the frozen writes keep both
    from ending (no signal ends them). The launcher counts them as exited (not waited
    for), restarts, and the group resumes once the file system is thawed; the record the
    rank could not write, the launcher writes."""
    with frozen_capable_fs(tmp_path / "mnt", tmp_path / "fs.img") as mnt:
        run_dir = mnt / "run"
        args = train(run_dir, 60, "--max-restarts", "1")
        args += ["--slow-phase-timeout", "10", "--step-timeout", "5"]
        run = launcher(*args)
        run.wait_for(lambda: len(logged_steps(run_dir)) >= 14, PATIENCE_S, "14 logged steps")
        assert subprocess.run(["fsfreeze", "-f", str(mnt)]).returncode == 0
        frozen_at = time.monotonic()
        try:
            run.wait_for(lambda: "[launch] restart 1/1" in run.text(), PATIENCE_S, "a restart")
        finally:
            subprocess.run(["fsfreeze", "-u", str(mnt)])
        took = time.monotonic() - frozen_at
        assert took < 10 + 5 + 30, took  # the deadline, the stuck-exit wait, start-up
        text = run.text()
        # the first rank to exit may have ended, or be stuck exiting (said, not waited for)
        assert re.search(r"\[launch\] rank \d failed with exit code 77", text), text[-3000:]
        assert re.search(r"\[rank \d\] jaxdist: error: hang: .*the file system does not answer",
                         text), text[-3000:]  # fmt: skip
        assert run.proc.wait(timeout=PATIENCE_S) == 0, text[-3000:]
        assert logged_steps(run_dir)[-1] == 60
        # the rank could not write its record into the frozen file system: the launcher's
        # writer did, once it answered
        hangs = [f for f in failures_of(run_dir) if f["cause"] == "hang"]
        assert len(hangs) == 1 and hangs[0]["exit_code"] == 77, failures_of(run_dir)


def test_a_read_only_mount_says_so_and_a_permission_says_the_user(tmp_path, monkeypatch):
    """The cause of an unwritable run directory: the mount (statvfs's ST_RDONLY), not the
    user; the user where the mount is writable."""
    from types import SimpleNamespace

    from jaxdist.checkpoint import run_directory
    from jaxdist.errors import ConfigError

    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # as on a read-only mount
    real = os.statvfs
    mounted = {"flag": os.ST_RDONLY}
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=mounted["flag"]))
    with pytest.raises(ConfigError, match="is on a read-only file system"):
        run_directory.check_writable(tmp_path / "run", "--run-dir", is_dir=True)
    mounted["flag"] = real(tmp_path).f_flag & ~os.ST_RDONLY
    with pytest.raises(ConfigError, match="is not writable by this user"):
        run_directory.check_writable(tmp_path / "run", "--run-dir", is_dir=True)
