"""``mpirun -np 2 python -m jaxdist.train --cpu-devices 4 ...`` trains as one group of 2
processes (Open MPI's environment is a process group: jaxdist.cluster.environment) and
ends with the params of one process with 8 devices. ``.ci/run`` installs Open MPI (as
root, with Debian's openmpi-bin); elsewhere this skips, saying so."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import metrics_of, relative_error, run_cli, saved_params

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="Open MPI is not installed (mpirun not found): .ci/run installs openmpi-bin as root",
)

FLAGS = shlex.split("--steps 4 --log-every 1 --global-batch-size 32 --hidden 32 --seed 2")
FLAGS += shlex.split("--optimizer sgd --lr 0.3 --clip-norm 0 --warmup-steps 0")


def test_mpirun_np_2_trains_as_one_group_like_one_process_of_8(tmp_path):
    # root may run mpirun (CI runs as root), and 2 ranks fit whatever cores the machine has
    ompi = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1"}  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **ompi}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    two, train = tmp_path / "two", [sys.executable, "-m", "jaxdist.train"]
    command = ["mpirun", "-np", "2", *train, "--cpu-devices", "4", *FLAGS, "--run-dir", str(two),
               "--save-params", str(tmp_path / "two.npz")]  # fmt: skip
    proc = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "process 0/2: 4 local of 8 cpu devices" in text, text[-3000:]
    assert "process 1/2: 4 local of 8 cpu devices" in text, text[-3000:]
    one = tmp_path / "one"
    ref = run_cli(*FLAGS, "--cpu-devices", "8", "--run-dir", str(one),
                  "--save-params", str(tmp_path / "one.npz"))  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-2000:]
    got, want = [[r["loss"] for r in metrics_of(d)] for d in (two, one)]
    assert len(want) == 4 and want[-1] < want[0], want
    np.testing.assert_allclose(got, want, rtol=1e-5)
    params, expected = saved_params(tmp_path / "two.npz"), saved_params(tmp_path / "one.npz")
    assert sorted(params) == sorted(expected)
    for name in expected:
        assert relative_error(params[name], expected[name]) < 1e-5, name
