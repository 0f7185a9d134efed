"""Whole process groups restarted, for real: a worker killed with ``kill -9`` under
``jaxdist.launch --max-restarts 1``, and a SLURM job stopped by SIGUSR1, requeued by
slurm/8node.sh and resumed. Both must end with the params, bit for bit, of an
uninterrupted launcher run of the same command: 2 processes x 4 CPU devices (1 x 8 is
not the reference: its gradient sum runs in another order and differs in the last bits).
The SLURM scripts' requeue limit is checked with stand-ins for ``srun`` and ``scontrol``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_launch_robust import Launcher, gone_within

import slurm_cluster
from helpers import launch
from jaxdist.rundir import checkpoint_steps

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 60, 5  # a stop lands between the first checkpoint and the end
TRAIN = [sys.executable, "-m", "jaxdist.train", "--steps", str(STEPS), "--log-every", "1"]
TRAIN += ["--checkpoint-every", str(EVERY), "--global-batch-size", "32", "--hidden", "32"]
TRAIN += ["--seed", "4", "--heartbeat-timeout", "30"]
GROUP = ["--nproc", "2", "--cpu-devices-per-proc", "4"]
SLURM = pytest.mark.skipif(
    slurm_cluster.missing() is not None, reason=f"SLURM cluster: {slurm_cluster.missing()}"
)


def params(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {name: f[name] for name in f.files}


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert np.array_equal(got[name], want[name]), (name, np.abs(got[name] - want[name]).max())


def logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def past_first_checkpoint(run_dir: Path) -> bool:
    """A complete checkpoint exists and a later step has been logged."""
    steps, saved = logged_steps(run_dir), checkpoint_steps(run_dir)
    return bool(saved) and bool(steps) and steps[-1] > min(saved)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, np.ndarray]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = tmp / "params.npz"
    done, _ = launch(
        *GROUP, "--", *TRAIN, "--run-dir", str(tmp / "run"), "--save-params", str(out),
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "resumed" not in done.stdout
    return params(out)


@pytest.fixture
def launcher(tmp_path):
    started: list[Launcher] = []

    def start(*args: str) -> Launcher:
        started.append(Launcher(tmp_path, *args))
        return started[-1]

    yield start
    for one in started:
        one.close()


def test_a_worker_killed_mid_run_restarts_the_group_which_ends_bit_for_bit(
    tmp_path, launcher, uninterrupted
):
    run_dir, out = tmp_path / "run", tmp_path / "params.npz"
    run = launcher(
        *GROUP, "--max-restarts", "1", "--",
        *TRAIN, "--run-dir", str(run_dir), "--save-params", str(out),
    )  # fmt: skip
    run.wait_for(lambda: past_first_checkpoint(run_dir), 90, "a step after the first checkpoint")
    ranks = run.ranks()
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGKILL)
    assert run.proc.wait(timeout=90) == 0, run.text()[-3000:]
    text = run.text()
    assert "[launch] rank 1 failed with exit code 137: it was killed by SIGKILL" in text
    assert "[launch] restart 1/1" in text
    resumed = int(re.search(r"\[rank 0\] resumed from the checkpoint of step (\d+)", text)[1])
    assert resumed % EVERY == 0 and EVERY <= resumed < STEPS, resumed
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))  # none twice, none missing
    assert_bitwise_equal(params(out), uninterrupted)
    assert gone_within(run.below() | run.seen, 5), "processes left behind"


def job_state(job_id: str, env: dict) -> dict[str, str]:
    """``scontrol show job``'s KEY=VALUE fields."""
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30
    ).stdout
    return dict(item.split("=", 1) for item in shown.split() if "=" in item)


def job_processes(job_id: str) -> list[int]:
    """Processes whose environment says they belong to SLURM job ``job_id``."""
    mark, found = f"SLURM_JOB_ID={job_id}".encode(), []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def wait_until(condition, seconds: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            text = log.read_text() if log.exists() else "(no log)"
            raise AssertionError(f"no {what} within {seconds}s; job log:\n{text[-3000:]}")
        time.sleep(0.2)


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def wait_for_end(job_id: str, env: dict, log: Path, seconds: float) -> dict[str, str]:
    """The job's final ``scontrol`` fields, once it has ended and its processes are gone."""
    ended = lambda: job_state(job_id, env).get("JobState") in ENDED  # noqa: E731
    wait_until(ended, seconds, f"end of job {job_id}", log)
    wait_until(lambda: not job_processes(job_id), 15, f"end of job {job_id}'s processes", log)
    return job_state(job_id, env)


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    """One local cluster for this module's jobs; the environment to submit them with."""
    with slurm_cluster.cluster(tmp_path_factory.mktemp("cluster")) as env:
        env = {
            **env,
            "JAXDIST_PLATFORM": "cpu",
            "JAX_PLATFORMS": "cpu",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        }
        env.pop("JAX_NUM_CPU_DEVICES", None)
        yield env


@contextlib.contextmanager
def submitted(job_dir: Path, env: dict, *args: str):
    """``sbatch ARGS`` in ``job_dir``; yields the job id; on the way out cancels the job
    and kills its processes (nothing to do once it has ended)."""
    submit = subprocess.run(
        ["sbatch", "--parsable", *args],
        cwd=job_dir, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    try:
        yield job_id
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
        for pid in job_processes(job_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# The README's command for a CPU-only cluster, on 2 nodes
ON_2_CPU_NODES = ["--nodes=2", "--gpus-per-node=0", "--ntasks-per-node=1"]
ON_2_CPU_NODES += [str(ROOT / "slurm/8node.sh")]


@SLURM
def test_a_slurm_job_stopped_by_usr1_is_requeued_and_resumes_bit_for_bit(
    tmp_path, slurm_env, uninterrupted
):
    out = tmp_path / "params.npz"
    train = ["--cpu-devices", "4", *TRAIN[3:], "--save-params", str(out), "--init-timeout", "120"]
    # No --run-dir: the default one is named by the job id, which the requeued job keeps.
    run_dirs = lambda: list(tmp_path.glob(f"runs/*-slurm{job_id}"))  # noqa: E731
    with submitted(tmp_path, slurm_env, *ON_2_CPU_NODES, *train) as job_id:
        log = tmp_path / f"jaxdist-{job_id}.out"
        progressed = lambda: run_dirs() and past_first_checkpoint(run_dirs()[0])  # noqa: E731
        wait_until(progressed, 90, "a step after the first checkpoint", log)
        # What SLURM's --signal=USR1@120 does: SIGUSR1 to the tasks of the job's steps.
        subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm_env, check=True, timeout=30)
        state = wait_for_end(job_id, slurm_env, log, 90)
    text = log.read_text()
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0")
    stopped = int(re.search(r"stopped after step (\d+) on SIGUSR1", text)[1])
    assert f"jaxdist: exit 75: requeueing job {job_id} (1 of 20)" in text  # srun returned 75
    assert f"resumed from the checkpoint of step {stopped} in " in text
    assert logged_steps(run_dirs()[0]) == list(range(1, STEPS + 1))  # none twice, none missing
    assert_bitwise_equal(params(out), uninterrupted)


# A stopped group whose processes exit 75 two seconds apart (rank 1 first)
EXIT_75_APART = '#!/bin/sh\n[ "$SLURM_PROCID" = 0 ] && sleep 2\nexit 75\n'


@SLURM
def test_processes_exiting_75_one_after_another_leave_srun_at_75(tmp_path, slurm_env):
    """srun's exit code is what the script requeues on. With --kill-on-bad-exit=1 the
    first exit 75 would kill rank 0 and srun would return 137. Here the limit is 0, so
    the script, seeing 75, says it does not requeue."""
    stand_in = tmp_path / "bin" / "python"  # found first on the tasks' PATH
    stand_in.parent.mkdir()
    stand_in.write_text(EXIT_75_APART)
    stand_in.chmod(0o755)
    env = {**slurm_env, "PATH": f"{stand_in.parent}{os.pathsep}{slurm_env['PATH']}"}
    env["JAXDIST_MAX_REQUEUES"] = "0"
    with submitted(tmp_path, env, *ON_2_CPU_NODES) as job_id:
        log = tmp_path / f"jaxdist-{job_id}.out"
        state = wait_for_end(job_id, env, log, 60)
    text = log.read_text()
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("FAILED", "0", "75:0")
    assert f"not requeueing job {job_id}: requeued 0 times" in text, text


def stand_ins(tmp_path: Path) -> dict[str, str]:
    """A PATH whose ``srun`` exits 75 (a stopped run) and whose ``scontrol`` records its
    arguments in ``scontrol.log``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 75\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7"}


@pytest.mark.parametrize("script", ["1node.sh", "8node.sh"])
@pytest.mark.parametrize(
    ("restarts", "limit", "requeued"),
    [(None, None, "1 of 20"), ("19", None, "20 of 20"), ("20", None, None), ("2", "2", None)],
)
def test_the_scripts_requeue_on_75_at_most_jaxdist_max_requeues_times(
    tmp_path, script, restarts, limit, requeued
):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXDIST_"))}
    env.update(stand_ins(tmp_path))
    if restarts is not None:  # SLURM leaves it unset on a job's first start
        env["SLURM_RESTART_COUNT"] = restarts
    if limit is not None:
        env["JAXDIST_MAX_REQUEUES"] = limit
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 75, done.stderr
    scontrol_log = tmp_path / "scontrol.log"
    if requeued:
        assert f"jaxdist: exit 75: requeueing job 7 ({requeued})" in done.stdout
        assert scontrol_log.read_text() == "requeue 7\n"
    else:
        assert f"not requeueing job 7: requeued {restarts} times" in done.stdout, done.stdout
        assert not scontrol_log.exists()
