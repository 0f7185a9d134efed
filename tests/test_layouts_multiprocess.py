"""A sharded layout across real processes: 2 processes x 4 CPU devices with
``--mesh fsdp=2,model=4``, so each fsdp pair spans both processes and each model group
stays inside one. The params saved at the end (gathered from both processes'
shards) equal a 1-device run's."""

from __future__ import annotations

import json
import sys

import numpy as np

from helpers import launch, relative_error, run_cli

GPT = [
    *("--model", "gpt", "--data", "grammar", "--vocab-size", "260", "--seq-len", "16"),
    *("--d-model", "32", "--n-heads", "4", "--optimizer", "sgd", "--lr", "0.5"),
    *("--steps", "3", "--log-every", "1", "--global-batch-size", "16"),
]


def losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fsdp_across_processes_saves_the_one_device_params(tmp_path):
    one = run_cli(*GPT, "--cpu-devices", "1", "--run-dir", str(tmp_path / "one"),
                  "--save-params", str(tmp_path / "one.npz"))  # fmt: skip
    assert one.returncode == 0, one.stderr
    proc, _ = launch(
        *("--nproc", "2", "--cpu-devices-per-proc", "4", "--"),
        *(sys.executable, "-m", "jaxdist.train", *GPT, "--mesh", "fsdp=2,model=4"),
        *("--run-dir", str(tmp_path / "two"), "--save-params", str(tmp_path / "two.npz")),
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)
    want, got = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert sorted(got.files) == sorted(want.files) and len(want.files) > 10
    for name in want.files:
        assert relative_error(got[name], want[name]) < 1e-5, name
