"""Real processes joined by jax.distributed (gloo), started by ``jaxdist.launch``: they
match one process, and the launcher ends, restarts and reports the group as it says.

Nothing waits on a sleep: the tests and their jobs poll the condition itself (a file, a
logged step) with a deadline whose failure names what did not come."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

from group_helpers import PATIENCE_S
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


WAIT_FOR = """import time
def wait_for(condition, what, timeout=60):  # in a job: exit 1 saying so, never carry on
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"no {what} within {timeout} s")
        time.sleep(0.01)
"""


def test_launcher_fails_fast_with_the_failed_code(tmp_path):
    script = tmp_path / "job.py"  # rank 1 fails once rank 0 has started; 0 would run for ever
    script.write_text(
        RECORD_PID + WAIT_FOR + "if os.environ['JAXDIST_PROCESS_ID'] == '1':\n"
        "    wait_for(pathlib.Path(sys.argv[1], '0').exists, \"rank 0's pid\")\n"
        "    sys.exit(3)\ntime.sleep(600)\n"
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


def start_long_training(tmp_path, launcher):
    """2 processes x 2 devices training for ever, under the ``launcher`` fixture (output to
    a file, every process killed at teardown); returns (run, pids, run_dir) once 3 steps
    are logged."""
    script = tmp_path / "job.py"
    script.write_text(TRAIN_AND_RECORD_PID)
    run_dir = tmp_path / "run"
    long_run = ["--steps", "100000", "--log-every", "1", "--run-dir", str(run_dir)]
    run = launcher(
        "--nproc", "2", "--cpu-devices-per-proc", "2", "--",
        sys.executable, str(script), str(tmp_path), *long_run, "--heartbeat-timeout", "10",
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"

    def trained() -> bool:
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 3

    run.wait_for(trained, 120, "3 logged steps")  # fails at once if the launcher ends
    pids = [int((tmp_path / str(rank)).read_text()) for rank in (0, 1)]
    return run, pids, run_dir


def test_a_rank_killed_mid_training_ends_the_group(tmp_path, launcher):
    run, pids, _ = start_long_training(tmp_path, launcher)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    code = run.proc.wait(timeout=60)
    out = run.text()
    assert code == 128 + 9, out[-2000:]
    assert time.monotonic() - killed_at < 30
    assert "rank 1 failed with exit code 137" in out
    assert not any(alive(pid) for pid in pids)


def test_sigusr1_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, launcher):
    run, pids, run_dir = start_long_training(tmp_path, launcher)
    os.kill(pids[1], signal.SIGUSR1)  # SLURM's --signal=USR1@120 warning, to one task only
    code = run.proc.wait(timeout=60)
    out = run.text()
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


def test_launcher_ctrl_c_ends_every_process(tmp_path, launcher):
    script = tmp_path / "job.py"
    script.write_text(RECORD_PID + "import time\ntime.sleep(600)\n")
    run = launcher("--nproc", "3", "--", sys.executable, str(script), str(tmp_path))
    run.wait_for(lambda: len(list(tmp_path.glob("[0-9]"))) == 3, PATIENCE_S, "3 pid files")
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(timeout=PATIENCE_S) == 130, run.text()[-2000:]
    pids = [int(p.read_text()) for p in tmp_path.glob("[0-9]")]
    assert len(pids) == 3 and not any(alive(pid) for pid in pids)


def test_launcher_restarts_the_group(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, pathlib, sys\n"
        + WAIT_FOR
        + "marker = pathlib.Path(sys.argv[1], 'tried' + os.environ['JAXDIST_PROCESS_ID'])\n"
        "if not marker.exists():\n    marker.write_text('1')\n"
        # Both ranks fail on the first try: the launcher ends the group at the first exit.
        "    wait_for(lambda: len(list(marker.parent.glob('tried*'))) == 2, 'both tries')\n"
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
