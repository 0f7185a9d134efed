"""A sharded layout across real processes: 2 processes x 4 CPU devices with
``--mesh fsdp=2,model=4``, so each fsdp pair spans both processes and each model group
stays inside one. For the built-in GPT and for a Linen transformer with Flax's logical
annotations and no jaxdist code (tests/linen_lm.py), the losses and the params saved at
the end (gathered from both processes' shards) equal a 1-device run's after 5 steps.
The built-in GPT on this layout, with every run feature, is tests/test_matrix.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import launch, relative_error
from jaxdist.train.config import parse_args
from jaxdist.train.trainer import train

COMMON = [
    *("--data", "grammar", "--seq-len", "16", "--optimizer", "sgd", "--lr", "0.5"),
    *("--steps", "5", "--log-every", "1", "--global-batch-size", "16"),
]
# 260: the 257 byte tokens padded to a multiple of model=4, as Megatron pads. One block
# holds every kind of annotated parameter; a second would only add compile time.
MODELS = {
    "gpt": [
        *("--model", "gpt", "--vocab-size", "260", "--d-model", "32", "--n-heads", "4"),
        *("--n-layers", "1"),
    ],
    "linen": [
        *("--model", "linen_lm:LinenLM", "--task", "lm", "--model-args"),
        "vocab=260,max_len=16,d_model=32,n_layers=1,n_heads=4,d_mlp=64",
    ],
}
TESTS = Path(__file__).resolve().parent  # the launched processes import linen_lm here


def one_device(args):
    """(losses, params) of ``train()`` on one device, in this process."""
    run = train(parse_args([*args, "--num-devices", "1"]), write=False, quiet=True)
    return [h["loss"] for h in run.history], run.dp.host_params(run.state)


def two_processes(args, tmp_path):
    """(losses, params) of the launcher's 2 processes x 4 devices, fsdp=2,model=4."""
    proc, _ = launch(
        *("--nproc", "2", "--cpu-devices-per-proc", "4", "--"),
        *(sys.executable, "-m", "jaxdist.train", *args, "--mesh", "fsdp=2,model=4"),
        *("--run-dir", str(tmp_path / "two"), "--save-params", str(tmp_path / "two.npz")),
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines], dict(np.load(tmp_path / "two.npz"))


@pytest.mark.parametrize("model", ["linen"])  # the GPT: tests/test_matrix.py
def test_fsdp_across_processes_equals_one_device(model, tmp_path):
    args = [*MODELS[model], *COMMON]
    want_losses, want = one_device(args)
    losses, got = two_processes(args, tmp_path)
    assert len(want_losses) == 5 and want_losses[-1] < want_losses[0], want_losses
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert sorted(got) == sorted(want) and len(want) > 10
    for name in want:
        assert relative_error(got[name], want[name]) < 1e-5, name
