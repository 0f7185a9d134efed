"""The run directory's file system failing under a run: full (a small tmpfs), full only for
the checkpoints (``--checkpoint-failures continue``), and stalled (an ext4 image frozen
with ``fsfreeze``: every write blocks until it is thawed, as on a hung mount). Each ends,
or goes on, as docs/checkpoints.md says, with one jaxdist line and no thread tracebacks.

They mount file systems: root is needed (CI runs as root); elsewhere they are skipped
with the reason."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import failures_of, metrics_of, run_module
from jaxdist.checkpoint.run_directory import checkpoint_steps

TESTS = Path(__file__).resolve().parent
ARGS = ["--steps", "40", "--checkpoint-every", "5", "--keep", "10", "--log-every", "5"]
ARGS += ["--init-timeout", "60"]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    where.mkdir(parents=True, exist_ok=True)
    mounted = _run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)])
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        _run(["umount", "-l", str(where)])


def train(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """``python -m jaxdist.train args`` on the CPU, its output (both streams) read as it
    comes."""
    return subprocess.Popen(
        [sys.executable, "-m", "jaxdist.train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )


def resize(where: Path, size: str) -> None:
    """More space, as a user freeing the disk would give."""
    assert _run(["mount", "-o", f"remount,size={size}", str(where)]).returncode == 0


def test_disk_full_while_checkpointing_ends_74_with_one_line_and_resumes(tmp_path):
    """A full disk: exit 74 and one line naming the checkpoint, the path and the numbers;
    the newest complete checkpoint untouched (no partial one left); the same command
    resumes from it once there is space."""
    with tmpfs(tmp_path / "fs", "900k") as fs:
        run_dir = fs / "run"
        cmd = [*ARGS, "--run-dir", str(run_dir)]
        full = run_module("jaxdist.train", *cmd, cwd=tmp_path)
        text = full.stdout + full.stderr
        assert full.returncode == 74, text[-3000:]
        errors = [line for line in text.splitlines() if "jaxdist: error:" in line]
        assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
        amount = r"[\d.]+ (?:[KMGT]i)?B"  # jaxdist.units.size
        assert re.search(rf"no space left on device: {amount} of {amount} used", errors[0])
        assert f"cannot write {run_dir}/" in errors[0] or (
            re.search(rf"cannot write checkpoint \d+ to {run_dir}/checkpoints/\d+:", errors[0])
        ), errors[0]
        newest = checkpoint_steps(run_dir)[0]
        assert f"the newest complete checkpoint: step {newest}" in errors[0], errors[0]
        leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]
        assert leftovers == [], leftovers  # the failed save's partial files are gone
        records = [r for r in failures_of(run_dir) if r["cause"] == "storage"]
        in_stderr = '"cause": "storage"' in full.stderr  # where the disk took no record
        assert (records and records[-1]["exit_code"] == 74) or in_stderr, text[-2000:]
        resize(fs, "50m")
        again = run_module("jaxdist.train", *cmd, cwd=tmp_path)
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        assert f"resumed from the checkpoint of step {newest}" in again.stdout, again.stdout
        steps = [r["step"] for r in metrics_of(run_dir) if "loss" in r]
        assert steps == sorted(set(steps)) and steps[-1] == 40, steps


def test_checkpoint_failures_continue_trains_on_and_saves_later(tmp_path):
    """The checkpoints on a small file system of their own (a quota'd scratch): one
    filled by another file makes a save fail; with --checkpoint-failures continue the run
    says so, trains on, and once the space is back its later checkpoints are saved."""
    run_dir = tmp_path / "run"
    env = {"JAXDIST_RUN_ID": "continue-test"}  # the directory is this run's (a restart)
    run_dir.mkdir()
    (run_dir / "run_id").write_text("continue-test\n")
    with tmpfs(run_dir / "checkpoints", "2m") as fs:
        ballast = fs / "ballast"
        ballast.write_bytes(b"\0" * (2 * 1024 * 1024 - 64 * 1024))  # all but 64 KiB
        cmd = ["--steps", "40", "--checkpoint-every", "10", "--log-every", "10"]
        cmd += ["--loss", "slow_device:loss", "--run-dir", str(run_dir)]
        cmd += ["--checkpoint-failures", "continue"]
        proc = train(cmd, tmp_path, {"PYTHONPATH": str(TESTS), **env})
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "training goes on (--checkpoint-failures continue)" in line and ballast.exists():
                ballast.unlink()  # the space comes back
        text = "".join(lines)
        assert proc.wait(timeout=60) == 0, text[-3000:]
        warnings = [x for x in lines if "jaxdist: warning: cannot write checkpoint" in x]
        assert warnings and "no space left on device" in warnings[0], text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        saved = checkpoint_steps(run_dir)
        assert saved[0] == 40 and 10 not in saved, saved
        recorded = [r for r in failures_of(run_dir) if r["cause"] == "storage"]
        assert (recorded and recorded[0]["recovered"]) or '"cause": "storage"' in text, text


@contextlib.contextmanager
def frozen_capable_fs(where: Path, image: Path):
    """An ext4 file system in a file, loop-mounted: ``fsfreeze`` stalls its writes."""
    if shutil.which("mkfs.ext4") is None or shutil.which("fsfreeze") is None:
        pytest.skip("needs mkfs.ext4 and fsfreeze (util-linux, e2fsprogs)")
    _run(["truncate", "-s", "64M", str(image)])
    assert _run(["mkfs.ext4", "-q", str(image)]).returncode == 0
    where.mkdir(parents=True, exist_ok=True)
    mounted = _run(["mount", "-o", "loop", str(image), str(where)])
    if mounted.returncode:
        pytest.skip(f"cannot loop-mount here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        _run(["fsfreeze", "-u", str(where)])  # a frozen mount cannot be unmounted
        _run(["umount", "-l", str(where)])


def test_a_stalled_file_system_is_reported_as_a_hang_naming_the_save(tmp_path):
    """Writes that never return (the mount frozen mid-run): the hang machinery reports it
    within the checkpoint deadline (--slow-phase-timeout), naming the save and its path,
    and exits 77 once the process can end (after the thaw)."""
    deadline_s = 4
    with frozen_capable_fs(tmp_path / "mnt", tmp_path / "fs.img") as mnt:
        run_dir = mnt / "run"
        cmd = ["--steps", "100000", "--checkpoint-every", "10", "--log-every", "10"]
        cmd += ["--run-dir", str(run_dir), "--slow-phase-timeout", str(deadline_s)]
        proc = train(cmd, tmp_path)
        lines, frozen_at, said_at = [], [], []

        def read() -> None:
            for line in proc.stdout:
                lines.append(line)
                if "jaxdist: error: hang:" in line:
                    said_at.append(time.monotonic())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            until = time.monotonic() + 60
            while not checkpoint_steps(run_dir) and time.monotonic() < until:
                time.sleep(0.2)
            assert checkpoint_steps(run_dir), "".join(lines)[-3000:]
            assert _run(["fsfreeze", "-f", str(mnt)]).returncode == 0
            frozen_at.append(time.monotonic())
            until = time.monotonic() + deadline_s + 30
            while not said_at and time.monotonic() < until:
                time.sleep(0.2)
        finally:
            _run(["fsfreeze", "-u", str(mnt)])
        code = proc.wait(timeout=60)
        reader.join(10)
        text = "".join(lines)
        assert said_at, text[-3000:]
        # from the freeze: the next save starts within 10 steps, then its deadline
        assert said_at[0] - frozen_at[0] < deadline_s + 20, said_at[0] - frozen_at[0]
        error = next(x for x in lines if "jaxdist: error: hang:" in x)
        assert " save of step " in error or " log of step " in error, error
        assert str(run_dir) in error and "the file system does not answer" in error, error
        assert code == 77, text[-3000:]
        assert json.loads((run_dir / "failures.jsonl").read_text().splitlines()[-1])["cause"] in (
            "hang",
        )


def test_a_disk_too_full_for_the_lock_ends_74_not_as_bad_input(tmp_path):
    """A restart onto the disk that filled up (a launcher's --max-restarts, a requeue):
    the run directory's lock cannot be written. A failed write, exit 74 with its line,
    like every other; not exit 2, which says the command itself is wrong."""
    with tmpfs(tmp_path / "fs", "1m") as fs:
        (fs / "run").mkdir()
        ballast = fs / "ballast"
        with contextlib.suppress(OSError), open(ballast, "wb") as out:
            while True:
                out.write(b"\0" * 4096)
                out.flush()
        proc = train(["--steps", "2", "--run-dir", str(fs / "run")], tmp_path)
        text = proc.communicate(timeout=120)[0]
        assert proc.returncode == 74, text
        errors = [x for x in text.splitlines() if "jaxdist: error:" in x]
        assert (
            len(errors) == 1
            and f"cannot write jaxdist.lock in {fs / 'run'}: no space" in (errors[0])
        ), text
