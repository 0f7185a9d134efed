"""``jaxdist.spawn``: PyTorch's ``mp.spawn`` for jaxdist. Every call passes ``timeout=`` and
every test checks that no process it started is left running."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import spawn_targets

import jaxdist
from group_helpers import PATIENCE_S
from helpers import alive
from jaxdist.launch import group

STEPS, LR = 5, 0.1


def test_a_spawned_custom_loop_trains_as_one_process_of_8_devices():
    results = jaxdist.spawn(
        spawn_targets.train, args=(STEPS, LR), nprocs=2, cpu_devices_per_proc=4, timeout=180
    )
    assert [index for index, _ in results] == [0, 1]  # rank order
    _, one_process = spawn_targets.train(0, STEPS, LR)  # here: 1 process x 8 devices
    plain = spawn_targets.plain_sgd(STEPS, LR)  # 1 device, plain optax
    untrained = spawn_targets.plain_sgd(0, LR)
    names = ["hidden/bias", "hidden/kernel", "out/bias", "out/kernel"]
    assert sorted(one_process) == sorted(plain) == names
    for name in plain:
        assert not np.allclose(plain[name], untrained[name])  # the steps moved every leaf
        np.testing.assert_allclose(one_process[name], plain[name], rtol=1e-5, atol=1e-6)
        for _, params in results:
            np.testing.assert_allclose(params[name], one_process[name], rtol=1e-5, atol=1e-7)


def pids_in(pid_dir: Path) -> list[int]:
    return [int(path.read_text()) for path in pid_dir.iterdir()]


def test_a_rank_that_raises_is_named_and_nothing_is_left(tmp_path):
    start = time.monotonic()
    with pytest.raises(jaxdist.SpawnError) as caught:
        jaxdist.spawn(
            spawn_targets.fail_on,
            args=(1, str(tmp_path)),
            nprocs=2,
            cpu_devices_per_proc=1,
            timeout=60,
        )
    assert time.monotonic() - start < 30
    error = caught.value
    assert (error.rank, error.exit_code) == (1, 1)
    assert "spawn_targets.fail_on: rank 1 failed with exit code 1\n" in str(error)
    assert "ValueError: rank 1 gives up" in error.traceback
    assert error.traceback.rstrip() in str(error)
    pids = pids_in(tmp_path)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


def test_a_timeout_ends_every_process(tmp_path):
    start = time.monotonic()
    with pytest.raises(jaxdist.SpawnError, match="wait_for_ever: not finished after 8s"):
        jaxdist.spawn(spawn_targets.wait_for_ever, args=(str(tmp_path),), nprocs=2, timeout=8)
    assert time.monotonic() - start < 20
    pids = pids_in(tmp_path)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


def test_a_function_a_fresh_interpreter_cannot_import_is_refused(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(group, "run", started)

    def closure(rank):
        return rank

    cases = [
        (lambda rank: rank, "a lambda has no name to import it by"),
        (closure, "it is defined inside a function (a closure)"),
        (functools.partial(spawn_targets.train, steps=1), "it has no module-level name"),
    ]
    for fn, why in cases:
        with pytest.raises(ValueError, match="jaxdist.spawn cannot run") as caught:
            jaxdist.spawn(fn, nprocs=2)
        assert why in str(caught.value)
        assert "define it with def at the top level of a .py file" in str(caught.value)
    with pytest.raises(ValueError, match="nprocs must be >= 1"):
        jaxdist.spawn(spawn_targets.train, nprocs=0)


def test_a_function_of_an_interactive_session_is_refused():
    code = "import jaxdist\ndef f(rank):\n    return rank\njaxdist.spawn(f, nprocs=2)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert (
        "ValueError: jaxdist.spawn cannot run __main__.f: it is defined in __main__ of an "
        "interactive session" in proc.stderr
    ), proc.stderr


CALLER = """import os, pathlib, sys, time
import jaxdist
from jaxdist.launch import group

def wait(rank, pid_dir):  # in a script's __main__: each process loads the file again
    pathlib.Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    try:
        jaxdist.spawn(wait, args=(sys.argv[1],), nprocs=2, cpu_devices_per_proc=1)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGKILL, -9)])
def test_ctrl_c_or_death_of_the_caller_ends_every_process(tmp_path, sig, code):
    script, pid_dir = tmp_path / "caller.py", tmp_path / "pids"
    script.write_text(CALLER)
    pid_dir.mkdir()
    caller = subprocess.Popen(
        [sys.executable, str(script), str(pid_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(pid_dir.iterdir())) < 2 and time.monotonic() < deadline:
            assert caller.poll() is None, caller.stdout.read()
            time.sleep(0.1)
        pids = pids_in(pid_dir)
        assert len(pids) == 2
        caller.send_signal(sig)
        out = caller.communicate(timeout=PATIENCE_S)[0]
        assert caller.returncode == code, out
        assert sig != signal.SIGINT or "interrupted" in out
        deadline = time.monotonic() + PATIENCE_S
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids)
    finally:
        caller.kill()
        caller.wait(timeout=10)
        for pid in pids_in(pid_dir):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
