"""Stop signals and kills, for real: SIGUSR1 and SIGTERM -> every process stops after
the same step, saves, exits 75, and the same command resumes; a kill -9 during an
asynchronous save leaves the previous checkpoint usable. The references are
uninterrupted runs of the same command, compared through their ``--save-params`` files."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from helpers import relative_error, run_cli, saved_params
from jaxdist.checkpoint.run_directory import checkpoint_steps

# Many short steps: a signal sent after 20 logged steps lands mid-run (the stop comes
# within 2 steps of it; a step here takes milliseconds, the poll for 20 steps 50 ms).
STEPS = 200
FLAGS = ["--steps", str(STEPS), "--log-every", "1", "--global-batch-size", "16", "--hidden", "16"]
FLAGS += ["--compile-cache", "off"]


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "jaxdist.train", *args]


def start(args: list[str], **kw) -> subprocess.Popen:
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"} | kw.pop("env", {})
    import os

    env = {**os.environ, **env}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kw
    )


def wait_for_steps(run_dir: Path, count: int, proc: subprocess.Popen, timeout=120) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} steps not logged within {timeout}s (exit {proc.poll()})")


def reference(tmp_path: Path, *extra) -> dict[str, np.ndarray]:
    out = tmp_path / "reference.npz"
    done = run_cli(*FLAGS, *extra, "--cpu-devices", "8", "--run-dir", str(tmp_path / "ref"),
                   "--save-params", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return saved_params(out)


def test_sigusr1_saves_exits_75_and_the_same_command_resumes_bit_for_bit(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "params.npz"
    args = cli(*FLAGS, "--cpu-devices", "8", "--run-dir", str(run_dir), "--save-params", str(out))
    proc = start(args)
    wait_for_steps(run_dir, 20, proc)
    proc.send_signal(signal.SIGUSR1)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 75, text[-2000:]
    stopped = int(re.search(r"stopped after step (\d+) on SIGUSR1", text)[1])
    assert checkpoint_steps(run_dir)[0] == stopped
    assert not out.exists()  # stopped: no final params
    again = run_cli(*args[3:])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from the checkpoint of step {stopped}" in again.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == list(range(1, STEPS + 1))  # no step twice, none missing
    got, want = saved_params(out), reference(tmp_path)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_sigterm_to_one_of_two_processes_then_resume_on_one(tmp_path):
    """SIGTERM (SLURM's end, Kubernetes) to rank 1 only: both ranks stop after the same
    step and save; the run then continues on 1 process x 8 devices (elastic)."""
    run_dir, out = tmp_path / "run", tmp_path / "params.npz"
    launch = [sys.executable, "-m", "jaxdist.launch", "--nproc", "2", "--cpu-devices-per-proc",
              "4", "--grace", "30", "--"]  # fmt: skip
    train = [*FLAGS, "--run-dir", str(run_dir), "--save-params", str(out)]
    proc = start([*launch, *cli(*train)])
    wait_for_steps(run_dir, 20, proc)
    rank1 = _rank_pids(proc.pid)[1]
    subprocess.run(["kill", "-TERM", str(rank1)], check=True)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 75, text[-3000:]
    stops = re.findall(r"\[rank (\d)\] jaxdist: stopped after step (\d+) on SIGTERM to "
                       r"process 1; checkpoint saved", text)  # fmt: skip
    assert sorted(r for r, _ in stops) == ["0", "1"] and stops[0][1] == stops[1][1], text[-3000:]
    assert checkpoint_steps(run_dir)[0] == int(stops[0][1])
    again = run_cli(*train, "--cpu-devices", "8")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from the checkpoint of step {stops[0][1]}" in again.stdout
    got, want = saved_params(out), reference(tmp_path)
    flat = [np.concatenate([d[k].ravel() for k in sorted(want)]) for d in (got, want)]
    assert relative_error(*flat) < 1e-5


def _rank_pids(launcher_pid: int) -> list[int]:
    """The launcher's children (the ranks), in rank order (started in that order)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True)
        pids = sorted(int(p) for p in found.stdout.split())
        ranks = {}
        for pid in pids:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e for e in env if e.startswith(b"JAXDIST_PROCESS_ID=")]
            if rank:
                ranks[int(rank[0].split(b"=")[1])] = pid
        if len(ranks) == 2:
            return [ranks[0], ranks[1]]
        time.sleep(0.1)
    raise AssertionError("the launcher's 2 ranks were not found")


def test_a_signal_during_setup_stops_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(cli(*FLAGS, "--cpu-devices", "8", "--run-dir", str(run_dir)))
    line = proc.stdout.readline()  # "[rank 0] process 0/1: ..." comes before data and compile
    assert "process 0/1" in line, line
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 75, text[-2000:]
    assert checkpoint_steps(run_dir) == [1]  # stopped after the first step, saved


def test_kill_during_an_asynchronous_save_keeps_the_previous_checkpoint(tmp_path):
    """A state of ~100 MB (hidden 2048) takes a while to write: kill -9 while the
    checkpoint of step 4 is still a temporary directory. Step 2's stays usable, the
    partial one is ignored, then removed, and the resumed run ends as an uninterrupted one.
    One device: the save is the subject, and 8 replicas of the state made each step 3x
    slower here."""
    big = ["--steps", "6", "--checkpoint-every", "2", "--hidden", "2048", "--depth", "2",
           "--global-batch-size", "16", "--log-every", "1", "--compile-cache", "off"]  # fmt: skip
    run_dir, out = tmp_path / "run", tmp_path / "params.npz"
    args = cli(*big, "--cpu-devices", "1", "--run-dir", str(run_dir), "--save-params", str(out))
    proc = start(args)
    folder = run_dir / "checkpoints"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if folder.is_dir() and any(p.name.startswith("4.") for p in folder.iterdir()):
            break  # step 4's save has started and not finished
        time.sleep(0.005)
    proc.kill()
    proc.communicate(timeout=30)
    partial = [p.name for p in folder.iterdir() if "tmp" in p.name]
    assert partial, sorted(p.name for p in folder.iterdir())  # killed mid-save
    assert checkpoint_steps(run_dir) == [2]
    again = run_cli(*args[3:])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from the checkpoint of step 2" in again.stdout
    assert not [p for p in folder.iterdir() if "tmp" in p.name]  # cleaned up
    want_out = tmp_path / "want.npz"
    ref = run_cli(*big, "--cpu-devices", "1", "--run-dir", str(tmp_path / "ref"),
                  "--save-params", str(want_out))  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-2000:]
    got, want = saved_params(out), saved_params(want_out)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
