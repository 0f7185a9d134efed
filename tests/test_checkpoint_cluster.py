"""Whole process groups restarted, for real: a worker killed by SIGKILL under
``jaxdist.launch --max-restarts 2`` (before any checkpoint, then after one), and a SLURM
job stopped by SIGUSR1, requeued by slurm/8node.sh and resumed. All must end with the
params, bit for bit, of an uninterrupted launcher run of the same command: 2 processes x
4 CPU devices (1 x 8 is not the reference: its gradient sum runs in another order and
differs in the last bits). That run also shows the default run directory and the
compilation cache. (What the SLURM scripts do with each exit code: test_slurm_scripts.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import slurm_cluster
from group_helpers import gone_within
from helpers import launch, saved_params
from jaxdist.checkpoint.run_directory import checkpoint_steps

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 60, 5  # a stop lands between the first checkpoint and the end
TRAIN = [sys.executable, "-m", "jaxdist.train", "--steps", str(STEPS), "--log-every", "1"]
TRAIN += ["--global-batch-size", "32", "--hidden", "32", "--seed", "4"]
TRAIN += ["--heartbeat-timeout", "30"]
CHECKPOINTS = ["--checkpoint-every", str(EVERY)]
GROUP = ["--nproc", "2", "--cpu-devices-per-proc", "4"]
SLURM = pytest.mark.skipif(
    slurm_cluster.missing() is not None, reason=f"SLURM cluster: {slurm_cluster.missing()}"
)
pytestmark = pytest.mark.xdist_group("slurm")  # one local cluster at a time


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


# `python -m jaxdist.train` with rank 1's clock in 1999: a run directory named by each
# process's own clock would differ between the ranks.
SKEWED_TRAIN = """import os, runpy, time
real = time.strftime
def skewed(fmt, *t):
    return "19990101-000000" if fmt == "%Y%m%d-%H%M%S" else real(fmt, *t)
if os.environ["JAXDIST_PROCESS_ID"] == "1":
    time.strftime = skewed
runpy.run_module("jaxdist.train", run_name="__main__", alter_sys=True)
"""


@dataclass
class Uninterrupted:
    params: dict[str, np.ndarray]  # the reference for every restarted run here
    cwd: Path  # runs/<default run dir>, cache/xla (its compilation cache)
    output: str


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Uninterrupted:
    """The reference run, started as plain defaults would: no --run-dir and no run id
    (JAXDIST_RUN_ID empty: the launcher then names none), so process 0's clock names the
    run directory; its own compilation cache (on CPU jaxdist uses one only when given:
    ``jaxdist.train.resume.use_compile_cache``), with a minimum compile time of 0, so that
    every program is written however fast it compiles."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    (tmp / "skewed_train.py").write_text(SKEWED_TRAIN)
    out = tmp / "params.npz"
    env = {"JAXDIST_RUN_ID": "", "JAXDIST_CACHE": str(tmp / "cache")}
    env |= {"JAX_COMPILATION_CACHE_DIR": "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    done, _ = launch(
        *GROUP, "--", sys.executable, "skewed_train.py", *TRAIN[3:], *CHECKPOINTS,
        "--save-params", str(out), "--compile-cache", str(tmp / "cache" / "xla"),
        cwd=tmp, timeout=120, env_extra=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "resumed" not in done.stdout
    # The tests after this one compile as warm as they would have with the shared cache
    shared = Path(os.environ["JAXDIST_CACHE"]) / "xla"
    shutil.copytree(tmp / "cache" / "xla", shared, dirs_exist_ok=True)
    return Uninterrupted(saved_params(out), tmp, done.stdout)


def test_the_default_run_dir_is_process_0s_on_every_process(uninterrupted):
    """Had rank 1 named its own, it would be runs/mlp-gspmd-19990101-000000, and the
    checkpoint both processes write would not be complete in process 0's."""
    names = [p.name for p in (uninterrupted.cwd / "runs").iterdir()]
    assert len(names) == 1 and re.fullmatch(r"mlp-gspmd-20\d{6}-\d{6}", names[0]), names
    assert f"run dir runs/{names[0]}" in uninterrupted.output
    assert checkpoint_steps(uninterrupted.cwd / "runs" / names[0])[0] == STEPS


def test_the_compilation_cache_given_is_written(uninterrupted):
    """--compile-cache DIR: the compiled programs are there."""
    written = [p.name for p in (uninterrupted.cwd / "cache" / "xla").glob("*train_step*")]
    assert written, sorted(p.name for p in (uninterrupted.cwd / "cache").rglob("*"))


def test_a_worker_killed_twice_restarts_the_group_which_ends_bit_for_bit(
    tmp_path, launcher, uninterrupted
):
    """Rank 1 SIGKILLs itself at step 10 of the first start, before any checkpoint (the
    restarted group, the same run, trains afresh in its directory), then at step 50 of the
    second, after the checkpoint of step 30 (the third start resumes from it). The kills
    come from JAXDIST_FAULT's restart field: watching the run from outside left windows
    of 3 s that a loaded machine's run went past."""
    run_dir, out = tmp_path / "run", tmp_path / "params.npz"
    run = launcher(
        *GROUP, "--max-restarts", "2", "--", *TRAIN, "--checkpoint-every", "30",
        "--run-dir", str(run_dir), "--save-params", str(out),
        env={"JAXDIST_FAULT": "kill@1:10:0,kill@1:50:1"},
    )  # fmt: skip
    assert run.proc.wait(timeout=90) == 0, run.text()[-3000:]
    text = run.text()
    killed = "[launch] rank 1 failed with exit code 137: it was killed by SIGKILL"
    assert text.count(killed) == 2 and "[launch] restart 2/2" in text, text[-3000:]
    restarted = r"\[rank 0\] jaxdist: note: restarting run \S+ in \S+ from step 0: an earlier"
    assert re.search(restarted, text), text[-3000:]
    assert "[rank 0] resumed from the checkpoint of step 30 in " in text, text[-3000:]
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))  # none twice, none missing
    assert_bitwise_equal(saved_params(out), uninterrupted.params)
    assert gone_within(run.below() | run.seen, 5), "processes left behind"


def job_state(job_id: str, env: dict, tries: int = 10) -> dict[str, str]:
    """``scontrol show job``'s KEY=VALUE fields. On a loaded 2-core machine slurmctld
    sometimes does not answer in time (scontrol exits non-zero, prints nothing): ask again."""
    for _ in range(tries):
        shown = subprocess.run(
            ["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30
        )
        fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
        if "JobState" in fields:
            return fields
        time.sleep(1)
    raise AssertionError(f"scontrol show job {job_id} gave no JobState: {shown.stderr[-500:]}")


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
    train = ["--cpu-devices", "4", *TRAIN[3:], *CHECKPOINTS, "--save-params", str(out)]
    train += ["--init-timeout", "120"]
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
    assert_bitwise_equal(saved_params(out), uninterrupted.params)


# A stopped group whose processes exit 75 two seconds apart (rank 1 first)
# The training tasks exit 75, rank 0 two seconds after rank 1; the script's own python
# (python -m jaxdist.launch.requeue after srun) is the real one.
EXIT_75_APART = f"""#!/bin/sh
[ "$2" = jaxdist.train ] || exec {sys.executable} "$@"
[ "$SLURM_PROCID" = 0 ] && sleep 2
exit 75
"""


@SLURM
def test_processes_exiting_75_one_after_another_leave_srun_at_75(tmp_path, slurm_env):
    """srun's exit code is what the script requeues on. With --kill-on-bad-exit=1 the
    first exit 75 would kill rank 0 and srun would return 137. Here the limit is 0, so
    the script, seeing 75, says it does not requeue."""
    stand_in = tmp_path / "bin" / "python"  # found first on the job's PATH
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
