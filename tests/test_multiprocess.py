"""Real processes joined by jax.distributed (gloo), started by ``jaxdist.launch``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import alive, launch, run_cli
from jaxdist.launch.launcher import free_port

TRAIN = [
    sys.executable,
    "-m",
    "jaxdist.train",
    "--steps",
    "4",
    "--log-every",
    "1",
    "--global-batch-size",
    "32",
    "--hidden",
    "32",
    "--seed",
    "2",
    # SGD without clipping: a gradient N times too large (or too small) moves the params N
    # times as far; AdamW normalises the scale away and clipping cuts it off
    "--optimizer",
    "sgd",
    "--lr",
    "0.3",
    "--warmup-steps",
    "0",
    "--clip-norm",
    "0",
]


def losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: one process with 8 devices."""
    out = tmp_path_factory.mktemp("single")
    proc = run_cli(
        *TRAIN[3:],
        "--cpu-devices",
        "8",
        "--run-dir",
        str(out / "run"),
        "--save-params",
        str(out / "params.npz"),
    )
    assert proc.returncode == 0, proc.stderr
    return losses(out / "run"), np.load(out / "params.npz")


@pytest.mark.parametrize("strategy", ["gspmd", "shard_map", "pmap"])
def test_two_processes_match_one_process(tmp_path, single_process, strategy):
    proc, _ = launch(
        "--nproc",
        "2",
        "--cpu-devices-per-proc",
        "4",
        "--",
        *TRAIN,
        "--strategy",
        strategy,
        "--run-dir",
        str(tmp_path / "run"),
        "--save-params",
        str(tmp_path / "params.npz"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in (0, 1):  # one start line per process, with its rank
        assert f"[rank {rank}] process {rank}/2: 4 local of 8 cpu devices" in proc.stdout
    want_losses, want_params = single_process
    np.testing.assert_allclose(losses(tmp_path / "run"), want_losses, rtol=1e-6)
    got = np.load(tmp_path / "params.npz")
    assert sorted(got.files) == sorted(want_params.files)
    for name in want_params.files:
        np.testing.assert_allclose(got[name], want_params[name], rtol=1e-5, atol=1e-7)
    assert "[rank 1] step" not in proc.stdout  # only process 0 reports progress


RECORD_PID = (
    "import os, pathlib, sys\npathlib.Path(sys.argv[1], os.environ['JAXDIST_PROCESS_ID'])"
    ".write_text(str(os.getpid()))\n"
)


def test_launcher_fails_fast_with_the_failed_code(tmp_path):
    script = tmp_path / "job.py"  # rank 1 fails after a second; rank 0 would run for ever
    script.write_text(
        RECORD_PID + "import time\nrank = int(os.environ['JAXDIST_PROCESS_ID'])\n"
        "time.sleep(1 if rank else 600)\nsys.exit(3)\n"
    )
    proc, seconds = launch("--nproc", "2", "--", sys.executable, str(script), str(tmp_path))
    assert proc.returncode == 3, proc.stdout[-2000:]
    assert seconds < 30
    assert "rank 1 failed with exit code 3" in proc.stdout
    pids = [int((tmp_path / str(rank)).read_text()) for rank in (0, 1)]
    assert not any(alive(pid) for pid in pids)  # no process left behind


TRAIN_AND_RECORD_PID = (
    RECORD_PID
    + """
from jaxdist.train.trainer import main
from jaxdist.cluster.shutdown import exit_now
exit_now(main(sys.argv[2:]))
"""
)


def start_long_training(tmp_path):
    """2 processes x 2 devices training for ever; returns (launcher, pids, run_dir) once
    3 steps are logged."""
    script = tmp_path / "job.py"
    script.write_text(TRAIN_AND_RECORD_PID)
    run_dir = tmp_path / "run"
    long_run = ["--steps", "100000", "--log-every", "1", "--run-dir", str(run_dir)]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--nproc", "2", "--cpu-devices-per-proc", "2"]
        + ["--", sys.executable, str(script), str(tmp_path), *long_run]
        + ["--heartbeat-timeout", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120

    def trained() -> bool:
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 3

    while time.monotonic() < deadline and not trained() and launcher.poll() is None:
        time.sleep(0.2)
    if not trained():  # say why rather than go on to kill processes that never trained
        launcher.kill()
        raise AssertionError(f"no 3 steps logged: {launcher.communicate()[0][-3000:]}")
    pids = [int((tmp_path / str(rank)).read_text()) for rank in (0, 1)]
    return launcher, pids, run_dir


def test_a_rank_killed_mid_training_ends_the_group(tmp_path):
    launcher, pids, _ = start_long_training(tmp_path)
    killed_at = time.monotonic()
    subprocess.run(["kill", "-9", str(pids[1])], check=True)
    code = launcher.wait(timeout=60)
    out = launcher.stdout.read()
    assert code == 128 + 9, out[-2000:]
    assert time.monotonic() - killed_at < 30
    assert "rank 1 failed with exit code 137" in out
    assert not any(alive(pid) for pid in pids)


def test_sigusr1_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    launcher, pids, run_dir = start_long_training(tmp_path)
    os.kill(pids[1], signal.SIGUSR1)  # SLURM's --signal=USR1@120 warning, to one task only
    code = launcher.wait(timeout=60)
    out = launcher.stdout.read()
    assert code == 75, out[-2000:]
    stops = re.findall(
        r"\[rank (\d)\] jaxdist: stopped after step (\d+) on SIGUSR1 to process 1; "
        r"checkpoint saved",
        out,
    )
    assert sorted(rank for rank, _ in stops) == ["0", "1"], out[-2000:]
    assert stops[0][1] == stops[1][1]  # the same step on both
    last_logged = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last_logged["step"] == int(stops[0][1])
    assert (run_dir / "checkpoints" / stops[0][1]).is_dir()  # saved, complete
    assert not any(alive(pid) for pid in pids)


def test_launcher_ctrl_c_ends_every_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(RECORD_PID + "import time\ntime.sleep(600)\n")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxdist.launch",
            "--nproc",
            "3",
            "--",
            sys.executable,
            str(script),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("[0-9]"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=20) == 130
    pids = [int(p.read_text()) for p in tmp_path.glob("[0-9]")]
    assert len(pids) == 3 and not any(alive(pid) for pid in pids)


def test_launcher_restarts_the_group(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "marker = pathlib.Path(sys.argv[1], 'tried' + os.environ['JAXDIST_PROCESS_ID'])\n"
        "if not marker.exists():\n    marker.write_text('1')\n"
        # Both ranks fail on the first try: the launcher ends the group at the first exit.
        "    while len(list(marker.parent.glob('tried*'))) < 2:\n        time.sleep(0.01)\n"
        "    sys.exit(4)\n"
    )
    proc, _ = launch(
        "--nproc", "2", "--max-restarts", "1", "--", sys.executable, str(script), str(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout
    assert "[launch] restart 1/1" in proc.stdout
    proc, _ = launch(
        "--nproc", "1", "--max-restarts", "2", "--", sys.executable, "-c", "import sys; sys.exit(5)"
    )
    assert proc.returncode == 5
    assert proc.stdout.count("failed with exit code 5") == 3  # first try + 2 restarts


def test_coordinator_that_never_comes_is_a_clear_error(tmp_path):
    port = free_port()  # nobody listens here
    start = time.monotonic()
    proc = run_cli(
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--init-timeout",
        "3",
        "--cpu-devices",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert time.monotonic() - start < 30
    assert proc.returncode == 76  # a peer is missing (README "Exit codes")
    assert f"waited for the coordinator 127.0.0.1:{port}" in proc.stderr
    assert "--init-timeout 3s" in proc.stderr
    assert not (tmp_path / "run").exists()
