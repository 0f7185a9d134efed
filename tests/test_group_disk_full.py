"""A full disk under a group of 2 processes (``python -m jaxdist.launch``, a small tmpfs
as the run directory's file system, a ballast file sized from a measured first run):
the save that fails, on one process or on both, fails on every process, which all end
with exit 74 and the same line naming the process, the path and the cause, within the
checkpoint deadline, with the failure recorded and the lock released; the same command
resumes once space is freed. Five times in a row for each. Then the barrier itself,
between two processes: a failure published by one ends the other's wait at once.

Root is needed for the mount (CI runs as root); elsewhere these are skipped."""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from test_group_faults import logged_steps
from test_storage_faults import resize, tmpfs

from group_helpers import PATIENCE_S
from helpers import failures_of

DEADLINE_S = 60  # --slow-phase-timeout: a save's barriers give up 60 s after it
LAYOUTS = {"one": [], "both": ["--mesh", "fsdp=4"]}  # replicated: process 0 writes it all
# 1.07M parameters: a checkpoint (parameters and AdamW's moments) of about 13 MB, next to
# metrics and metadata of kilobytes: 1 MB left free fails the next checkpoint only
MLP = ["--in-features", "12", "--num-classes", "5", "--hidden", "1024", "--depth", "2"]
MIB = 2**20


def train(run_dir: Path, layout: str, cache: Path) -> list[str]:
    """The command; ``cache``: its XLA compilation cache, off the small file system (the
    measuring run compiles, the 7 runs after it load: 3 s of each one's 15 s on 2 cores)."""
    return [
        "--nproc", "2", "--cpu-devices-per-proc", "2", "--",
        sys.executable, "-m", "jaxdist.train", *MLP, *LAYOUTS[layout], "--steps", "20",
        "--log-every", "1", "--global-batch-size", "16", "--checkpoint-every", "10",
        "--run-dir", str(run_dir), "--slow-phase-timeout", str(DEADLINE_S),
        "--compile-cache", str(cache),
    ]  # fmt: skip


def first_checkpoint_bytes(tmp_path: Path, launcher, layout: str) -> int:
    """What the run directory holds at step 10 (its first checkpoint complete), measured
    on a tmpfs (whose pages the ballast must leave room for)."""
    with tmpfs(tmp_path / f"measure-{layout}", "96m") as fs:
        args = train(fs / "run", layout, tmp_path / "xla")
        args[args.index("--steps") + 1] = "10"
        run = launcher(*args)
        assert run.proc.wait(timeout=PATIENCE_S) == 0, run.text()[-3000:]
        (tmp_path / "launch.log").rename(tmp_path / f"measure-{layout}.log")
        return shutil.disk_usage(fs).used


@pytest.mark.parametrize("fails_on", ["one", "both"])
def test_a_full_disk_ends_every_process_74_with_one_line_and_the_run_resumes(
    tmp_path, launcher, fails_on
):
    used = first_checkpoint_bytes(tmp_path, launcher, fails_on)
    # Free space once checkpoint 10 is written: too little for checkpoint 20's data on
    # process 0 ("one": the replicated model's arrays are all written by process 0,
    # process 1 writes a small file) or on either ("both": each holds half of it).
    free = 1 * MIB
    for attempt in range(5):
        with tmpfs(tmp_path / f"fs{attempt}", "96m") as fs:
            total = shutil.disk_usage(fs).total
            (fs / "ballast").write_bytes(b"\0" * (total - used - free))
            run_dir = fs / "run"
            started = time.monotonic()
            run = launcher(*train(run_dir, fails_on, tmp_path / "xla"))
            code = run.proc.wait(timeout=PATIENCE_S + DEADLINE_S)
            took = time.monotonic() - started
            text = run.text()
            assert code == 74, (attempt, text[-3000:])
            assert took < DEADLINE_S + 30, (attempt, took)  # no barrier waited it out
            lines = re.findall(r"\[rank (\d)\] jaxdist: error: (.*)", text)
            assert sorted(rank for rank, _ in lines) == ["0", "1"], (attempt, text[-3000:])
            assert len({line for _, line in lines}) == 1, lines  # the same line on both
            line = lines[0][1]
            said = re.match(r"process (\d) cannot write checkpoint 20 to (\S+): no space", line)
            assert said, line
            assert fails_on == "both" or said.group(1) == "0", line
            assert said.group(2) == str(run_dir / "checkpoints" / "20"), line
            assert "the newest complete checkpoint: step 10" in line, line
            assert "Traceback" not in text and "DEADLINE_EXCEEDED" not in text, text[-3000:]
            recorded = [f for f in failures_of(run_dir) if f["cause"] == "storage"]
            assert len(recorded) == 1 and recorded[0]["process"] == int(said.group(1))
            assert not (run_dir / "jaxdist.lock").exists()  # released
            (tmp_path / "launch.log").rename(tmp_path / f"full{attempt}.log")
            if attempt in (0, 4):  # space freed: the same command resumes from step 10
                resize(fs, "192m")
                again = launcher(*train(run_dir, fails_on, tmp_path / "xla"))
                assert again.proc.wait(timeout=PATIENCE_S) == 0, again.text()[-3000:]
                assert "resumed from the checkpoint of step 10" in again.text()
                assert logged_steps(run_dir) == list(range(1, 21))
                (tmp_path / "launch.log").rename(tmp_path / f"resumed{attempt}.log")


def test_a_failure_published_by_one_process_ends_the_others_barrier_at_once(tmp_path):
    """orbax's failure mode, made on purpose: process 1's write fails and it skips the
    barrier process 0 waits at. Before: process 0 waited out orbax's 1,200 s."""
    import spawn_targets

    import jaxdist

    results = jaxdist.spawn(
        spawn_targets.save_barrier_failure, args=(str(tmp_path),), nprocs=2, timeout=120
    )
    expected = (
        f"StorageError: process 1 cannot write checkpoint 10 to {tmp_path}/10: no space "
        "left on device"
    )
    for said, waited_s in results:
        assert said.startswith(expected), results
        assert waited_s < 10, results  # not the 60 s the barrier would allow
