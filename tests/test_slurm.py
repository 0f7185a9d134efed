"""slurm/8node.sh on a real SLURM cluster of 8 nodes on this machine (CPU, 1 device each).

Submitted exactly as the README says for a CPU-only cluster:
    JAXDIST_PLATFORM=cpu sbatch --gpus-per-node=0 --ntasks-per-node=1 slurm/8node.sh \\
        --cpu-devices 1 <train args>
and compared with one process of 8 devices."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import slurm_cluster
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ARGS = shlex.split("--steps 4 --log-every 1 --global-batch-size 32 --hidden 32 --seed 2")
TRAIN_ARGS += ["--strategy", "shard_map"]

pytestmark = [
    pytest.mark.skipif(
        slurm_cluster.missing() is not None, reason=f"SLURM cluster: {slurm_cluster.missing()}"
    ),
    pytest.mark.xdist_group("slurm"),  # one local cluster at a time (its ports, its hosts)
]


def test_8node_script_trains_8_processes_like_one(tmp_path):
    ref_args = ["--cpu-devices", "8", "--run-dir", str(tmp_path / "ref")]
    ref = run_cli(*TRAIN_ARGS, *ref_args, "--save-params", str(tmp_path / "ref.npz"))
    assert ref.returncode == 0, ref.stderr
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    with slurm_cluster.cluster(tmp_path / "cluster") as env:
        env = {
            **env,
            "JAXDIST_PLATFORM": "cpu",
            "JAX_PLATFORMS": "cpu",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        }
        env.pop("JAX_NUM_CPU_DEVICES", None)
        # exactly the README's command for a CPU-only cluster, plus this test's train args
        sbatch = shlex.split("sbatch --wait --gpus-per-node=0 --ntasks-per-node=1")
        job_args = ["--run-dir", str(job_dir / "run"), "--save-params", str(job_dir / "params.npz")]
        job_args += shlex.split("--init-timeout 120 --heartbeat-timeout 30")
        submit = subprocess.run(
            [*sbatch, str(ROOT / "slurm/8node.sh"), "--cpu-devices", "1", *TRAIN_ARGS, *job_args],
            cwd=job_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        logs = "\n".join(p.read_text() for p in job_dir.glob("*.out"))
        assert submit.returncode == 0, submit.stdout + submit.stderr + logs
    for rank in range(8):  # 8 processes, one device each, in one group
        assert f"[rank {rank}] process {rank}/8: 1 local of 8 cpu devices" in logs, logs
    got = [json.loads(x) for x in (job_dir / "run/metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (tmp_path / "ref/metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([x["loss"] for x in got], [x["loss"] for x in want], rtol=1e-6)
    got_params, want_params = np.load(job_dir / "params.npz"), np.load(tmp_path / "ref.npz")
    for name in want_params.files:
        np.testing.assert_allclose(got_params[name], want_params[name], rtol=1e-5, atol=1e-7)
