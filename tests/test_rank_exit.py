"""A rank that calls ``sys.exit(N)`` after ``jaxdist.initialize()`` ends its group within
seconds, named by the launcher and by ``jaxdist.spawn``. Without jaxdist's exit path the
interpreter's exit waits in JAX's shutdown barrier until every other process has ended by
itself: here 120 s of sleep, so each test would take over two minutes."""

from __future__ import annotations

import sys
import time

import pytest
import spawn_targets

import jaxdist
from helpers import alive, launch

SCRIPT = """
import sys, time
import jaxdist

info = jaxdist.initialize()
if info.process_index == 1:
    time.sleep(1)  # rank 0 is in its sleep by then
    sys.exit({code})
time.sleep({rank0_sleep})
print("rank 0 finished")
"""


def run_script(tmp_path, code: int, rank0_sleep: int):
    script = tmp_path / "exits.py"
    script.write_text(SCRIPT.format(code=code, rank0_sleep=rank0_sleep))
    args = ("--nproc", "2", "--cpu-devices-per-proc", "1", "--", sys.executable, str(script))
    return launch(*args, timeout=200)


def test_sys_exit_3_on_one_rank_ends_the_launchers_group_at_once(tmp_path):
    proc, seconds = run_script(tmp_path, code=3, rank0_sleep=120)
    assert proc.returncode == 3, proc.stdout[-2000:]
    assert seconds < 30, seconds  # not the 120 s of rank 0's sleep
    assert "rank 1 failed with exit code 3" in proc.stdout, proc.stdout[-2000:]
    assert "rank 0 finished" not in proc.stdout


def test_sys_exit_0_on_one_rank_still_waits_for_the_group(tmp_path):
    """A rank that is done early leaves with the others: its exit waits in JAX's barrier
    (the coordination service on process 0 must outlive every client)."""
    proc, _ = run_script(tmp_path, code=0, rank0_sleep=3)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "[rank 0] rank 0 finished" in proc.stdout


def test_sys_exit_3_in_a_spawned_rank_is_named_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(jaxdist.SpawnError) as caught:
        jaxdist.spawn(
            spawn_targets.exit_on, args=(1, str(tmp_path)), nprocs=2, cpu_devices_per_proc=1,
            timeout=120,
        )  # fmt: skip
    assert time.monotonic() - start < 30
    assert (caught.value.rank, caught.value.exit_code) == (1, 3)
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)
