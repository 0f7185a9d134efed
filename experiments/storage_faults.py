"""The run directory's faults, for ``experiments/faults.py --part storage``: what a file
system and its users do to a run, each on a real run of ``python -m jaxdist.train`` (the
default MLP, 1 process; the launcher case: 2 ranks of ``python -m jaxdist.launch``).

Cases:     disk full while checkpointing (a 900 KB tmpfs as the run directory); two runs
           on one run directory; the data file changed between attempts (same shape, other
           contents); the file system stalled mid-run (an ext4 image frozen by
           ``fsfreeze``); SIGTERM to the launcher while its ranks train.
Hardware:  any Linux machine, as root (it mounts a tmpfs and a loop device).
Columns:   detected: jaxdist said so by itself; seconds: from the fault (the save that
           failed, the second start, the resume's start, the freeze, the signal) to the
           line; exit code; the line; lost: what the fault cost (steps trained again after
           the resume, or none).
Expected:  74 with the checkpoint named and the newest one intact; 2 at once naming the
           holder; 2 naming the file and both fingerprints; a hang (77) naming the save and
           its path within --slow-phase-timeout; 75 from the launcher, every rank saved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist.checkpoint.run_directory import checkpoint_steps

TRAIN = ["--steps", "40", "--checkpoint-every", "5", "--keep", "10", "--log-every", "5"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
ENV.pop("JAX_NUM_CPU_DEVICES", None)


@dataclass
class Row:
    fault: str
    detected: bool
    seconds: float | None
    code: int | None
    line: str
    lost: str


class Watched:
    """A command whose output lines are read as they come, each with its time."""

    def __init__(self, args: list[str], cwd: Path, module: str = "jaxdist.train", env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=ENV if env is None else env,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def first(self, text: str, timeout: float = 120) -> tuple[float, str] | None:
        until = time.time() + timeout
        while time.time() < until:
            found = next(((t, x) for t, x in self.lines if text in x), None)
            if found or (self.proc.poll() is not None and not self._reader.is_alive()):
                return found
            time.sleep(0.05)
        return None

    def wait(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(5)
        return code


def _sh(*cmd: str) -> int:
    return subprocess.run(cmd, capture_output=True).returncode


def _error(w: Watched, marker: str = "jaxdist: error:") -> tuple[float, str]:
    return w.first(marker, timeout=5) or (time.time(), "(nothing said)")


def disk_full(work: Path) -> Row:
    fs = work / "full"
    fs.mkdir()
    assert _sh("mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(fs)) == 0
    try:
        run_dir = fs / "run"
        w = Watched([*TRAIN, "--run-dir", str(run_dir)], work)
        code = w.wait()
        at, line = _error(w)
        newest = max(checkpoint_steps(run_dir), default=0)
        newest_at = (run_dir / "checkpoints" / str(newest)).stat().st_mtime if newest else at
        _sh("mount", "-o", "remount,size=50m", str(fs))
        again = Watched([*TRAIN, "--run-dir", str(run_dir)], work)
        resumed = again.wait() == 0 and again.first(f"checkpoint of step {newest}", 1)
        lost = f"none: resumed from step {newest} once space was freed" if resumed else "?"
        return Row("disk full while checkpointing", code == 74, at - newest_at, code, line, lost)
    finally:
        _sh("umount", "-l", str(fs))


def two_runs(work: Path) -> Row:
    run_dir = work / "shared"
    args = ["--steps", "100000", "--checkpoint-every", "50", "--run-dir", str(run_dir)]
    first = Watched(args, work)
    first.first("step 10/", 120)
    started = time.time()
    second = Watched(args, work)
    code = second.wait()
    at, line = _error(second)
    first.proc.send_signal(signal.SIGTERM)  # it ran on beside the refused one: stop it
    first_code = first.wait()
    steps = [int(x.split('"step": ')[1].split(",")[0]) for x in _metrics(run_dir)]
    ok = first_code == 75 and steps == sorted(set(steps))
    lost = "none: the first ran on, each step once" if ok else f"first exit {first_code}"
    return Row("two runs on one run directory", code == 2, at - started, code, line, lost)


def _metrics(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    return [x for x in path.read_text().splitlines() if '"loss"' in x] if path.exists() else []


def data_changed(work: Path) -> Row:
    data = work / "data.npz"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype(np.float32)
    np.savez(data, x=x, y=rng.integers(0, 4, 512))
    run_dir = work / "changed"
    args = ["--data", str(data), "--in-features", "16", "--num-classes", "4"]
    args += ["--checkpoint-every", "10", "--run-dir", str(run_dir)]
    assert Watched([*args, "--steps", "20"], work).wait() == 0
    np.savez(data, x=rng.normal(size=(512, 16)).astype(np.float32), y=rng.integers(0, 4, 512))
    started = time.time()
    w = Watched([*args, "--steps", "40"], work)
    code = w.wait()
    at, line = _error(w)
    trained = max((int(x.split('"step": ')[1].split(",")[0]) for x in _metrics(run_dir)), default=0)
    lost = "none: nothing trained on the new data" if trained == 20 else f"trained to {trained}"
    return Row("data changed between attempts", code == 2, at - started, code, line, lost)


def stalled(work: Path) -> Row:
    image, mnt = work / "fs.img", work / "mnt"
    mnt.mkdir()
    _sh("truncate", "-s", "64M", str(image))
    assert _sh("mkfs.ext4", "-q", str(image)) == 0
    assert _sh("mount", "-o", "loop", str(image), str(mnt)) == 0
    try:
        run_dir = mnt / "run"
        args = ["--steps", "100000", "--checkpoint-every", "20", "--log-every", "10"]
        w = Watched([*args, "--run-dir", str(run_dir), "--slow-phase-timeout", "6"], work)
        until = time.time() + 120
        while not checkpoint_steps(run_dir) and time.time() < until:
            time.sleep(0.2)
        assert _sh("fsfreeze", "-f", str(mnt)) == 0
        frozen_at = time.time()
        said = w.first("jaxdist: error: hang:", 60)
        _sh("fsfreeze", "-u", str(mnt))
        code = w.wait()
        at, line = said or (time.time(), "(nothing said)")
        lost = "steps since the newest checkpoint (a restart redoes them)"
        return Row(
            "file system stalled (fsfreeze)", said is not None, at - frozen_at, code, line, lost
        )
    finally:
        _sh("fsfreeze", "-u", str(mnt))
        _sh("umount", "-l", str(mnt))


def launcher_sigterm(work: Path) -> Row:
    run_dir = work / "launched"
    args = ["--nproc", "2", "--cpu-devices-per-proc", "1", "--", sys.executable, "-m"]
    args += ["jaxdist.train", "--steps", "100000", "--checkpoint-every", "1000"]
    args += ["--run-dir", str(run_dir)]
    w = Watched(args, work, module="jaxdist.launch")
    w.first("step 10/", 180)
    sent = time.time()
    with contextlib.suppress(ProcessLookupError):
        os.kill(w.proc.pid, signal.SIGTERM)
    code = w.wait(180)
    at, line = w.lines[-1] if w.lines else (time.time(), "")
    saved = checkpoint_steps(run_dir)
    lost = f"none: checkpoint of step {saved[0]} saved" if saved else "no checkpoint"
    return Row("SIGTERM to the launcher", code == 75, at - sent, code, line, lost)


CASES = {
    "disk full": disk_full,
    "two runs": two_runs,
    "data changed": data_changed,
    "stalled mount": stalled,
    "launcher SIGTERM": launcher_sigterm,
}


def table(rows: list[Row], work: Path) -> str:
    out = ["| fault | detected | seconds | exit code | what it said | lost |", "|---" * 6 + "|"]
    for r in rows:
        seconds = "-" if r.seconds is None else f"{r.seconds:.1f}"
        line = r.line.replace(str(work), "WORK").replace("|", "/")[:260]
        for name in (os.uname().nodename,):
            line = line.replace(name, "HOST")
        out.append(
            f"| {r.fault} | {'yes' if r.detected else 'no'} | {seconds} | {r.code} | {line} "
            f"| {r.lost} |"
        )
    return "\n".join(out)
